"""Chroma test pieces shared by several test modules (no test module imports another): the tiny ChromaPipeline
twin, its fixture and its reference run on diffusers' own prompt embeddings (tests/test_chroma_pipeline.py, whose
note says why the mask is made boolean), and diffusers' single-file converter at the tiny width
(tests/test_chroma_transformer.py)."""

import inspect

import numpy as np
import pytest
import torch

import parity
from helpers import ASSETS, FIXTURES, max_rel_err, randomize_


H, W = 40, 24      # non-square; multiples of 2 (the VAE) x 2 (the patches)
LATENT = 5
SEQUENCE = 40      # T5 tokens: short prompts leave padding to mask


def chroma_components(seed=0):
    """A tiny ChromaPipeline, every dimension distinct: T5 44 wide, a transformer 48 wide (3 heads of 16, RoPE axes
    4, 6, 6; approximator 28 wide over 12 input channels), a 5-channel VAE, FLUX.1-dev's scheduler."""
    from diffusers import AutoencoderKL, ChromaTransformer2DModel, FlowMatchEulerDiscreteScheduler
    from transformers import T5Config, T5EncoderModel, T5TokenizerFast
    torch.manual_seed(seed)
    t5 = T5EncoderModel(T5Config(
        vocab_size=32128, d_model=44, d_kv=10, d_ff=60, num_layers=2, num_heads=3, feed_forward_proj="gated-gelu",
        relative_attention_num_buckets=10, relative_attention_max_distance=24))
    transformer = ChromaTransformer2DModel(
        patch_size=1, in_channels=4 * LATENT, num_layers=2, num_single_layers=2, attention_head_dim=16,
        num_attention_heads=3, joint_attention_dim=44, axes_dims_rope=(4, 6, 6), approximator_num_channels=12,
        approximator_hidden_dim=28, approximator_layers=2)
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, block_out_channels=(8, 12), layers_per_block=1, latent_channels=LATENT,
        norm_num_groups=4, down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
        scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False)
    for i, m in enumerate((t5, transformer, vae)):
        randomize_(m, seed=seed * 10 + i, scale=0.15)
        m.eval()
    t5_file = FIXTURES / "t5" if (FIXTURES / "t5" / "tokenizer.json").exists() else ASSETS / "t5"
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                                                base_image_seq_len=256, max_image_seq_len=4096)
    return dict(transformer=transformer, vae=vae, text_encoder=t5, scheduler=scheduler,
                tokenizer=T5TokenizerFast(tokenizer_file=str(t5_file / "tokenizer.json"), model_max_length=512))


@pytest.fixture(scope="module")
def chroma_tiny(tmp_path_factory):
    from diffusers import ChromaPipeline
    folder = tmp_path_factory.mktemp("chroma_pipe")
    ChromaPipeline(**chroma_components()).save_pretrained(str(folder))
    return folder, ChromaPipeline.from_pretrained(str(folder))


def diffusers_prompt(pipe, prompt):
    """diffusers' own T5 embeddings and mask for a prompt, the mask made boolean (see the module's note)."""
    with torch.no_grad():
        embeds, mask = pipe._get_t5_prompt_embeds(prompt, max_sequence_length=SEQUENCE)
    return embeds, mask > 0


def packed_noise(seed):
    return np.random.default_rng(seed).standard_normal((1, (H // 4) * (W // 4), 4 * LATENT)).astype(np.float32)


def reference_run(pipe, noise=None, prompt=None, negative_prompt=None, generator_seed=None, **kw):
    """One diffusers run on its own prompt embeddings (mask made boolean) from the packed noise, or from a generator
    seeded afresh: (its final latents, unpacked to the VAE's layout, from the step callback; its image in [0, 1])."""
    final = {}

    def keep_latents(_, i, t, tensors):
        final["latents"] = tensors["latents"]
        return {}
    pe, pm = diffusers_prompt(pipe, prompt)
    if negative_prompt is not None:
        kw["negative_prompt_embeds"], kw["negative_prompt_attention_mask"] = diffusers_prompt(pipe, negative_prompt)
    if noise is not None:
        kw["latents"] = torch.from_numpy(noise)
    if generator_seed is not None:
        kw["generator"] = torch.Generator().manual_seed(generator_seed)
    image = pipe(prompt_embeds=pe, prompt_attention_mask=pm, height=H, width=W, output_type="np",
                 callback_on_step_end=keep_latents, **kw).images[0]
    return pipe._unpack_latents(final["latents"], H, W, pipe.vae_scale_factor).numpy(), image


def check_parity(result, ref_latents, ref_image, what):
    """mlxdiff's latents within LATENT_TOL of diffusers', its image within IMAGE_LEVELS."""
    err = max_rel_err(result.latents, ref_latents)
    shift = parity.levels(result.image, ref_image)
    print(f"{what}: latents max_rel_err {err:.2e}, image {shift}/255")
    assert err <= parity.LATENT_TOL and shift <= parity.IMAGE_LEVELS
    return err


def diffusers_converter(width):
    """diffusers' convert_chroma_transformer_checkpoint_to_diffusers with its hard-coded width (3072) set to the
    test's: the reference for the original names at tiny sizes."""
    from diffusers.loaders import single_file_utils
    source = inspect.getsource(single_file_utils.convert_chroma_transformer_checkpoint_to_diffusers)
    assert "inner_dim = 3072" in source
    namespace = dict(vars(single_file_utils))
    exec(source.replace("inner_dim = 3072", f"inner_dim = {width}"), namespace)
    return namespace["convert_chroma_transformer_checkpoint_to_diffusers"]
