"""Core ML as Apple ships it (issue 46): Apple's folder as ml-stable-diffusion's torch2coreml.py writes it, made here
by coremltools the way that converter calls it (coreml_helpers.write_apple_folder: TextEncoder and UNet palettized
6-bit as --quantize-nbits does, the UNet chunked by coremltools' bisect_model into UnetChunk1 + UnetChunk2,
VAEDecoder, VAEEncoder, vocab.json / merges.txt in compiled/), from a tiny random SD 1.5. mlxdiff.load(folder)
against diffusers' StableDiffusionPipeline on the packages' weights (the palettized ones as coremltools'
decompress_weights gives them, the others as stored, float16) with Apple's default scheduler (PNDM), from the same
noise: latents within 1e-4, images within 2 levels (tests/parity.py; the prompt and guidance each move diffusers'
result past the latent tolerance). The chunks joined are also read as transformer= of a diffusers folder (the same weights saved by
diffusers), the whole Unet.mlpackage in Apple's folder draws the same, and the VAE's encoder (img2img's) matches
diffusers'; each component's resident bytes are measured (-s prints them). Bad input (a chunk missing, chunks of two
models, a link leaving a package, compiled bundles alone, a part missing) is one line, exit 2 on the command line.
The module's fixture is built once and checked unchanged after each test."""

import shutil
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch
from diffusers import PNDMScheduler, StableDiffusionPipeline

import mlxdiff
import mlx.core as mx
from mlx.utils import tree_flatten
from mlxdiff.errors import MlxdiffError
from mlxdiff.formats import coreml
from mlxdiff.loading.quantize import parameter_nbytes
from mlxdiff.pipelines import LoadRequest, detect

from coremltools.models.utils import bisect_model
import fixture_guard
from coreml_helpers import apple_twins, as_read, write_apple_folder
from helpers import ASSETS, FIXTURES, max_rel_err
from ldm_helpers import clip_tokenizer, reference, showing_moves
from parity import IMAGE_LEVELS, LATENT_TOL, assert_inputs_matter, levels

warnings.filterwarnings("ignore")

H, W = 32, 24                 # latents 16 x 12 (the tiny VAE's factor is 2; diffusers wants multiples of 8)
PROMPT = "a red fox in the snow"
STEPS = 3


@pytest.fixture(scope="module")
def apple(tmp_path_factory):
    """(Apple's folder, the diffusers folder of the same twins, diffusers' pipeline on the packages' weights,
    {package name: MLModel})."""
    root = tmp_path_factory.mktemp("apple_sd15")
    unet, text_encoder, vae = apple_twins()
    tokenizer = clip_tokenizer()
    vocab = FIXTURES / "clip" if (FIXTURES / "clip" / "vocab.json").exists() else ASSETS / "clip"   # clip_tokenizer's
    models = write_apple_folder(root / "apple", unet, text_encoder, vae, vocab)
    packages = root / "apple" / "packages"
    scheduler = PNDMScheduler.from_config(dict(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                                               steps_offset=1, skip_prk_steps=True, set_alpha_to_one=False))
    parts = dict(unet=unet, text_encoder=text_encoder, vae=vae, tokenizer=tokenizer, scheduler=scheduler,
                 safety_checker=None, feature_extractor=None, requires_safety_checker=False)
    pipe = StableDiffusionPipeline(**parts)      # the twins, their conversion done: now on the packages' weights
    pipe.unet.load_state_dict(as_read(packages / "UnetChunk1.mlpackage", unet, [models["Unet"]]))
    pipe.text_encoder.load_state_dict(as_read(packages / "TextEncoder.mlpackage", text_encoder,
                                               [models["TextEncoder"]]), strict=False)
    pipe.vae.load_state_dict(as_read(packages / "VAEDecoder.mlpackage", vae,            # + its VAEEncoder
                                      [models["VAEDecoder"], models["VAEEncoder"]]))
    pipe.save_pretrained(str(root / "diffusers"))   # the same weights as a diffusers folder (float32)
    return root / "apple", root / "diffusers", pipe, models


@pytest.fixture(autouse=True)
def shared_fixture_unchanged(request):
    yield from fixture_guard.unchanged(request, ["apple"])


