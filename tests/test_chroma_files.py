"""Chroma from the files people have, against diffusers' ChromaPipeline on the same components: lodestones' original
names with ComfyUI's prefix in ComfyUI's folders (models/diffusion_models, models/text_encoders, models/vae), the
files given alone, and a Q8_0 GGUF of the transformer kept quantized (its reference: diffusers' pipeline with gguf-py's
dequantization of the same file, through diffusers' own Chroma converter).

The reference runs get diffusers' prompt embeddings with the mask made boolean, as tests/test_chroma_pipeline.py
explains (diffusers #11724)."""

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import mlxdiff
import parity
from chroma_helpers import check_parity, diffusers_converter, reference_run
from gguf_helpers import dequantized, write_q8_0_gguf
from helpers import ASSETS, FIXTURES, max_rel_err, randomize_
from mlxdiff.errors import MlxdiffError
from twins import chroma_to_original, diffusers_to_ldm
import fixture_guard

H, W = 40, 24
LATENT = 6
SEQUENCE = 40
WIDTH = 64          # 2 heads of 32: the RoPE axes (4, 14, 14) that config_from_original infers


@pytest.fixture(autouse=True)
def _shared_fixtures_unchanged(request):
    """The module's shared fixtures are left as built (fixture_guard)."""
    yield from fixture_guard.unchanged(request, ['files', 'references'])


def components(seed=3):
    """Sizes whose configs the files' shapes give back (real files have none): T5 with 32 buckets / distance 128
    (t5.config_from_weights' single-file defaults), the transformer's head 32 wide, a VAE with 32 groups. Every
    other width differs: T5 224, its heads 5 x 12, FFN 70; approximator 96 wide over 16 channels."""
    from diffusers import AutoencoderKL, ChromaTransformer2DModel, FlowMatchEulerDiscreteScheduler
    from transformers import T5Config, T5EncoderModel, T5TokenizerFast
    torch.manual_seed(seed)
    t5 = T5EncoderModel(T5Config(
        vocab_size=32128, d_model=224, d_kv=12, d_ff=70, num_layers=2, num_heads=5, feed_forward_proj="gated-gelu",
        relative_attention_num_buckets=32, relative_attention_max_distance=128))
    transformer = ChromaTransformer2DModel(
        patch_size=1, in_channels=4 * LATENT, num_layers=1, num_single_layers=2, attention_head_dim=32,
        num_attention_heads=WIDTH // 32, joint_attention_dim=224, axes_dims_rope=(4, 14, 14),
        approximator_num_channels=16, approximator_hidden_dim=96, approximator_layers=2)
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, block_out_channels=(32, 64), layers_per_block=1, latent_channels=LATENT,
        norm_num_groups=32, down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
        scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False)
    for i, m in enumerate((t5, transformer, vae)):
        randomize_(m, seed=seed * 10 + i, scale=0.15)
        m.eval()
    t5_file = FIXTURES / "t5" if (FIXTURES / "t5" / "tokenizer.json").exists() else ASSETS / "t5"
    # FLUX.1-dev's scheduler: what chroma_files takes for files with no folder (pipelines/chroma/files.py)
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                                                base_image_seq_len=256, max_image_seq_len=4096)
    return dict(transformer=transformer, vae=vae, text_encoder=t5, scheduler=scheduler,
                tokenizer=T5TokenizerFast(tokenizer_file=str(t5_file / "tokenizer.json"), model_max_length=512))


def write_q8_gguf(path, tensors):
    """Q8_0 for every 2-D tensor whose input width is a multiple of its 32-wide blocks, outside the embedders and
    the final layer (as city96's files keep them); the rest F32."""
    return write_q8_0_gguf(path, tensors, "chroma",
                           lambda name: not name.startswith(("img_in.", "txt_in.", "final_layer.")))


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    from diffusers import ChromaPipeline, ChromaTransformer2DModel
    comps = components()
    pipe = ChromaPipeline(**comps)
    sd = lambda m: {k: v.detach().clone().contiguous() for k, v in m.state_dict().items()}
    cfg = dict(pipe.transformer.config)
    original = chroma_to_original(sd(pipe.transformer), cfg)
    root = tmp_path_factory.mktemp("chroma_files")
    models = root / "models"
    for d in ("diffusion_models", "text_encoders", "vae", "unet"):
        (models / d).mkdir(parents=True)
    save_file({"model.diffusion_model." + k: v for k, v in original.items()},
              str(models / "diffusion_models" / "chroma-tiny.safetensors"))
    save_file({k: v for k, v in sd(pipe.text_encoder).items() if k != "encoder.embed_tokens.weight"},
              str(models / "text_encoders" / "t5xxl_fp16.safetensors"))
    save_file(diffusers_to_ldm(sd(pipe.vae), 2), str(models / "vae" / "ae.safetensors"))
    gguf = models / "unet" / "chroma-tiny-Q8_0.gguf"
    quantized = write_q8_gguf(gguf, original)
    # the GGUF's reference: the same pipeline with the file's values as gguf-py decodes them
    transformer = ChromaTransformer2DModel(**{k: v for k, v in cfg.items() if not k.startswith("_")})
    transformer.load_state_dict(diffusers_converter(WIDTH)({k: torch.from_numpy(v)
                                                            for k, v in dequantized(gguf).items()}))
    gguf_pipe = ChromaPipeline(**dict(comps, transformer=transformer.eval()))
    return models, pipe, gguf_pipe, quantized


