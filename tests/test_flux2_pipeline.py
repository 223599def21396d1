"""End to end: mlxdiff's FLUX.2 pipelines against diffusers' Flux2Pipeline (dev: Mistral3 encoder, embedded
guidance) and Flux2KleinPipeline (Qwen3 encoder; base with CFG, distilled without), on the same injected noise."""

import numpy as np
import pytest
import torch

import mlxdiff
from mlxdiff.errors import MlxdiffError
from test_text_llm import (MISTRAL_TEMPLATE, QWEN3_TEMPLATE, build_tokenizer, save_mistral3, save_qwen3)
from test_vae import make_flux2_twin

H, W = 24, 40            # latent 12x20 (VAE factor 2) -> 6x10 patches
TAPS = (1, 3, 4)
SEQ = 48


def _transformer(joint, guidance, seed):
    from diffusers import Flux2Transformer2DModel
    from helpers import randomize_
    model = Flux2Transformer2DModel(
        patch_size=1, in_channels=20, out_channels=None, num_layers=2, num_single_layers=2, attention_head_dim=16,
        num_attention_heads=3, joint_attention_dim=joint, timestep_guidance_channels=32, mlp_ratio=2.5,
        axes_dims_rope=(4, 4, 4, 4), rope_theta=2000, eps=1e-6, guidance_embeds=guidance)
    return randomize_(model, seed=seed, scale=0.15).eval()


def _scheduler():
    from diffusers import FlowMatchEulerDiscreteScheduler
    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True,
                                           base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
                                           max_image_seq_len=4096, time_shift_type="exponential")


def _vae(seed):
    return make_flux2_twin(dict(block_out_channels=(8, 12), layers_per_block=1, latent_channels=5,
                                norm_num_groups=4), seed)


@pytest.fixture(scope="module", params=["klein_base", "klein_distilled", "dev"])
def saved_pipeline(request, tmp_path_factory):
    return build_pipeline(request.param, tmp_path_factory.mktemp(f"flux2_{request.param}"))


def build_pipeline(kind, root):
    from diffusers import Flux2KleinPipeline, Flux2Pipeline
    if kind == "dev":
        text = dict(hidden_size=48, intermediate_size=80, num_hidden_layers=6, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=20, vocab_size=333, rope_theta=1e6, sliding_window=None)
        vision = dict(hidden_size=32, intermediate_size=40, num_hidden_layers=1, num_attention_heads=2, head_dim=16,
                      image_size=28, patch_size=14)
        encoder = save_mistral3(root / "te_src", text, vision, seed=3)
        tok_dir = build_tokenizer(root / "tok_src", ["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]",
                                                     "[/SYSTEM_PROMPT]", "<pad>", "[IMG]"], MISTRAL_TEMPLATE, "left",
                                  "<pad>", "<s>", "</s>", add_bos=True)
        cls, extra, joint = Flux2Pipeline, {}, 3 * 48
    else:
        text = dict(hidden_size=40, intermediate_size=72, num_hidden_layers=5, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=12, vocab_size=321, rope_theta=1e6)
        encoder = save_qwen3(root / "te_src", text, seed=5)
        tok_dir = build_tokenizer(root / "tok_src", ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>",
                                                     "</think>"], QWEN3_TEMPLATE, "right", "<|endoftext|>",
                                  eos="<|im_end|>")
        cls, extra, joint = Flux2KleinPipeline, {"is_distilled": kind == "klein_distilled"}, 3 * 40
    from transformers import AutoTokenizer
    pipe = cls(scheduler=_scheduler(), vae=_vae(7), text_encoder=encoder.float().eval(),
               tokenizer=AutoTokenizer.from_pretrained(str(tok_dir)),
               transformer=_transformer(joint, kind == "dev", 11), **extra)
    folder = root / "pipeline"
    pipe.save_pretrained(str(folder))
    return kind, folder, cls.from_pretrained(str(folder))


def test_flux2_pipeline_matches_diffusers(saved_pipeline):
    kind, folder, pipe = saved_pipeline
    noise = np.random.default_rng(2).standard_normal((1, 20, H // 4, W // 4)).astype(np.float32)
    guidance = 1.0 if kind == "klein_distilled" else 3.5
    ref = pipe(prompt="a red fox in the snow", height=H, width=W, num_inference_steps=3, guidance_scale=guidance,
               latents=torch.from_numpy(noise), max_sequence_length=SEQ, text_encoder_out_layers=TAPS,
               output_type="np").images[0]
    ours = mlxdiff.load(str(folder)).generate("a red fox in the snow", width=W, height=H, steps=3,
                                              guidance=guidance, latents=noise, max_sequence_length=SEQ,
                                              text_encoder_out_layers=TAPS, progress_bar=False)
    img = np.asarray(ours.image).astype(np.float32) / 255.0
    assert img.shape == ref.shape
    assert np.abs(img - (ref * 255).round() / 255.0).max() <= 2 / 255
    assert ours.latents.shape == noise.shape


def test_joint_attention_mismatch_is_one_clear_line(tmp_path):
    _, folder, _ = build_pipeline("klein_base", tmp_path)
    with pytest.raises(MlxdiffError, match="joint_attention_dim"):
        mlxdiff.load(str(folder)).generate("a cat", width=W, height=H, steps=1, max_sequence_length=SEQ,
                                           text_encoder_out_layers=(1, 3), progress_bar=False)
