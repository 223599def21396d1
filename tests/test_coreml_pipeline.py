"""A Core ML package as an SD pipeline's UNet (issue 26): a tiny SD 1.5 pipeline (diffusers) whose UNet coremltools
converts (torch.jit.trace + ct.convert) and palettizes (6-bit k-means); mlxdiff with transformer= the package against
diffusers' pipeline with its UNet's weights replaced by coremltools' decompress_weights output, from the same
injected latents: the final latents within 1e-4 and the images within 2 levels (tests/parity.py; the prompt and
guidance each move diffusers' result by more than that), the palettized Linear layers still palettized once built
(resident bytes: their indices and tables); bad packages refused in one line. The shared fixture's diffusers
pipeline is checked unchanged after each test."""

import json
import shutil
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch

import mlxdiff
from mlxdiff.errors import MlxdiffError
from mlxdiff.formats import coreml

import coremltools as ct              # the dev extra installs it (and scikit-learn, its k-means): no skip
from coremltools.optimize.coreml import OpPalettizerConfig, OptimizationConfig, decompress_weights, \
    get_weights_metadata, palettize_weights
from helpers import max_rel_err
import fixture_guard
from ldm_helpers import reference, sd15_components, showing_moves, twin_
from parity import IMAGE_LEVELS, LATENT_TOL, assert_inputs_matter, levels
from coreml_helpers import UNET, AppleStyle, Wrapper

warnings.filterwarnings("ignore")

H, W = 48, 40                 # latents 12 x 10 (the tiny VAE's factor is 4)
PROMPT = "a red fox in the snow"


