"""FLUX.1 test pieces shared by several test modules (no test module imports another): the tiny FluxPipeline twin
and its reference run (tests/test_flux1_pipeline.py), the tiny transformer twins and their forwards
(tests/test_flux1_transformer.py), diffusers' single-file converter at the tiny widths, and the GGUF transformer
twin's config and inputs (tests/test_flux1_gguf.py)."""


import inspect

import numpy as np
import torch

import mlxdiff  # noqa: F401  (OpenBLAS preload before mlx)
import mlx.core as mx

import parity
from helpers import ASSETS, FIXTURES, max_rel_err, randomize_

# -- the tiny FluxPipeline (tests/test_flux1_pipeline.py) --------------------------------------------------------------

H, W = 40, 24      # non-square; multiples of vae_scale_factor (2) * 2 (the 2x2 patches)
LATENT = 5         # VAE latent channels: the transformer takes 4 x 5 = 20


def flux1_components(variant, seed=0):
    """A tiny FluxPipeline, every dimension distinct: CLIP-L 36 wide (pooled), T5 44 wide, a transformer 48 wide
    (3 heads of 16, RoPE axes 4, 6, 6), a 5-channel VAE. dev: guidance embedder and dev's scheduler (dynamic
    shifting); schnell: neither (shift 1)."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer, T5Config, T5EncoderModel, T5TokenizerFast
    torch.manual_seed(seed)
    clip = CLIPTextModel(CLIPTextConfig(
        vocab_size=49408, hidden_size=36, intermediate_size=52, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=77, hidden_act="quick_gelu", bos_token_id=49406, eos_token_id=49407, pad_token_id=1))
    t5 = T5EncoderModel(T5Config(
        vocab_size=32128, d_model=44, d_kv=10, d_ff=60, num_layers=2, num_heads=3, feed_forward_proj="gated-gelu",
        relative_attention_num_buckets=10, relative_attention_max_distance=24))
    dev = variant == "dev"
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=4 * LATENT, num_layers=2, num_single_layers=2, attention_head_dim=16,
        num_attention_heads=3, joint_attention_dim=44, pooled_projection_dim=36, guidance_embeds=dev,
        axes_dims_rope=(4, 6, 6))
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, block_out_channels=(8, 12), layers_per_block=1, latent_channels=LATENT,
        norm_num_groups=4, down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
        scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False)
    for i, m in enumerate((clip, t5, transformer, vae)):
        randomize_(m, seed=seed * 10 + i, scale=0.15)
        m.eval()
    vocab = FIXTURES / "clip" if (FIXTURES / "clip" / "vocab.json").exists() else ASSETS / "clip"
    t5_file = FIXTURES / "t5" if (FIXTURES / "t5" / "tokenizer.json").exists() else ASSETS / "t5"
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
        max_image_seq_len=4096) if dev else FlowMatchEulerDiscreteScheduler(shift=1.0, use_dynamic_shifting=False)
    return dict(transformer=transformer, vae=vae, text_encoder=clip, text_encoder_2=t5,
                tokenizer=CLIPTokenizer(str(vocab / "vocab.json"), str(vocab / "merges.txt"), model_max_length=77),
                tokenizer_2=T5TokenizerFast(tokenizer_file=str(t5_file / "tokenizer.json"), model_max_length=512),
                scheduler=scheduler)


def packed_noise(seed):
    return np.random.default_rng(seed).standard_normal((1, (H // 4) * (W // 4), 4 * LATENT)).astype(np.float32)


def reference_run(pipe, noise, generator_seed=None, height=H, width=W, **kw):
    """One diffusers run from the packed noise (a generator seeded afresh where the pipeline draws a VAE posterior):
    (its final latents, unpacked to the VAE's layout, from the step callback; its image in [0, 1])."""
    final = {}

    def keep_latents(_, i, t, tensors):
        final["latents"] = tensors["latents"]
        return {}
    if generator_seed is not None:
        kw["generator"] = torch.Generator().manual_seed(generator_seed)
    image = pipe(height=height, width=width, latents=torch.from_numpy(noise), output_type="np",
                 callback_on_step_end=keep_latents, **kw).images[0]
    return pipe._unpack_latents(final["latents"], height, width, pipe.vae_scale_factor).numpy(), image


def check_parity(result, ref_latents, ref_image, what):
    """mlxdiff's latents within LATENT_TOL of diffusers', its image within IMAGE_LEVELS."""
    err = max_rel_err(result.latents, ref_latents)
    shift = parity.levels(result.image, ref_image)
    print(f"{what}: latents max_rel_err {err:.2e}, image {shift}/255; notes {result.notes}")
    assert err <= parity.LATENT_TOL and shift <= parity.IMAGE_LEVELS
    return err


# -- the tiny transformers (tests/test_flux1_transformer.py) -----------------------------------------------------------

# Within each config every dimension differs from the others (heads, head dim, D, 4D, 5D, 7D, in, out, joint, pooled,
# text length, image tokens), so a swapped axis cannot pass. The RoPE axes are unequal, as FLUX.1's (16, 56, 56).
CONFIGS = {
    # dev-like: guidance embedder, out_channels null (= in); head_dim / 8 then halves, as config_from_original infers
    "dev": dict(patch_size=1, in_channels=20, out_channels=None, num_layers=2, num_single_layers=3,
                attention_head_dim=32, num_attention_heads=3, joint_attention_dim=28, pooled_projection_dim=36,
                guidance_embeds=True, axes_dims_rope=(4, 14, 14)),
    # schnell-like: no guidance embedder, out != in (as Fill's 384 -> 64)
    "schnell": dict(patch_size=1, in_channels=52, out_channels=12, num_layers=1, num_single_layers=2,
                    attention_head_dim=24, num_attention_heads=2, joint_attention_dim=40, pooled_projection_dim=44,
                    guidance_embeds=False, axes_dims_rope=(4, 10, 10)),
}
GRID = {"dev": (3, 7), "schnell": (5, 6)}        # latent token grid (h, w)
REF_GRID = {"dev": (2, 3), "schnell": None}      # dev: Kontext's reference tokens appended (ids index 1)
TEXT_LEN = {"dev": 9, "schnell": 7}


def make_torch_model(name, seed, dtype=None):
    import torch
    from diffusers import FluxTransformer2DModel
    torch.manual_seed(seed)
    model = FluxTransformer2DModel(**CONFIGS[name])
    randomize_(model, seed=seed)
    return (model if dtype is None else model.to(dtype)).eval()


def make_inputs(name, seed=0):
    """Random latents, text and pooled vector; the position ids exactly as diffusers' FluxPipeline (and, for the
    reference tokens, FluxKontextPipeline) builds them."""
    import torch
    from diffusers import FluxPipeline
    cfg, (h, w), batch = CONFIGS[name], GRID[name], 2
    rng = np.random.default_rng(seed)
    img_ids = FluxPipeline._prepare_latent_image_ids(batch, 2 * h, 2 * w, "cpu", torch.float32)   # (0, row, col)
    if REF_GRID[name]:
        ref_ids = FluxPipeline._prepare_latent_image_ids(batch, 2 * REF_GRID[name][0], 2 * REF_GRID[name][1], "cpu",
                                                         torch.float32)
        ref_ids[..., 0] = 1                                  # FluxKontextPipeline: the image's index is 1
        img_ids = torch.cat([img_ids, ref_ids])
    n_img = img_ids.shape[0]
    text = rng.standard_normal((batch, TEXT_LEN[name], cfg["joint_attention_dim"])).astype(np.float32)
    inputs = dict(hidden_states=rng.standard_normal((batch, n_img, cfg["in_channels"])).astype(np.float32),
                  encoder_hidden_states=text,
                  pooled_projections=rng.standard_normal((batch, cfg["pooled_projection_dim"])).astype(np.float32),
                  timestep=np.array([0.9731, 0.2125], dtype=np.float32),       # sigmas: the pipeline's t / 1000
                  img_ids=img_ids.numpy(), txt_ids=np.zeros((TEXT_LEN[name], 3), dtype=np.float32))
    assert len(np.unique(inputs["img_ids"], axis=0)) == n_img                   # every image token has its own id
    if cfg["guidance_embeds"]:
        inputs["guidance"] = np.array([3.5, 2.0], dtype=np.float32)
    return inputs


def torch_forward(model, inputs):
    import torch
    with torch.no_grad():
        out = model(**{k: torch.from_numpy(v) for k, v in inputs.items()}, return_dict=False)
    return out[0].float().numpy()


def mlx_forward(model, inputs):
    return np.array(model(**{k: mx.array(v) for k, v in inputs.items()}).astype(mx.float32))


def diffusers_converter(width):
    """diffusers' convert_flux_transformer_checkpoint_to_diffusers with its hard-coded width (3072, FLUX.1's) set to
    `width`: the reference for our key map at the tests' tiny sizes."""
    from diffusers.loaders import single_file_utils
    source = inspect.getsource(single_file_utils.convert_flux_transformer_checkpoint_to_diffusers)
    assert "inner_dim = 3072" in source
    namespace = dict(vars(single_file_utils))
    exec(source.replace("inner_dim = 3072", f"inner_dim = {width}"), namespace)
    return namespace["convert_flux_transformer_checkpoint_to_diffusers"]


# -- the GGUF transformer twin (tests/test_flux1_gguf.py) --------------------------------------------------------------

# D = 256 (4 heads of 64) so that every quantized in-dim (D, 4D, 5D) is a multiple of 256; the others differ
GGUF_CONFIG = dict(patch_size=1, in_channels=24, out_channels=None, num_layers=2, num_single_layers=2,
                   attention_head_dim=64, num_attention_heads=4, joint_attention_dim=40, pooled_projection_dim=52,
                   guidance_embeds=True, axes_dims_rope=(8, 28, 28))


def gguf_inputs(seed=0, grid=(4, 5), text_len=6):
    import torch
    from diffusers import FluxPipeline
    rng = np.random.default_rng(seed)
    return dict(hidden_states=rng.standard_normal((2, grid[0] * grid[1], 24)).astype(np.float32),
                encoder_hidden_states=rng.standard_normal((2, text_len, 40)).astype(np.float32),
                pooled_projections=rng.standard_normal((2, 52)).astype(np.float32),
                timestep=np.array([0.9731, 0.2125], np.float32), guidance=np.array([3.5, 2.0], np.float32),
                img_ids=FluxPipeline._prepare_latent_image_ids(1, *grid, "cpu", torch.float32).numpy(),
                txt_ids=np.zeros((text_len, 3), np.float32))
