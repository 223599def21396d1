"""Z-Image test pieces shared by several test modules (no test module imports another): the tiny ZImagePipeline
fixture and its reference run (tests/test_zimage_pipeline.py), the mask picture of the inpainting tests
(tests/test_zimage_img2img.py), the transformer's diffusers -> original name map (tests/test_zimage_transformer.py)
and the LoRA tests' tiny transformer config (tests/test_zimage_lora.py)."""

import numpy as np
import PIL.Image
import pytest
import torch

import mlxdiff
import parity
from helpers import max_rel_err, randomize_
from twins import QWEN3_TEMPLATE, build_tokenizer, save_qwen3

# -- the tiny ZImagePipeline (tests/test_zimage_pipeline.py) -----------------------------------------------------------

H, W = 32, 48      # non-square; multiples of 2 (the VAE) x 2 (the patches): latents 16 x 24, 8 x 12 tokens
LATENT = 4
SEQ = 48           # prompt tokens: the short prompts leave padding to drop
TEXT = dict(hidden_size=40, intermediate_size=72, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
            head_dim=12, vocab_size=321, rope_theta=1e6)


@pytest.fixture(scope="module")
def zimage_tiny(tmp_path_factory):
    """A tiny ZImagePipeline: Qwen3 40 wide (3 layers, so hidden_states[-2] is layer 2's output), a transformer 64
    wide (2 heads of 32, RoPE axes 8, 12, 12; 2 main blocks, 1 of each refiner) over 4 latent channels, a 2-level
    AutoencoderKL with Z-Image's scaling and shift, a dynamic-shift flow-match scheduler; saved and read back."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel
    from transformers import AutoTokenizer
    root = tmp_path_factory.mktemp("zimage")
    encoder = save_qwen3(root / "te_src", TEXT, seed=5)
    tok_dir = build_tokenizer(root / "tok_src", ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>",
                                                 "</think>"], QWEN3_TEMPLATE, "right", "<|endoftext|>",
                              eos="<|im_end|>")
    torch.manual_seed(0)
    transformer = ZImageTransformer2DModel(
        all_patch_size=(2,), all_f_patch_size=(1,), in_channels=LATENT, dim=64, n_layers=2, n_refiner_layers=1,
        n_heads=2, n_kv_heads=2, cap_feat_dim=TEXT["hidden_size"], axes_dims=(8, 12, 12), axes_lens=(128, 32, 32))
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, block_out_channels=(8, 12), layers_per_block=1, latent_channels=LATENT,
        norm_num_groups=4, down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
        scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False)
    for i, m in enumerate((transformer, vae)):
        randomize_(m, seed=10 + i, scale=0.15)
        m.eval()
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True,
                                                base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
                                                max_image_seq_len=4096)
    pipe = ZImagePipeline(scheduler=scheduler, vae=vae, text_encoder=encoder.float().eval(),
                          tokenizer=AutoTokenizer.from_pretrained(str(tok_dir)), transformer=transformer)
    folder = root / "pipeline"
    pipe.save_pretrained(str(folder))
    return folder, ZImagePipeline.from_pretrained(str(folder)), mlxdiff.load(str(folder), dtype="float32")


def reference_run(pipe, noise=None, generator_seed=None, **kw):
    """One diffusers run from the noise (or a generator seeded afresh): (its final latents, from the step callback;
    its image in [0, 1])."""
    final = {}

    def keep_latents(_, i, t, tensors):
        final["latents"] = tensors["latents"].numpy().copy()
        return {}
    if noise is not None:
        kw["latents"] = torch.from_numpy(noise)
    if generator_seed is not None:
        kw["generator"] = torch.Generator().manual_seed(generator_seed)
    with torch.no_grad():
        image = pipe(max_sequence_length=SEQ, output_type="np", callback_on_step_end=keep_latents, **kw).images[0]
    return final["latents"], image


def check_parity(result, ref_latents, ref_image, what):
    """mlxdiff's latents within LATENT_TOL of diffusers', its image within IMAGE_LEVELS."""
    latents = np.asarray(result.latents, np.float32)
    assert latents.shape == ref_latents.shape
    err = max_rel_err(latents, ref_latents)
    shift = parity.levels(result.image, ref_image)
    print(f"{what}: latents max_rel_err {err:.2e}, image {shift}/255")
    assert err <= parity.LATENT_TOL and shift <= parity.IMAGE_LEVELS
    return err


# -- inpainting (tests/test_zimage_img2img.py) -------------------------------------------------------------------------

def mask_picture(width, height):
    """A mask of another size than the image: a white (repaint) rectangle on black, a soft grey edge, colours."""
    pixels = np.zeros((height, width, 3), np.uint8)
    pixels[height // 4: 3 * height // 4, width // 3: 5 * width // 6] = 255
    pixels[:, width // 3 - 2: width // 3] = (200, 90, 160)         # near the 0.5 threshold once grey and resized
    return PIL.Image.fromarray(pixels)


# -- original names (tests/test_zimage_transformer.py) -----------------------------------------------------------------

def to_original(sd: dict) -> dict:
    """diffusers names -> the original ones: the inverse of diffusers' convert_z_image_transformer_checkpoint_to_
    diffusers (q, k, v fused into attention.qkv; attention.out, q_norm, k_norm; x_embedder and final_layer)."""
    import torch
    out = {}
    for key, value in sd.items():
        if key.endswith((".attention.to_k.weight", ".attention.to_v.weight")):
            continue
        if key.endswith(".attention.to_q.weight"):
            base = key[:-len("to_q.weight")]
            out[base + "qkv.weight"] = torch.cat([sd[base + f"to_{c}.weight"] for c in "qkv"]).contiguous()
            continue
        for new, old in (("x_embedder.", "all_x_embedder.2-1."), ("final_layer.", "all_final_layer.2-1."),
                         (".attention.out.", ".attention.to_out.0."), (".attention.q_norm.", ".attention.norm_q."),
                         (".attention.k_norm.", ".attention.norm_k.")):
            key = key.replace(old, new)
        out[key] = value
    return out


# -- LoRAs (tests/test_zimage_lora.py) ---------------------------------------------------------------------------------

# a tiny model in test_zimage_transformer's style: heads 2 of 48 (RoPE axes 8, 16, 24), dim 96, SwiGLU 256, 2 main
# blocks and 1 of each refiner, caption features 24, 4 latent channels; captions of 5 and 9 tokens, 8 x 12 latents
LORA_CONFIG = dict(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=4, dim=96, n_layers=2, n_refiner_layers=1,
                   n_heads=2, n_kv_heads=2, cap_feat_dim=24, axes_dims=(8, 16, 24), axes_lens=(48, 16, 16))