def _noise(seed):
    return np.random.default_rng(seed).standard_normal((1, 4, H // 2, W // 2)).astype(np.float32)


@pytest.fixture(scope="module")
def reference_run(apple):
    """diffusers on the packages' weights: (latents, image) of the base run, the prompt and guidance checked to
    move it past the latent tolerance (tests/parity.py)."""
    _, _, pipe, _ = apple
    noise = _noise(1)
    run = lambda **kw: reference(pipe, height=H, width=W, num_inference_steps=STEPS, latents=torch.tensor(noise),
                                 **kw)
    return assert_inputs_matter(showing_moves("apple", run), dict(prompt=PROMPT, guidance_scale=5.0),
                                {"the prompt": {"prompt": "a blue boat on a lake"},
                                 "guidance": {"guidance_scale": 7.0}})


def _assert_draws(pipe, reference_run, tag):
    ref_latents, ref_image = reference_run
    ours = pipe.generate(PROMPT, width=W, height=H, steps=STEPS, guidance=5.0, latents=_noise(1),
                         progress_bar=False)
    err, shift = max_rel_err(ours.latents, ref_latents), levels(ours.image, ref_image)
    print(f"apple {tag}: latents max_rel_err {err:.1e}, image {shift} levels")
    assert err <= LATENT_TOL and shift <= IMAGE_LEVELS, (err, shift)


def test_apple_folder_matches_diffusers(apple, reference_run):
    """The folder Apple's converter writes, and its packages/ subfolder: chunked UNet joined, text encoder, VAE,
    tokenizer from compiled/, Apple's default scheduler."""
    folder, *_ = apple
    pipe = mlxdiff.load(str(folder))
    assert pipe.scheduler_config["_class_name"] == "PNDMScheduler"
    _assert_draws(pipe, reference_run, "folder (chunked UNet)")
    assert detect(str(folder / "packages"), LoadRequest()).components["unet"].files == pipe.components["unet"].files


def test_whole_unet_in_apple_folder(apple, reference_run, tmp_path):
    folder, *_ = apple
    other = tmp_path / "apple"
    shutil.copytree(folder / "packages", other)
    for i in (1, 2):
        shutil.rmtree(other / f"UnetChunk{i}.mlpackage")
    shutil.copytree(folder / "whole" / "Unet.mlpackage", other / "Unet.mlpackage")
    shutil.copy(folder / "compiled" / "vocab.json", other)
    shutil.copy(folder / "compiled" / "merges.txt", other)
    (other / "SafetyChecker.mlpackage").mkdir()        # never read, as Apple's pipeline may go without it
    _assert_draws(mlxdiff.load(str(other)), reference_run, "folder (Unet.mlpackage)")


def test_converter_names(apple, reference_run, tmp_path):
    """The packages under the names torch2coreml.py's _get_out_path gives them before bundling
    (Stable_Diffusion_version_<model>_unet_chunk1.mlpackage, ..._vae_decoder, ...), the tokenizer beside."""
    folder, *_ = apple
    other = tmp_path / "converted"
    other.mkdir()
    for apple_name, name in (("TextEncoder", "text_encoder"), ("UnetChunk1", "unet_chunk1"),
                             ("UnetChunk2", "unet_chunk2"), ("VAEDecoder", "vae_decoder"),
                             ("VAEEncoder", "vae_encoder")):
        shutil.copytree(folder / "packages" / f"{apple_name}.mlpackage",
                        other / f"Stable_Diffusion_version_runwayml_stable-diffusion-v1-5_{name}.mlpackage")
    for name in ("vocab.json", "merges.txt"):
        shutil.copy(folder / "compiled" / name, other)
    _assert_draws(mlxdiff.load(str(other)), reference_run, "converter's names")


def test_vae_encoder_matches_diffusers(apple):
    """The VAE read from VAEDecoder + VAEEncoder (img2img's encoder): its encoder's mean and its decoder against
    diffusers' AutoencoderKL on the packages' weights."""
    folder, _, pipe, _ = apple
    model = detect(str(folder), LoadRequest()).components["vae"].build()
    x = np.random.default_rng(4).uniform(-1, 1, (1, 3, H, W)).astype(np.float32)
    with torch.no_grad():
        mean = pipe.vae.encode(torch.from_numpy(x)).latent_dist.mean.numpy()
        image = pipe.vae.decode(torch.from_numpy(mean)).sample.numpy()
    errors = (max_rel_err(np.array(model.encode_moments(mx.array(x))[0]), mean),
              max_rel_err(np.array(model.decode(mx.array(mean))), image))
    print(f"apple VAE: encode {errors[0]:.1e}, decode {errors[1]:.1e}")
    assert max(errors) <= LATENT_TOL, errors


def test_chunks_as_transformer(apple, reference_run):
    """A folder holding both chunks (and the first chunk itself) as transformer= of the diffusers folder."""
    folder, diffusers_folder, *_ = apple
    _assert_draws(mlxdiff.load(str(diffusers_folder), transformer=str(folder / "packages")), reference_run,
                  "chunks as transformer=")
    spec = detect(str(diffusers_folder), LoadRequest(transformer=str(folder / "packages" / "UnetChunk1.mlpackage")))
    assert [p.name for p in spec.components["unet"].files] == ["UnetChunk1.mlpackage"]


def test_resident_bytes_per_component(apple):
    """Each component's bytes once loaded (spec.loaded_nbytes, equal to the built model's parameters): the UNet's
    and the text encoder's palettized layers as their 6-bit indices and tables (the UNet well under its float16
    size; the text encoder's token embedding, not palettized, is most of its bytes), the VAE float16 as stored."""
    folder, _, pipe, _ = apple
    sources = detect(str(folder), LoadRequest())
    sizes = {}
    for name, spec in sources.components.items():
        model = spec.build()
        sizes[name] = spec.loaded_nbytes()
        assert sizes[name] == parameter_nbytes(model), name
        count = sum(v.size for _, v in tree_flatten(model.parameters()))
        torch_count = sum(p.numel() for k, p in getattr(pipe, name).state_dict().items()
                          if not k.endswith("position_ids"))
        assert count >= 0 and torch_count > 0
        sizes[name + " float16"] = 2 * torch_count
    print("apple resident bytes: " + ", ".join(f"{k} {v}" for k, v in sizes.items()))
    assert sizes["unet"] < 0.7 * sizes["unet float16"]
    assert sizes["text_encoder"] < sizes["text_encoder float16"]      # its Linears palettized, the embedding not
    assert sizes["vae"] == sizes["vae float16"]


def _one_line(excinfo, *words):
    msg = str(excinfo.value)
    assert "\n" not in msg and "Traceback" not in msg, msg
    for w in words:
        assert w in msg, msg
    return msg


def test_chunk_missing(apple, tmp_path):
    folder, diffusers_folder, *_ = apple
    other = tmp_path / "apple"
    shutil.copytree(folder / "packages", other)
    shutil.rmtree(other / "UnetChunk2.mlpackage")
    with pytest.raises(MlxdiffError) as e:
        mlxdiff.load(str(other))
    _one_line(e, "UnetChunk1.mlpackage", "chunk 2 is not beside it")
    with pytest.raises(MlxdiffError) as e:
        mlxdiff.load(str(diffusers_folder), transformer=str(other))
    _one_line(e, "chunk 2 is not beside it")
    run = subprocess.run([sys.executable, "-m", "mlxdiff.generate", "--model", str(other), "--prompt", "a fox",
                          "--steps", "1"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 2 and "chunk 2 is not beside it" in run.stderr, run.stderr[-2000:]
    assert len(run.stderr.strip().splitlines()) == 1, run.stderr


def test_chunks_of_two_models(apple, tmp_path):
    """UnetChunk2 replaced by the second half of another model (the text encoder, bisected likewise): its inputs
    are none of the first chunk's outputs."""
    folder, *_ = apple
    other = tmp_path / "apple"
    shutil.copytree(folder / "packages", other)
    shutil.copytree(folder / "packages" / "TextEncoder.mlpackage", tmp_path / "Text.mlpackage")
    bisect_model(str(tmp_path / "Text.mlpackage"), str(tmp_path / "bisect"), check_output_correctness=False)
    shutil.rmtree(other / "UnetChunk2.mlpackage")
    shutil.copytree(tmp_path / "bisect" / "Text_chunk2.mlpackage", other / "UnetChunk2.mlpackage")
    with pytest.raises(MlxdiffError) as e:
        mlxdiff.load(str(other))
    _one_line(e, "UnetChunk2.mlpackage", "chunks of two models")


def test_link_leaving_a_chunk(apple, tmp_path):
    folder, *_ = apple
    other = tmp_path / "apple"
    shutil.copytree(folder / "packages", other)
    weights = other / "UnetChunk2.mlpackage" / "Data" / "com.apple.CoreML" / "weights" / "weight.bin"
    outside = tmp_path / "elsewhere.bin"
    shutil.move(str(weights), str(outside))
    weights.symlink_to(outside)
    with pytest.raises(MlxdiffError) as e:
        mlxdiff.load(str(other))
    _one_line(e, "resolves outside it")


def test_compiled_bundles_refused(apple, tmp_path):
    """A folder of compiled .mlmodelc bundles only (Apple's compiled/ or Resources/): one line saying to give the
    packages; a bundle given as transformer= likewise."""
    folder, diffusers_folder, *_ = apple
    compiled = tmp_path / "compiled"
    (compiled / "Unet.mlmodelc" / "weights").mkdir(parents=True)
    (compiled / "Unet.mlmodelc" / "model.mil").write_text("program(1.0)")
    (compiled / "TextEncoder.mlmodelc").mkdir()
    shutil.copy(folder / "compiled" / "vocab.json", compiled)
    with pytest.raises(MlxdiffError) as e:
        mlxdiff.load(str(compiled))
    _one_line(e, "compiled Core ML bundles", ".mlpackage")
    with pytest.raises(MlxdiffError) as e:
        mlxdiff.load(str(diffusers_folder), transformer=str(compiled / "Unet.mlmodelc"))
    _one_line(e, ".mlmodelc")


def test_part_missing(apple, tmp_path):
    folder, *_ = apple
    other = tmp_path / "apple"
    shutil.copytree(folder / "packages", other)
    shutil.rmtree(other / "VAEDecoder.mlpackage")
    with pytest.raises(MlxdiffError) as e:
        mlxdiff.load(str(other))
    _one_line(e, "VAEDecoder.mlpackage")
