"""Core ML as Apple ships it, past SD 1.5 (issue 46): Apple's SDXL and SD 2.x folders as ml-stable-diffusion's
torch2coreml.py writes them, made here by coremltools the way that converter calls it, from tiny random models
whose widths all differ.

SDXL (--xl-version, coreml_helpers.write_apple_xl_folder): TextEncoder and TextEncoder2 traced for the penultimate
hidden states and the pool, palettized 6-bit; the UNet with its added inputs (time_ids, text_embeds), palettized by
a mixed-bit recipe (mixed_bit_compression_apply.py's: 1, 2, 4, 6, 8 bits or float16 per layer) and chunked; the VAE
in float32 as --xl-version converts it. SD 2.x: the OpenCLIP-style text encoder as diffusers holds it (gelu,
64-wide heads, the UNet's linear projections made 1x1 convolutions by Apple's UNet; the UNet whole, Unet.mlpackage
as torch2coreml.py writes it without --chunk-unet), read as epsilon (Apple's Swift
pipeline) or, given prediction_type="v_prediction", as a v model. mlxdiff.load(folder) against diffusers'
StableDiffusionXLPipeline / StableDiffusionPipeline on the packages' weights (the palettized ones as coremltools'
decompress_weights gives them: coreml_helpers.as_read checks mlxdiff's decode equal to it bit for bit), PNDM (the
Swift pipeline's default), from the same noise: latents within 1e-4, images within 2 levels, each input shown to
move diffusers' result. Bad input (the refiner, an SDXL UNet without TextEncoder2) is one line."""

import shutil
import warnings

import numpy as np
import pytest
import torch
from diffusers import PNDMScheduler, StableDiffusionPipeline, StableDiffusionXLPipeline

import mlxdiff
from mlx.utils import tree_flatten
from mlxdiff.errors import MlxdiffError
from mlxdiff.formats import coreml
from mlxdiff.loading.quantize import parameter_nbytes
from mlxdiff.pipelines import LoadRequest, detect

import fixture_guard
from helpers import ASSETS, FIXTURES, max_rel_err, randomize_
from coreml_helpers import (APPLE_CLIP, APPLE_VAE, apple_xl_twins, as_read, write_apple_folder,
                            write_apple_xl_folder)
from ldm_helpers import clip_tokenizer, reference, showing_moves
from parity import IMAGE_LEVELS, LATENT_TOL, assert_inputs_matter, assert_moves, levels

warnings.filterwarnings("ignore")

H, W = 32, 24                 # latents 16 x 12 (the tiny VAE's factor is 2)
PROMPT = "a red fox in the snow"
STEPS = 3
VOCAB = FIXTURES / "clip" if (FIXTURES / "clip" / "vocab.json").exists() else ASSETS / "clip"   # clip_tokenizer's


def _pndm(prediction_type="epsilon"):
    """The Swift pipeline's default scheduler as diffusers' PNDM with SD's config."""
    return PNDMScheduler.from_config(dict(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                                          steps_offset=1, skip_prk_steps=True, set_alpha_to_one=False,
                                          prediction_type=prediction_type))


@pytest.fixture(scope="module")
def apple_xl(tmp_path_factory):
    """(Apple's SDXL folder, diffusers' StableDiffusionXLPipeline on the packages' weights, {the UNet's weight op:
    the nbits the mixed-bit recipe gave it}, {its palettized weights: their nbits in coremltools' program})."""
    root = tmp_path_factory.mktemp("apple_sdxl")
    unet, text_encoder, text_encoder_2, vae = apple_xl_twins()
    models, applied = write_apple_xl_folder(root / "apple", unet, text_encoder, text_encoder_2, vae, VOCAB)
    packages = root / "apple" / "packages"
    pipe = StableDiffusionXLPipeline(vae=vae, text_encoder=text_encoder, text_encoder_2=text_encoder_2,
                                     tokenizer=clip_tokenizer(), tokenizer_2=clip_tokenizer("!"), unet=unet,
                                     scheduler=_pndm(), force_zeros_for_empty_prompt=False)
    pipe.vae.register_to_config(scaling_factor=0.13025)       # the SDXL VAE's (Apple's Swift CLI, --xl)
    pipe.unet.load_state_dict(as_read(packages / "UnetChunk1.mlpackage", unet, [models["Unet"]]))
    pipe.text_encoder.load_state_dict(as_read(packages / "TextEncoder.mlpackage", text_encoder,
                                              [models["TextEncoder"]]), strict=False)
    pipe.text_encoder_2.load_state_dict(as_read(packages / "TextEncoder2.mlpackage", text_encoder_2,
                                                [models["TextEncoder2"]]), strict=False)
    pipe.vae.load_state_dict(as_read(packages / "VAEDecoder.mlpackage", vae,
                                     [models["VAEDecoder"], models["VAEEncoder"]]))
    return root / "apple", pipe, applied, _palette_widths(models["Unet"])


