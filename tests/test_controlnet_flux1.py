"""FLUX.1's ControlNets: models/controlnet_flux1.py against diffusers' FluxControlNetModel (InstantX's layout: the
control image's packed latents; a Union ControlNet's mode token; XLabs' layout: the pixels through input_hint_block,
at the model level), then mlxdiff.load(controlnets=) + generate(control_images=) against FluxControlNetPipeline on a
tiny FLUX.1 dev twin (tests/flux1_helpers.py) with one ControlNet (embedded guidance; true CFG), and with two at
once (FluxMultiControlNetModel: a plain one and a Union one with its mode, with control_guidance_start / end), from
the same injected noise: final latents within 1e-4, images within 2 levels (tests/parity.py), the control image and
the conditioning scale (the second's mode, the first's end) each moving diffusers' own result past the latent tolerance. diffusers
draws each control image's VAE posterior first from the run's generator; the test draws the same noise and gives it
as control_noise=. Bad input (a ControlNet of another size or family, a control image missing, a mode where none
belongs): one line, exit 2 on the command line."""

import json
from functools import partial
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import controlnet_helpers
import fixture_guard
import mlxdiff
from controlnet_helpers import one_torch_thread  # noqa: F401  (an autouse fixture of this module)
from flux1_helpers import H, LATENT, W, flux1_components, packed_noise, reference_run
from helpers import max_rel_err
from mlxdiff.errors import MlxdiffError
from mlxdiff.pipelines.flux1.folder import read_controlnets
from parity import IMAGE_LEVELS, LATENT_TOL, assert_inputs_matter, levels
from twins import picture

