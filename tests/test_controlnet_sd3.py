"""SD3.5's ControlNets: models/controlnet_sd3.py against diffusers' SD3ControlNetModel (InstantX's layout: joint
blocks, its own patch embedding, zero pooled projections; and SD3.5's official layout: no joint attention, the
transformer's patch embedding, the pooled prompt), then mlxdiff.load(controlnets=) + generate(control_images=)
against StableDiffusion3ControlNetPipeline on the session's tiny SD3.5 folder (conftest sd3_tiny) with one ControlNet
and with two at once (SD3MultiControlNetModel, with control_guidance_start / end), from the same injected noise:
final latents within 1e-4, images within 2 levels (tests/parity.py), the control image and the conditioning scale
(and the second's image, the first's end) each moving diffusers' own result past the latent tolerance. The control images' VAE
posterior noise: diffusers draws it from torch's global generator (vae.encode(...).latent_dist.sample() without a
generator), so the test seeds that generator, draws the same noise and gives it as control_noise=. Bad input (a
ControlNet of another size or family, a control image missing): one line, exit 2 on the command line."""

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
from helpers import max_rel_err
from mlxdiff.errors import MlxdiffError
from mlxdiff.pipelines.sd3.folder import read_controlnets
from parity import IMAGE_LEVELS, LATENT_TOL, assert_inputs_matter, levels
from twins import picture