def _palette_widths(mlmodel) -> dict:
    """{weight: nbits} of the palettized weights in coremltools' own program: each constexpr_lut_to_dense op's
    output and its table's length (2 ** nbits; iOS 16's tables are one vector per tensor)."""
    out = {}
    for op in mlmodel._mil_program.functions["main"].operations:
        if op.op_type == "constexpr_lut_to_dense":
            lut = op.lut.val
            assert lut.ndim == 1, op.outputs[0].name
            out[op.outputs[0].name] = int(np.log2(lut.size))
    return out


def _sd2_twins():
    """A tiny SD 2.x: the UNet's projections linear, 64-wide heads (one 64-wide level: ct.convert's time grows with
    the op count; the SDXL twin has two), the text encoder gelu."""
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel
    torch.manual_seed(0)
    unet = UNet2DConditionModel(sample_size=12, in_channels=4, out_channels=4, block_out_channels=(64,),
                                layers_per_block=1, down_block_types=("CrossAttnDownBlock2D",),
                                up_block_types=("CrossAttnUpBlock2D",), cross_attention_dim=64,
                                attention_head_dim=(1,), use_linear_projection=True, norm_num_groups=32)
    return (randomize_(unet.eval(), seed=11, scale=0.2),   # the prompt moves the image past the tolerance
            randomize_(CLIPTextModel(CLIPTextConfig(**{**APPLE_CLIP, "hidden_act": "gelu"})).eval(), seed=12,
                       scale=0.1),
            randomize_(AutoencoderKL(**APPLE_VAE).eval(), seed=13, scale=0.3))   # the image moves with the latents


@pytest.fixture(scope="module")
def apple_sd2(tmp_path_factory):
    """(Apple's SD 2.x folder, diffusers' StableDiffusionPipeline on the packages' weights). Its UNet is the whole
    Unet.mlpackage (torch2coreml.py without --chunk-unet): the chunks are read in the SDXL folder and SD 1.5's."""
    root = tmp_path_factory.mktemp("apple_sd2")
    unet, text_encoder, vae = _sd2_twins()
    models = write_apple_folder(root / "apple", unet, text_encoder, vae, VOCAB, chunk=False)
    packages = root / "apple" / "packages"
    pipe = StableDiffusionPipeline(unet=unet, text_encoder=text_encoder, vae=vae, tokenizer=clip_tokenizer("!"),
                                   scheduler=_pndm(), safety_checker=None, feature_extractor=None,
                                   requires_safety_checker=False)
    pipe.unet.load_state_dict(as_read(packages / "Unet.mlpackage", unet, [models["Unet"]]))
    pipe.text_encoder.load_state_dict(as_read(packages / "TextEncoder.mlpackage", text_encoder,
                                              [models["TextEncoder"]]), strict=False)
    pipe.vae.load_state_dict(as_read(packages / "VAEDecoder.mlpackage", vae,
                                     [models["VAEDecoder"], models["VAEEncoder"]]))
    return root / "apple", pipe


@pytest.fixture(autouse=True)
def shared_fixture_unchanged(request):
    yield from fixture_guard.unchanged(request, ["apple_xl", "apple_sd2"])


