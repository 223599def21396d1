"""The UNet family under a memory budget (issue 45): its down / mid / up blocks stream from the file as FLUX.2's and
SD3.5's blocks do, and the image is the resident run's (it ended in AttributeError: 'StreamedBlock' object has no
attribute 'resnets')."""

import numpy as np
import pytest
import torch

import mlxdiff
from helpers import ASSETS, randomize_


@pytest.fixture(scope="module")
def sd_folder(tmp_path_factory):
    from diffusers import (AutoencoderKL, EulerDiscreteScheduler, StableDiffusionPipeline, UNet2DConditionModel)
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer
    torch.manual_seed(0)
    unet = UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, block_out_channels=(64, 72, 80, 96), norm_num_groups=8,
        layers_per_block=1, down_block_types=("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
        up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3, cross_attention_dim=24, attention_head_dim=8)
    text = CLIPTextModel(CLIPTextConfig(vocab_size=49408, hidden_size=24, intermediate_size=40, num_hidden_layers=2,
                                        num_attention_heads=4, max_position_embeddings=77))
    vae = AutoencoderKL(block_out_channels=(8, 16), layers_per_block=1, latent_channels=4, norm_num_groups=4,
                        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2)
    for i, m in enumerate((unet, text, vae)):
        randomize_(m, seed=30 + i, scale=0.15).eval()
    tokenizer = CLIPTokenizer(str(ASSETS / "clip" / "vocab.json"), str(ASSETS / "clip" / "merges.txt"),
                              model_max_length=77)
    folder = tmp_path_factory.mktemp("sd_stream")
    StableDiffusionPipeline(unet=unet, vae=vae, text_encoder=text, tokenizer=tokenizer,
                            scheduler=EulerDiscreteScheduler(beta_schedule="scaled_linear", beta_start=0.00085,
                                                             beta_end=0.012), safety_checker=None,
                            feature_extractor=None, requires_safety_checker=False).save_pretrained(str(folder))
    unet_bytes = sum(p.numel() * 4 for p in unet.parameters())
    return folder, unet_bytes


def test_the_unet_streams_with_the_resident_image(sd_folder):
    folder, unet_bytes = sd_folder
    noise = np.random.default_rng(2).standard_normal((1, 4, 16, 16)).astype(np.float32)
    kwargs = dict(width=32, height=32, steps=2, guidance=5.0, latents=noise, progress_bar=False)
    resident = mlxdiff.load(str(folder)).generate("a red fox", **kwargs)
    limit = 0.9 * unet_bytes / 1024 ** 3        # below the UNet's weights: some of its blocks must stream
    streamed = mlxdiff.load(str(folder), memory_limit=limit).generate("a red fox", **kwargs)
    notes = " / ".join(streamed.notes)
    assert "unet:" in notes and "streamed from the file" in notes, notes
    assert np.array_equal(streamed.latents, resident.latents)
    assert np.array_equal(np.asarray(streamed.image), np.asarray(resident.image))