H, W = 40, 24                  # the tiny SD3 pipeline's test size (latents 20 x 12, 10 x 6 patches)
LATENT_SHAPE = (1, 16, H // 2, W // 2)
PROMPT = "a red fox in the snow"
STEPS = 3
CONTROL, OTHER_CONTROL, SECOND = picture(30, 52, seed=31), picture(30, 52, seed=32), picture(W, H, seed=33)
# the transformer's width (3 heads of 8), prompt (96) and pooled (64) widths are the model's; depth 2 of its 3
INSTANTX = dict(sample_size=16, patch_size=2, in_channels=16, num_layers=2, attention_head_dim=8,
                num_attention_heads=3, joint_attention_dim=96, caption_projection_dim=24, pooled_projection_dim=64,
                out_channels=16, pos_embed_max_size=12)
SD35 = dict(INSTANTX, num_layers=1, joint_attention_dim=None, use_pos_embed=False,
            force_zeros_for_pooled_projection=False, pos_embed_max_size=20)


controlnet_twin = partial(controlnet_helpers.controlnet_twin, "SD3ControlNetModel")


@pytest.fixture(autouse=True)
def _shared_fixtures_unchanged(request):
    yield from fixture_guard.unchanged(request, ["nets"])


@pytest.fixture(scope="module")
def nets(tmp_path_factory):
    """{kind: (folder, diffusers model)}: two InstantX-layout ControlNets and one SD3.5-layout one."""
    root = tmp_path_factory.mktemp("sd3_controlnets")
    out = {}
    for kind, config, seed in (("instantx", INSTANTX, 41), ("instantx_2", INSTANTX, 42), ("sd35", SD35, 43)):
        net = controlnet_twin(config, seed)
        net.save_pretrained(str(root / kind))
        out[kind] = (root / kind, net)
    return out


@pytest.fixture(scope="module")
def ours(sd3_tiny, nets):
    folder, _ = sd3_tiny
    return {"one": mlxdiff.load(str(folder), controlnets=[(str(nets["instantx"][0]), 0.7)], dtype="float32",
                                keep="all"),
            "two": mlxdiff.load(str(folder), controlnets=[(str(nets[k][0]), 0.5) for k in ("instantx", "instantx_2")],
                                dtype="float32", keep="all"),
            "sd35": mlxdiff.load(str(folder), controlnets=[str(nets["sd35"][0])], dtype="float32", keep="all")}


def noise(seed):
    return np.random.default_rng(seed).standard_normal(LATENT_SHAPE).astype(np.float32)


def control_noise(seed, count, rows=1):
    """What the reference's vae.encode(...).latent_dist.sample() draws, in order, after torch.manual_seed(seed): with
    CFG it encodes each control image twice (one row per half, each its own noise)."""
    torch.manual_seed(seed)
    return [torch.randn((rows, *LATENT_SHAPE[1:])).numpy() for _ in range(count)]


def reference(pipe, seed, **kw):
    """diffusers' run, torch's global generator seeded first: (final latents, their decode in [0, 1])."""
    torch.manual_seed(seed)
    with torch.no_grad():
        latents = pipe(height=H, width=W, num_inference_steps=STEPS, output_type="latent", **kw).images
        vae = pipe.vae
        image = vae.decode(latents / vae.config.scaling_factor + vae.config.shift_factor, return_dict=False)[0]
    return latents.numpy(), pipe.image_processor.postprocess(image, output_type="np")[0]


def assert_matches(what, got, ref_latents, ref_image):
    err, shift = max_rel_err(got.latents, ref_latents), levels(got.image, ref_image)
    print(f"{what}: latents max_rel_err {err:.1e}, image {shift} levels")
    assert err <= LATENT_TOL, (what, err)
    assert shift <= IMAGE_LEVELS, (what, shift)


def control_pipeline(sd3_tiny, controlnet):
    from diffusers import StableDiffusion3ControlNetPipeline
    pipe = StableDiffusion3ControlNetPipeline(**sd3_tiny[1].components, controlnet=controlnet)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.mark.parametrize("kind", ["instantx", "sd35"])
def test_controlnet_model_matches_diffusers(sd3_tiny, nets, ours, kind):
    """The block residuals of SD3ControlNetModel loaded through mlxdiff's loader, float32, <= 1e-4 (SD3.5's layout
    through the transformer's patch embedding, as the pipeline gives it)."""
    import mlx.core as mx
    folder, net = nets[kind]
    pipe = ours["one" if kind == "instantx" else "sd35"]
    ours_net = pipe.components["controlnet"].build()
    rng = np.random.default_rng(0)
    x, cond = rng.standard_normal((2, 16, 20, 12)).astype(np.float32), rng.standard_normal((2, 16, 20, 12))
    cond = cond.astype(np.float32)
    context = rng.standard_normal((2, 7, 96)).astype(np.float32)
    pooled = rng.standard_normal((2, 64)).astype(np.float32)
    t = np.array([811.0, 402.0], np.float32)
    pos_embed = None
    if kind == "sd35":        # what StableDiffusion3ControlNetPipeline gives it: the transformer's patch embedding
        net = controlnet_twin(SD35, 43)
        net.pos_embed = net._get_pos_embed_from_transformer(sd3_tiny[1].transformer)
        pos_embed = pipe.components["transformer"].build().pos_embed
    with torch.no_grad():
        ref = net(torch.tensor(x), torch.tensor(cond), 0.6, None if kind == "sd35" else torch.tensor(context),
                  torch.tensor(pooled), torch.tensor(t), return_dict=False)[0]
    got = ours_net(mx.array(x), mx.array(cond), 0.6, None if kind == "sd35" else mx.array(context),
                   mx.array(pooled), mx.array(t), pos_embed=pos_embed)
    assert len(got) == len(ref) == net.config.num_layers
    for g, r in zip(got, ref):
        assert max_rel_err(np.array(g), r.numpy()) <= 1e-4


def test_one_controlnet_matches_diffusers(sd3_tiny, nets, ours):
    """StableDiffusion3ControlNetPipeline with one InstantX-layout ControlNet (CFG): the control image (of another
    size: resized) and the conditioning scale each move diffusers' result."""
    pipe = control_pipeline(sd3_tiny, nets["instantx"][1])
    x = noise(1)
    run = lambda **kw: reference(pipe, 5, guidance_scale=4.0, latents=torch.tensor(x), **kw)
    ref_latents, ref_image = assert_inputs_matter(run, dict(prompt=PROMPT, control_image=CONTROL,
                                                            controlnet_conditioning_scale=0.7), {
        "the control image": {"control_image": OTHER_CONTROL}, "the scale": {"controlnet_conditioning_scale": 1.6}})
    got = ours["one"].generate(PROMPT, control_images=[CONTROL], width=W, height=H, steps=STEPS, guidance=4.0,
                               latents=x, control_noise=control_noise(5, 1, rows=2), progress_bar=False)
    assert_matches("sd3 one ControlNet", got, ref_latents, ref_image)
    assert "reference" in got.timings
    assert any(n.startswith("ControlNet ") and "scale 0.7, from 0 to 1" in n for n in got.notes), got.notes


def test_two_controlnets_with_start_and_end(sd3_tiny, nets, ours):
    """SD3MultiControlNetModel: two ControlNets, each over its share of the schedule, generate's scales replacing
    load's; the second image and the first's end each move diffusers' result."""
    pipe = control_pipeline(sd3_tiny, [nets["instantx"][1], nets["instantx_2"][1]])
    x = noise(2)
    run = lambda **kw: reference(pipe, 6, guidance_scale=1.0, latents=torch.tensor(x), **kw)
    base = dict(prompt=PROMPT, control_image=[CONTROL, SECOND], controlnet_conditioning_scale=[0.8, 1.2],
                control_guidance_start=[0.0, 0.3], control_guidance_end=[0.7, 1.0])
    ref_latents, ref_image = assert_inputs_matter(run, base, {
        "the second control image": {"control_image": [CONTROL, OTHER_CONTROL]},
        "the first end": {"control_guidance_end": [1.0, 1.0]}})
    got = ours["two"].generate(PROMPT, control_images=[CONTROL, SECOND], control_scales=[0.8, 1.2],
                               control_start=[0.0, 0.3], control_end=[0.7, 1.0], width=W, height=H, steps=STEPS,
                               guidance=1.0, latents=x, control_noise=control_noise(6, 2), progress_bar=False)
    assert_matches("sd3 two ControlNets", got, ref_latents, ref_image)


def test_sd35_layout_controlnet_matches_diffusers(sd3_tiny, nets, ours):
    """SD3.5's official layout (no joint attention, the transformer's patch embedding, the pooled prompt, the VAE's
    shift applied to the control latents) through the pipeline; the control image moves diffusers' result."""
    pipe = control_pipeline(sd3_tiny, controlnet_twin(SD35, 43))
    x = noise(3)
    run = lambda **kw: reference(pipe, 7, guidance_scale=3.0, latents=torch.tensor(x), **kw)
    ref_latents, ref_image = assert_inputs_matter(run, dict(prompt=PROMPT, control_image=CONTROL), {
        "the control image": {"control_image": OTHER_CONTROL}})
    got = ours["sd35"].generate(PROMPT, control_images=[CONTROL], width=W, height=H, steps=STEPS, guidance=3.0,
                                latents=x, control_noise=control_noise(7, 1, rows=2), progress_bar=False)
    assert_matches("sd3.5-layout ControlNet", got, ref_latents, ref_image)


def test_bad_controlnets_are_one_line(nets, ours, tmp_path):
    wider = tmp_path / "wider"
    controlnet_twin(dict(INSTANTX, num_attention_heads=4, caption_projection_dim=32), 1).save_pretrained(str(wider))
    deeper = tmp_path / "deeper"
    controlnet_twin(dict(INSTANTX, num_layers=3), 2).save_pretrained(str(deeper))
    sd = tmp_path / "sd_controlnet"
    sd.mkdir()
    (sd / "config.json").write_text(json.dumps({"_class_name": "ControlNetModel"}))
    pipe = ours["one"]
    run = dict(width=W, height=H, steps=1, progress_bar=False)
    net = str(nets["instantx"][0])

    def read(*controlnets):     # what load(controlnets=) does once the model is read (each load reads its tokenizers)
        found = SimpleNamespace(components={n: s for n, s in pipe.components.items()
                                            if not n.startswith("controlnet")}, options={})
        read_controlnets(found, [(str(c), 1.0) for c in controlnets])
    cases = [
        (lambda: read(wider), "width .* is 32 but the model's is 24"),     # through load: test_command_line
        (lambda: read(net, deeper), "num_layers is 3"),
        (lambda: read(sd), "ControlNetModel.*not an SD3 ControlNet"),
        (lambda: read(tmp_path / "nowhere"), "no such folder"),
        (lambda: read(tmp_path / "out.safetensors"), "no such folder"),
        (lambda: pipe.generate(PROMPT, **run), "give one control image for each"),
        (lambda: pipe.generate(PROMPT, control_images=[CONTROL, SECOND], **run), "2 control images for 1"),
        (lambda: pipe.generate(PROMPT, control_images=[CONTROL], image=SECOND, **run), "text-to-image"),
        (lambda: pipe.generate(PROMPT, control_images=[CONTROL], skip_guidance_layers=[1], **run),
         "no skip-layer guidance"),
        (lambda: pipe.generate(PROMPT, control_images=[CONTROL], control_noise=[noise(0)[:, :4]], **run),
         "control_noise\\[0\\] has shape"),
    ]
    for call, message in cases:
        with pytest.raises(MlxdiffError, match=message) as e:
            call()
        assert "\n" not in str(e.value), str(e.value)


def test_command_line(sd3_tiny, nets, tmp_path, capsys):
    """--controlnet PATH[:SCALE] --control-image FILE on an SD3.5 model (a run: tests/test_controlnet_flux1.py's):
    a control image missing and a ControlNet of another size are one line each, exit 2."""
    from mlxdiff.generate import main
    folder, _ = sd3_tiny
    control = tmp_path / "control.png"
    CONTROL.save(control)
    wider = tmp_path / "wider"
    controlnet_twin(dict(INSTANTX, num_attention_heads=4, caption_projection_dim=32), 1).save_pretrained(str(wider))
    args = ["--model", str(folder), "--prompt", PROMPT, "--steps", "1", "--width", str(W), "--height", str(H),
            "--output", str(tmp_path / "out.png"), "--no-progress"]
    for extra, message in ((["--controlnet", f"{nets['instantx'][0]}:0.8"], "control image"),
                           (["--controlnet", str(wider), "--control-image", str(control)], "width")):
        capsys.readouterr()
        assert main(args + extra) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], err
    assert not (tmp_path / "out.png").exists()