def _noise(seed):
    return np.random.default_rng(seed).standard_normal((1, 4, H // 2, W // 2)).astype(np.float32)


def _reference(what, pipe, changes, **base):
    """diffusers' (latents, 8-bit image) of the base run, each of `changes` checked to move both past the
    tolerances (the image as 8 bits: parity.levels reads a float image only as the reference)."""
    noise = _noise(1)
    run = showing_moves(what, lambda **kw: reference(pipe, height=H, width=W, num_inference_steps=STEPS,
                                                     latents=torch.tensor(noise), **kw))

    def eight_bit(**kw):
        latents, image = run(**kw)
        return latents, np.round(image * 255).astype(np.uint8)
    return assert_inputs_matter(eight_bit, dict(prompt=PROMPT, guidance_scale=5.0, **base), changes)


def _assert_draws(pipe, reference_run, tag, **kwargs):
    ref_latents, ref_image = reference_run
    ours = pipe.generate(PROMPT, width=W, height=H, steps=STEPS, guidance=5.0, latents=_noise(1),
                         progress_bar=False, **kwargs)
    err, shift = max_rel_err(ours.latents, ref_latents), levels(ours.image, ref_image)
    print(f"apple {tag}: latents max_rel_err {err:.1e}, image {shift} levels")
    assert err <= LATENT_TOL and shift <= IMAGE_LEVELS, (err, shift)


def _one_line(excinfo, *words):
    msg = str(excinfo.value)
    assert "\n" not in msg and "Traceback" not in msg, msg
    for w in words:
        assert w in msg, msg
    return msg


# -- SDXL ------------------------------------------------------------------------------------------------------------

def test_apple_sdxl_folder_matches_diffusers(apple_xl):
    """Both text encoders, the chunked UNet with its added conditioning, the float32 VAE, the tokenizers from
    compiled/: an SDXL pipeline that draws as diffusers' does; the prompt (both encoders and the pool), the
    guidance and the size conditioning (time_ids) each move diffusers' result."""
    folder, pipe, *_ = apple_xl
    ref = _reference("apple sdxl", pipe, {"the prompt": {"prompt": "a blue boat on a lake"},
                                           "guidance": {"guidance_scale": 7.0},
                                           "the size conditioning": {"original_size": (96, 64)}})
    ours = mlxdiff.load(str(folder))
    assert ours.xl and ours.scheduler_config["_class_name"] == "PNDMScheduler"
    _assert_draws(ours, ref, "sdxl folder (chunked, mixed-bit UNet)")


def test_apple_sdxl_mixed_bit_read_exactly(apple_xl):
    """The UNet's mixed-bit palettes read as coremltools wrote them: each weight's nbits the one of its table in
    coremltools' program (16: kept float16), every width Apple allows present; their decode equal to coremltools'
    decompress_weights (checked bit for bit when the fixture loaded diffusers' UNet: coreml_helpers.as_read)."""
    folder, pipe, applied, widths = apple_xl
    targets = {k: tuple(v.shape) for k, v in pipe.unet.state_dict().items()}
    found = coreml._mapped(coreml.program(folder / "packages" / "UnetChunk1.mlpackage"), targets, None)
    counts = {}
    for name, (value, const) in found.items():
        ours = value.nbits if isinstance(value, coreml.LutWeight) else 16
        assert ours == widths.get(const, 16), (name, const, ours, widths.get(const, 16))
        if isinstance(value, coreml.LutWeight) or coreml._base(const) in {coreml._base(op) for op in applied}:
            counts[ours] = counts.get(ours, 0) + 1
    assert sum(1 for v, _ in found.values() if isinstance(v, coreml.LutWeight)) == len(widths)
    by_base = {coreml._base(k): n for k, n in widths.items()}
    unlike = sum(by_base.get(coreml._base(op), 16) != n for op, n in applied.items())
    print(f"apple sdxl mixed-bit: weights per nbits {dict(sorted(counts.items()))} ({unlike} of the recipe's "
          f"{len(applied)} not as asked: the recipe's hash match or coremltools' palettizer chose otherwise)")
    assert set(counts) == {1, 2, 4, 6, 8, 16}, counts


def test_apple_sdxl_resident_bytes(apple_xl):
    """Each component's bytes once loaded (equal to the built model's parameters): the UNet's palettized layers
    as their indices and tables, the encoders' Linears 6-bit (their token embeddings, not palettized, most of
    their bytes), the VAE float32 as --xl-version stores it."""
    folder, pipe, *_ = apple_xl
    sources = detect(str(folder), LoadRequest())
    sizes = {}
    for name, spec in sources.components.items():
        model = spec.build()
        sizes[name] = spec.loaded_nbytes()
        assert sizes[name] == parameter_nbytes(model), name
        assert sum(v.size for _, v in tree_flatten(model.parameters())) > 0
        count = sum(p.numel() for k, p in getattr(pipe, name).state_dict().items() if not k.endswith("position_ids"))
        sizes[name + " float16"] = 2 * count
    print("apple sdxl resident bytes: " + ", ".join(f"{k} {v}" for k, v in sizes.items()))
    assert sizes["unet"] < 0.7 * sizes["unet float16"]
    for name in ("text_encoder", "text_encoder_2"):
        assert sizes[name] < sizes[name + " float16"], name
    assert sizes["vae"] == 2 * sizes["vae float16"]          # float32


def test_apple_sdxl_refiner_refused(apple_xl, tmp_path):
    folder, *_ = apple_xl
    other = tmp_path / "apple"
    shutil.copytree(folder / "packages", other)
    shutil.copytree(folder / "whole" / "Unet.mlpackage", other / "UnetRefiner.mlpackage")
    with pytest.raises(MlxdiffError) as e:
        mlxdiff.load(str(other))
    _one_line(e, "UnetRefiner.mlpackage", "refiner")


def test_apple_sdxl_without_text_encoder_2(apple_xl, tmp_path):
    folder, *_ = apple_xl
    other = tmp_path / "apple"
    shutil.copytree(folder / "packages", other)
    shutil.rmtree(other / "TextEncoder2.mlpackage")
    with pytest.raises(MlxdiffError) as e:
        mlxdiff.load(str(other))
    _one_line(e, "SDXL UNet", "TextEncoder2.mlpackage")


# -- SD 2.x ----------------------------------------------------------------------------------------------------------

def test_apple_sd2_folder_matches_diffusers(apple_sd2):
    """SD 2.x read as such from the text encoder's program (gelu) with no config: 64-wide heads, the UNet's linear
    projections from Apple's 1x1 convolutions, "!" padding; epsilon, as Apple's Swift pipeline runs it."""
    folder, pipe = apple_sd2
    ref = _reference("apple sd2", pipe, {"the prompt": {"prompt": "a blue boat on a lake"},
                                          "guidance": {"guidance_scale": 7.0}})
    ours = mlxdiff.load(str(folder))
    assert ours.components["unet"].args.use_linear_projection
    assert ours.components["text_encoder"].args.hidden_act == "gelu"
    _assert_draws(ours, ref, "sd2 folder")


def test_apple_sd2_v_prediction(apple_sd2):
    """prediction_type="v_prediction" (a 2.0-v / 2.1 model's folder, which does not say): diffusers with the
    same PNDM predicting v; v moves diffusers' result past the latent tolerance (tests/parity.py)."""
    folder, pipe = apple_sd2
    v_pipe = StableDiffusionPipeline(**{**pipe.components, "scheduler": _pndm("v_prediction")})
    ref = _reference("apple sd2 v", v_pipe, {"the prompt": {"prompt": "a blue boat on a lake"}})
    epsilon = _reference("apple sd2 epsilon", pipe, {})
    assert_moves("v-prediction", epsilon[0], ref[0], epsilon[1], ref[1])
    _assert_draws(mlxdiff.load(str(folder), prediction_type="v_prediction"), ref, "sd2 folder, v")