PROMPT, NEGATIVE = "a lighthouse at dusk", "blurry"


@pytest.fixture(scope="module")
def references(files):
    """(noise, diffusers' (latents, image) on the components, the same on the GGUF's decoded values): true CFG at
    4, diffusers' prompt embeddings with the mask made boolean; the prompt and the negative prompt each move the
    first (parity.assert_inputs_matter)."""
    _, pipe, gguf_pipe, _ = files
    noise = np.random.default_rng(9).standard_normal((1, (H // 4) * (W // 4), 4 * LATENT)).astype(np.float32)

    def run(twin):
        return lambda **kw: reference_run(twin, noise, num_inference_steps=3, guidance_scale=4.0, **kw)
    base = dict(prompt=PROMPT, negative_prompt=NEGATIVE)
    plain = parity.assert_inputs_matter(run(pipe), base, {"the prompt": dict(prompt="a red barn at noon"),
                                                          "the negative prompt": dict(negative_prompt="sharp")})
    return noise, plain, run(gguf_pipe)(**base)


def generate(loaded, noise):
    assert loaded.family == "chroma"
    return loaded.generate(PROMPT, negative_prompt=NEGATIVE, width=W, height=H, steps=3, guidance=4.0, latents=noise,
                           max_sequence_length=SEQUENCE, progress_bar=False)


def test_files_match_diffusers(files, references):
    """ComfyUI's folders and the files given alone: the same file read the same way, so mlxdiff's two results are
    equal bit for bit, and diffusers' within the parity tolerances."""
    models = files[0]
    noise, (ref_latents, ref), _ = references
    unet = str(models / "diffusion_models" / "chroma-tiny.safetensors")
    folders = generate(mlxdiff.load(unet), noise)
    check_parity(folders, ref_latents, ref, "Chroma comfyui_folders")
    alone = generate(mlxdiff.load(transformer=unet, vae=str(models / "vae" / "ae.safetensors"),
                                  text_encoders={"t5xxl": str(models / "text_encoders" / "t5xxl_fp16.safetensors")}),
                     noise)
    assert np.array_equal(alone.latents, folders.latents)
    assert np.array_equal(np.asarray(alone.image), np.asarray(folders.image))


def test_gguf_matches_diffusers_on_its_values(files, references):
    """A Q8_0 GGUF of the transformer kept quantized, against diffusers with gguf-py's decoding of the file."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlxdiff.formats.gguf import RawLinear
    models, _, _, quantized = files
    noise, (plain_latents, _), (ref_latents, ref) = references
    loaded = mlxdiff.load(transformer=str(models / "unet" / "chroma-tiny-Q8_0.gguf"),
                          text_encoders={"t5xxl": str(models / "text_encoders" / "t5xxl_fp16.safetensors")},
                          vae=str(models / "vae" / "ae.safetensors"))
    err = check_parity(generate(loaded, noise), ref_latents, ref, "Chroma gguf")
    # the file's values are what agree: the unquantized pipeline's latents are further off than ours
    moved = max_rel_err(plain_latents, ref_latents)
    assert quantized and moved > 10 * max(err, 1e-6), (moved, err)
    model = loaded.components["transformer"].build()     # the weights kept quantized
    kept = sum(isinstance(m, (nn.QuantizedLinear, RawLinear)) for _, m in model.named_modules())
    assert kept >= len(quantized), (kept, len(quantized))


def test_a_missing_part_is_one_line_naming_it(files, tmp_path):
    import shutil
    models = files[0]
    (tmp_path / "diffusion_models").mkdir()
    shutil.copy(models / "diffusion_models" / "chroma-tiny.safetensors", tmp_path / "diffusion_models" / "c.safetensors")
    with pytest.raises(MlxdiffError, match="no t5xxl text encoder found.*text_encoders=") as e:
        mlxdiff.load(str(tmp_path / "diffusion_models" / "c.safetensors"))
    assert "\n" not in str(e.value)
    (tmp_path / "text_encoders").mkdir()
    shutil.copy(models / "text_encoders" / "t5xxl_fp16.safetensors", tmp_path / "text_encoders")
    with pytest.raises(MlxdiffError, match="no FLUX.1 VAE found.*ae.safetensors"):
        mlxdiff.load(str(tmp_path / "diffusion_models" / "c.safetensors"))
    with pytest.raises(MlxdiffError, match="Chroma takes 't5xxl'"):
        mlxdiff.load(transformer=str(models / "diffusion_models" / "chroma-tiny.safetensors"),
                     text_encoders={"clip_l": str(models / "text_encoders" / "t5xxl_fp16.safetensors")})