def _assert_matches(folder, package, pipe, seed, steps):
    """mlxdiff with the package as its UNet against `pipe` (diffusers on the package's decompressed weights), from
    the same noise: latents within LATENT_TOL, image within IMAGE_LEVELS; the prompt and guidance (CFG's uncond
    branch) each move diffusers' result by more than that."""
    noise = np.random.default_rng(seed).standard_normal((1, 4, H // 4, W // 4)).astype(np.float32)
    run = lambda **kw: reference(pipe, height=H, width=W, num_inference_steps=steps, latents=torch.tensor(noise),
                                 **kw)
    ref_latents, ref_image = assert_inputs_matter(showing_moves("coreml", run), dict(prompt=PROMPT, guidance_scale=5.0),
                                                  {"the prompt": {"prompt": "a blue boat on a lake"},
                                                   "guidance": {"guidance_scale": 7.0}})
    ours = mlxdiff.load(str(folder), transformer=str(package)).generate(
        PROMPT, width=W, height=H, steps=steps, guidance=5.0, latents=noise, progress_bar=False)
    err, shift = max_rel_err(ours.latents, ref_latents), levels(ours.image, ref_image)
    print(f"coreml: latents max_rel_err {err:.1e}, image {shift} levels")
    assert err <= LATENT_TOL and shift <= IMAGE_LEVELS, (err, shift)


def _convert(module, example, names):
    traced = torch.jit.trace(module.eval(), example, check_trace=False)
    return ct.convert(traced, inputs=[ct.TensorType(name=n, shape=e.shape) for n, e in zip(names, example)],
                      convert_to="mlprogram", minimum_deployment_target=ct.target.iOS18)


def _coreml_unet(tmp_path_factory, style):
    """(folder, package, diffusers pipeline on the package's decompressed weights, {diffusers name: LutWeight}) for
    a tiny SD 1.5 whose UNet is traced as `Wrapper` (diffusers' modules) or `AppleStyle`, converted and palettized
    (6-bit k-means, every weight)."""
    from diffusers import StableDiffusionPipeline, UNet2DConditionModel
    root = tmp_path_factory.mktemp(f"coreml_sd15_{style.__name__}")
    parts = sd15_components()
    # the UNet of one level (coreml_helpers.UNET: ct.convert's and k-means' time grow with the op count): resnets,
    # the cross-attention transformer, the mid block, the embeddings; the text encoder's 20-wide context
    torch.manual_seed(0)
    parts["unet"] = twin_(UNet2DConditionModel(**{**UNET, "sample_size": 12}), seed=10)
    folder = root / "sd15"
    StableDiffusionPipeline(**parts).save_pretrained(str(folder))
    unet = parts["unet"]
    example = (torch.zeros(1, 4, H // 4, W // 4), torch.tensor([10.0]), torch.zeros(1, 77, 20))
    mlmodel = palettize_weights(_convert(style(unet), example, ("x", "t", "c")), OptimizationConfig(
        global_config=OpPalettizerConfig(mode="kmeans", nbits=6, weight_threshold=0)))
    package = root / "unet.mlpackage"
    mlmodel.save(str(package))
    decompressed = {k: v.val for k, v in get_weights_metadata(decompress_weights(mlmodel),
                                                              weight_threshold=0).items()}
    # diffusers' UNet on the package's weights: a palettized one as decompress_weights gives it (the const our
    # mapping names), every other as ct.convert stored it (float16; checked equal to the module's own, rounded)
    sd = unet.state_dict()
    ours = coreml.read_diffusers(package, {k: tuple(v.shape) for k, v in sd.items()}, prefix=None)   # found
    assert set(ours) == set(sd)
    luts = {k: v for k, v in ours.items() if isinstance(v, coreml.LutWeight)}
    replaced = {}
    for k, v in sd.items():
        if k in luts:
            replaced[k] = torch.from_numpy(decompressed[luts[k].name].astype(np.float32).reshape(v.shape))
            assert np.array_equal(luts[k].dense().astype(np.float32), replaced[k].numpy()), k
        else:
            half = v.numpy().astype(np.float16)
            assert np.array_equal(ours[k].view(np.uint16), half.view(np.uint16)), k
            replaced[k] = torch.from_numpy(half.astype(np.float32))
    pipe = StableDiffusionPipeline.from_pretrained(str(folder), safety_checker=None, requires_safety_checker=False)
    pipe.unet.load_state_dict(replaced)
    return folder, package, pipe, luts


@pytest.fixture(scope="module")
def sd15_coreml(tmp_path_factory):
    return _coreml_unet(tmp_path_factory, Wrapper)


@pytest.fixture(autouse=True)
def shared_fixture_unchanged(request):
    """The module's shared fixture (folder, package, diffusers pipeline, LUTs) is left as built (fixture_guard)."""
    yield from fixture_guard.unchanged(request, ["sd15_coreml"])


def test_apple_layout_maps_onto_diffusers_names(tmp_path_factory):
    """A package in the layout of Apple's ml-stable-diffusion conversion (Linears as 1x1 convolutions [out, in, 1,
    1], LayerNorms fused into layer_norm ops whose gamma/beta have op-made names, no wrapper prefix): every diffusers
    weight found (the norms by dataflow), each equal to coremltools' own decompression (the fixture checks), the
    Linears kept palettized, and the latents and image those of diffusers on those weights."""
    folder, package, pipe, luts = _coreml_unet(tmp_path_factory, AppleStyle)
    program = coreml._Program(package)
    fused = [op for op in program.ops if op.type == "layer_norm"]
    assert fused and all("norm" not in op.inputs["gamma"][0] for op in fused)   # names the dataflow must undo
    as_conv = [v for k, v in luts.items() if len(v.shape) == 2]
    assert len(as_conv) > 20 and all(v.palettized() is not None for v in as_conv)
    _assert_matches(folder, package, pipe, seed=2, steps=3)


def test_pipeline_image_matches_diffusers_on_decompressed(sd15_coreml):
    folder, package, pipe, luts = sd15_coreml
    assert sum(v.nbits == 6 for v in luts.values()) > 30
    _assert_matches(folder, package, pipe, seed=1, steps=4)


def test_palettized_layers_stay_palettized(sd15_coreml):
    """Every palettized Linear weight of the package is a PalettizedLinear of the built UNet and every palettized
    convolution a PalettizedConv2d (their packed 6-bit indices and tables resident, nothing decoded), the norms and
    biases dense; the size the loader plans with is the built model's."""
    from mlx.utils import tree_flatten
    from mlxdiff.formats.palettized import PalettizedLinear, row_bytes
    from mlxdiff.loading.quantize import PalettizedConv2d, parameter_nbytes
    from mlxdiff.pipelines import LoadRequest, detect
    folder, package, _, luts = sd15_coreml
    spec = detect(str(folder), LoadRequest(transformer=str(package))).components["unet"]
    model = spec.build()
    layers = {path: m for path, m in model.named_modules() if isinstance(m, (PalettizedLinear, PalettizedConv2d))}
    targets = spec.diffusers_targets()
    expected = {k[:-len(".weight")] for k in luts if k in targets["linear"] | targets["convs"]}
    assert expected and set(layers) == expected and len(expected) == len(luts)
    assert {type(m) for m in layers.values()} == {PalettizedLinear, PalettizedConv2d}
    for path, m in layers.items():
        lut = luts[f"{path}.weight"]
        out, cols = lut.shape[0], int(np.prod(lut.shape[1:]))
        assert m.weight.dtype.size == 1 and m.weight.nbytes == out * row_bytes(cols, 6)
        assert m.lut.shape == (1, 64) and m.nbits == 6
    # resident: the palettized layers hold their indices and tables (plus their biases), not a decoded weight
    params = dict(tree_flatten(model.parameters()))
    held = sum(params[f"{p}.weight"].nbytes + params[f"{p}.lut"].nbytes for p in layers)
    dense = sum(2 * np.prod(luts[f"{p}.weight"].shape) for p in layers)
    assert held < 0.8 * dense
    assert spec.loaded_nbytes() == parameter_nbytes(model)


def test_cli_reads_the_package(sd15_coreml, tmp_path):
    folder, package, _, _ = sd15_coreml
    out = tmp_path / "img.png"
    run = subprocess.run([sys.executable, "-m", "mlxdiff.generate", "--model", str(folder), "--transformer",
                          str(package), "--prompt", "a fox", "--width", str(W), "--height", str(H), "--steps", "2",
                          "--output", str(out)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert out.exists()


def _one_line(excinfo):
    msg = str(excinfo.value)
    assert "\n" not in msg and "Traceback" not in msg
    return msg


def test_not_a_unet_refused(sd15_coreml, tmp_path):
    """A package of some other model: one line saying the UNet's names are not there."""
    folder, *_ = sd15_coreml
    small = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    mlmodel = _convert(small, (torch.zeros(2, 8),), ("x",))
    mlmodel.save(str(tmp_path / "other.mlpackage"))
    with pytest.raises(MlxdiffError) as e:
        mlxdiff.load(str(folder), transformer=str(tmp_path / "other.mlpackage"))
    assert "not found by name" in _one_line(e)


def test_other_size_refused(sd15_coreml, tmp_path):
    """The package's UNet and the folder's config differ in size: one line naming a weight and both shapes."""
    folder, package, *_ = sd15_coreml
    other = tmp_path / "wider"
    shutil.copytree(folder, other)
    config = json.loads((other / "unet" / "config.json").read_text())
    config["block_out_channels"] = [24]
    (other / "unet" / "config.json").write_text(json.dumps(config))
    with pytest.raises(MlxdiffError) as e:
        mlxdiff.load(str(other), transformer=str(package))
    assert "converted from another configuration" in _one_line(e)


def test_package_elsewhere_refused(sd15_coreml, tmp_path):
    """A package where only a safetensors / GGUF file is read (a VAE), and a file named .mlpackage: one line each."""
    from mlxdiff.formats import check_weight_file
    folder, package, *_ = sd15_coreml
    with pytest.raises(MlxdiffError) as e:
        check_weight_file(package, "VAE file")
    assert "read only as an SD 1.x / SDXL UNet" in _one_line(e)
    fake = tmp_path / "fake.mlpackage"
    fake.write_bytes(b"not a folder")
    with pytest.raises(MlxdiffError) as e:
        mlxdiff.load(str(folder), transformer=str(fake))
    assert "the .mlpackage folder coremltools saves" in _one_line(e)