PROMPT = "a red fox in the snow"
STEPS = 3
CONTROL_SHAPE = (1, LATENT, H // 2, W // 2)        # the tiny VAE's factor is 2
CONTROL, OTHER_CONTROL, SECOND = picture(36, 50, seed=51), picture(36, 50, seed=52), picture(W, H, seed=53)
# the transformer's width (3 heads of 16), prompt (44) and pooled (36) widths and packed channels (20) are the
# model's; 1 double and 2 single blocks against its 2 and 2
NET = dict(patch_size=1, in_channels=4 * LATENT, num_layers=1, num_single_layers=2, attention_head_dim=16,
           num_attention_heads=3, joint_attention_dim=44, pooled_projection_dim=36, guidance_embeds=True,
           axes_dims_rope=(4, 6, 6))
UNION = dict(NET, num_mode=3)
XLABS = dict(NET, patch_size=2, conditioning_embedding_channels=LATENT)


controlnet_twin = partial(controlnet_helpers.controlnet_twin, "FluxControlNetModel")


@pytest.fixture(autouse=True)
def _shared_fixtures_unchanged(request):
    yield from fixture_guard.unchanged(request, ["dev"])


@pytest.fixture(scope="module")
def dev(tmp_path_factory):
    """(folder, diffusers FluxPipeline read back, {kind: (ControlNet folder, diffusers model)})."""
    from diffusers import FluxPipeline
    root = tmp_path_factory.mktemp("flux1_control")
    FluxPipeline(**flux1_components("dev", seed=3)).save_pretrained(str(root / "model"))
    nets = {}
    for kind, config, seed in (("instantx", NET, 61), ("union", UNION, 62), ("xlabs", XLABS, 63)):
        nets[kind] = (root / kind, controlnet_twin(config, seed))
        nets[kind][1].save_pretrained(str(root / kind))
    return root / "model", FluxPipeline.from_pretrained(str(root / "model")), nets


@pytest.fixture(scope="module")
def ours(dev):
    folder, _, nets = dev
    return {"one": mlxdiff.load(str(folder), controlnets=[(str(nets["instantx"][0]), 0.7)], dtype="float32",
                                keep="all"),
            "two": mlxdiff.load(str(folder), controlnets=[str(nets[k][0]) for k in ("instantx", "union")],
                                dtype="float32", keep="all")}


def control_noise(seed, count):
    """What FluxControlNetPipeline's generator gives the control images' posteriors first, in order."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(CONTROL_SHAPE, generator=g).numpy() for _ in range(count)]


def control_pipeline(dev, controlnet):
    from diffusers import FluxControlNetPipeline
    pipe = FluxControlNetPipeline(**dev[1].components, controlnet=controlnet)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def assert_matches(what, got, ref_latents, ref_image):
    err, shift = max_rel_err(got.latents, ref_latents), levels(got.image, ref_image)
    print(f"{what}: latents max_rel_err {err:.1e}, image {shift} levels")
    assert err <= LATENT_TOL, (what, err)
    assert shift <= IMAGE_LEVELS, (what, shift)


@pytest.mark.parametrize("kind", ["instantx", "union", "xlabs"])
def test_controlnet_model_matches_diffusers(dev, kind):
    """Both residual lists of FluxControlNetModel loaded through mlxdiff's loader, float32, <= 1e-4."""
    import mlx.core as mx
    from diffusers import FluxPipeline
    from mlxdiff.pipelines.controls import controlnet_folder
    folder, net = dev[2][kind]
    ours_net = controlnet_folder(folder, "controlnet", "FluxControlNetModel", "a FLUX.1").build()
    rng = np.random.default_rng(1)
    h, w = 3, 4
    x = rng.standard_normal((2, h * w, 4 * LATENT)).astype(np.float32)
    cond = (rng.standard_normal((2, 3, 16 * h, 16 * w)) if kind == "xlabs" else
            rng.standard_normal((2, h * w, 4 * LATENT))).astype(np.float32)
    context = rng.standard_normal((2, 6, 44)).astype(np.float32)
    pooled = rng.standard_normal((2, 36)).astype(np.float32)
    t = np.array([0.91, 0.37], np.float32)
    guidance = np.array([3.5, 2.0], np.float32) if net.config.guidance_embeds else None     # as the pipeline
    img_ids = FluxPipeline._prepare_latent_image_ids(1, h, w, "cpu", torch.float32).numpy()   # h x w tokens
    txt_ids = np.zeros((6, 3), np.float32)
    mode = np.array([2, 0]) if kind == "union" else None
    with torch.no_grad():
        ref = net(torch.tensor(x), torch.tensor(cond), None if mode is None else torch.tensor(mode)[:, None], 0.6,
                  torch.tensor(context), torch.tensor(pooled), torch.tensor(t), torch.tensor(img_ids),
                  torch.tensor(txt_ids), None if guidance is None else torch.tensor(guidance), return_dict=False)
    got = ours_net(mx.array(x), mx.array(cond), 0.6, mx.array(context), mx.array(pooled), mx.array(t), img_ids,
                   txt_ids, None if guidance is None else mx.array(guidance), None if mode is None else mx.array(mode))
    for g, r in zip(got, ref):
        assert len(g) == len(r)
        for a, b in zip(g, r):
            assert max_rel_err(np.array(a), b.numpy()) <= 1e-4


@pytest.mark.parametrize("case", ["guidance", "true_cfg"])
def test_one_controlnet_matches_diffusers(dev, ours, case):
    """FluxControlNetPipeline with one ControlNet (its own guidance embedder): the control image (of another size:
    resized) and the conditioning scale each move diffusers' result; with true CFG the negative forward takes the
    same residuals."""
    pipe = control_pipeline(dev, dev[2]["instantx"][1])
    x = packed_noise(1)
    extra = dict(negative_prompt="a blurry photo", true_cfg_scale=2.5) if case == "true_cfg" else {}
    run = lambda **kw: reference_run(pipe, x, generator_seed=8, num_inference_steps=STEPS, guidance_scale=3.5,
                                     max_sequence_length=32, **extra, **kw)
    changes = {"the control image": {"control_image": OTHER_CONTROL}}
    if case == "guidance":
        changes["the scale"] = {"controlnet_conditioning_scale": 1.6}
    ref_latents, ref_image = assert_inputs_matter(run, dict(prompt=PROMPT, control_image=CONTROL,
                                                            controlnet_conditioning_scale=0.7), changes)
    got = ours["one"].generate(PROMPT, control_images=[CONTROL], width=W, height=H, steps=STEPS, guidance=3.5,
                               latents=x, control_noise=control_noise(8, 1), max_sequence_length=32,
                               progress_bar=False, **extra)
    assert_matches(f"flux1 one ControlNet ({case})", got, ref_latents, ref_image)
    assert "reference" in got.timings
    assert any(n.startswith("ControlNet ") and "scale 0.7, from 0 to 1" in n for n in got.notes), got.notes


def test_two_controlnets_with_union_mode(dev, ours):
    """FluxMultiControlNetModel: a plain ControlNet and a Union one (its mode's token before the prompt), each over
    its share of the schedule; the Union's mode and the first's end each move diffusers' result."""
    nets = dev[2]
    pipe = control_pipeline(dev, [nets["instantx"][1], nets["union"][1]])
    x = packed_noise(2)
    run = lambda **kw: reference_run(pipe, x, generator_seed=9, num_inference_steps=STEPS, guidance_scale=3.5,
                                     max_sequence_length=32, **kw)
    base = dict(prompt=PROMPT, control_image=[CONTROL, SECOND], control_mode=[None, 1],
                controlnet_conditioning_scale=[0.8, 1.2], control_guidance_start=[0.0, 0.3],
                control_guidance_end=[0.7, 1.0])
    ref_latents, ref_image = assert_inputs_matter(run, base, {
        "the Union ControlNet's mode": {"control_mode": [None, 2]},
        "the first end": {"control_guidance_end": [1.0, 1.0]}})
    got = ours["two"].generate(PROMPT, control_images=[CONTROL, SECOND], control_modes=[None, 1],
                               control_scales=[0.8, 1.2], control_start=[0.0, 0.3], control_end=[0.7, 1.0], width=W,
                               height=H, steps=STEPS, guidance=3.5, latents=x, control_noise=control_noise(9, 2),
                               max_sequence_length=32, progress_bar=False)
    assert_matches("flux1 two ControlNets (Union)", got, ref_latents, ref_image)


def test_bad_controlnets_are_one_line(dev, ours, tmp_path):
    folder, _, nets = dev
    pipe, two = ours["one"], ours["two"]
    wider = tmp_path / "wider"
    controlnet_twin(dict(NET, num_attention_heads=4), 1).save_pretrained(str(wider))
    deeper = tmp_path / "deeper"
    controlnet_twin(dict(NET, num_single_layers=3), 2).save_pretrained(str(deeper))
    unguided = tmp_path / "unguided"
    controlnet_twin(dict(NET, guidance_embeds=False), 3).save_pretrained(str(unguided))
    sd3 = tmp_path / "sd3_controlnet"
    sd3.mkdir()
    (sd3 / "config.json").write_text(json.dumps({"_class_name": "SD3ControlNetModel"}))
    run = dict(width=W, height=H, steps=1, max_sequence_length=32, progress_bar=False)

    def read(*controlnets, pipeline_class="FluxPipeline"):     # load(controlnets=)'s step once the model is read
        found = SimpleNamespace(components={n: s for n, s in pipe.components.items()
                                            if not n.startswith("controlnet")}, options={},
                                pipeline_class=pipeline_class)
        read_controlnets(found, [(str(c), 1.0) for c in controlnets])
    cases = [
        (lambda: mlxdiff.load(str(folder), controlnets=[str(wider)]), "width .* is 64 but the model's is 48"),
        (lambda: read(nets["instantx"][0], deeper), "num_single_layers is 3"),
        (lambda: read(nets["xlabs"][0]), "control image factor"),
        (lambda: read(nets["instantx"][0], unguided), "guidance_embeds is False"),
        (lambda: read(sd3), "SD3ControlNetModel.*not a FLUX.1 ControlNet"),
        (lambda: read(tmp_path / "nowhere"), "no such folder"),
        (lambda: read(nets["instantx"][0], pipeline_class="FluxFillPipeline"), "FluxFillPipeline model"),
        (lambda: pipe.generate(PROMPT, **run), "give one control image for each"),
        (lambda: pipe.generate(PROMPT, control_images=[CONTROL], image=SECOND, **run), "text-to-image"),
        (lambda: pipe.generate(PROMPT, control_images=[CONTROL], control_modes=[1], **run), "no Union ControlNet"),
        (lambda: two.generate(PROMPT, control_images=[CONTROL, SECOND], **run), "needs the mode of its image"),
        (lambda: two.generate(PROMPT, control_images=[CONTROL, SECOND], control_modes=[None, 3], **run),
         "from 0 to 2"),
    ]
    for call, message in cases:
        with pytest.raises(MlxdiffError, match=message) as e:
            call()
        assert "\n" not in str(e.value), str(e.value)


def test_command_line(dev, tmp_path, capsys):
    """--controlnet PATH[:SCALE] --control-image FILE on a FLUX.1 model: a control image missing and a ControlNet of
    another family (an SD3 one) are one line each, exit 2 (a run: test_controlnet_is_a_component)."""
    from mlxdiff.generate import main
    folder, _, nets = dev
    control = tmp_path / "control.png"
    CONTROL.save(control)
    sd3 = tmp_path / "sd3_controlnet"
    sd3.mkdir()
    (sd3 / "config.json").write_text(json.dumps({"_class_name": "SD3ControlNetModel"}))
    args = ["--model", str(folder), "--prompt", PROMPT, "--steps", "1", "--width", str(W), "--height", str(H),
            "--output", str(tmp_path / "out.png"), "--no-progress"]
    for extra, message in ((["--controlnet", f"{nets['instantx'][0]}:0.8"], "control image"),
                           (["--controlnet", str(sd3), "--control-image", str(control)], "SD3ControlNetModel")):
        capsys.readouterr()
        assert main(args + extra) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], err
    assert not (tmp_path / "out.png").exists()


def test_controlnet_is_a_component(dev):
    """The ControlNet is a component like the others: quantized while loading under its name (quantize=), counted
    (loaded_nbytes), loaded in the denoise phase and freed with it (keep="none"); the seed's control noise."""
    import mlx.nn as nn
    folder, _, nets = dev
    pipe = mlxdiff.load(str(folder), controlnets=[str(nets["instantx"][0])], dtype="float32",
                        quantize={"controlnet": {"bits": 8, "group_size": 32}})
    spec = pipe.components["controlnet"]
    assert spec.quantize is not None and pipe.components["transformer"].quantize is None
    assert 0 < spec.loaded_nbytes() < spec.nbytes()
    assert any(isinstance(m, nn.QuantizedLinear) for _, m in spec.build().named_modules())
    got = pipe.generate(PROMPT, control_images=[CONTROL], width=W, height=H, steps=1, max_sequence_length=32,
                        progress_bar=False)
    assert not pipe.residency.models and np.isfinite(got.latents).all()
