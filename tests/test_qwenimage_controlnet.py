"""Qwen-Image's ControlNet: models/controlnet_qwenimage.py against diffusers' QwenImageControlNetModel (its block
residuals, with and without the Inpainting ControlNet's extra condition channels and the text mask), the
transformer taking them (QwenImageTransformer2DModel's controlnet_block_samples, 2 residuals spread over 3 blocks),
then mlxdiff.load(controlnets=) + generate(control_images=) against QwenImageControlNetPipeline on the tiny
Qwen-Image folder (tests/qwenimage_helpers.py) with true CFG, from the same injected noise: final latents within
1e-4, images within 2 levels (tests/parity.py), the control image, the conditioning scale and the control end each
moving diffusers' own result past the latent tolerance. diffusers draws the control image's VAE posterior first from the run's
generator; the test draws the same noise and gives it as control_noise=. Bad input (a ControlNet of another width,
read before its weights; an Inpainting ControlNet without its mask, or beside another; a control image missing):
one line. The Inpainting ControlNet against QwenImageControlNetInpaintPipeline: the masked control image and the
mask as its extra channels."""

import json

import numpy as np
import pytest
import torch

import fixture_guard
import mlxdiff
import mlx.core as mx
import parity
from controlnet_helpers import one_torch_thread  # noqa: F401  (autouse: this module's torch on one thread)
from helpers import load_ours, max_rel_err, randomize_
from mlxdiff.errors import MlxdiffError
from mlxdiff.models import controlnet_qwenimage, qwenimage
from mlxdiff.pipelines.controls import controlnet_folder
from qwenimage_helpers import (CONFIG, H, NEGATIVE, PROMPT, SEQ, TEXT, W, Z, check_parity, make_inputs,
                               make_torch_model, reference_unpacked, text_mask)
from qwenimage_helpers import qwen_tiny  # noqa: F401  (the fixture)
from twins import picture
from zimage_helpers import mask_picture

STEPS = 2
CONTROL, OTHER_CONTROL = picture(44, 30, seed=51), picture(W, H, seed=52)     # the first resized to 48 x 32
# the tiny pipeline's transformer: 3 heads of 32, 20 packed channels, prompt width 40; 1 block against its 2
NET = dict(patch_size=2, in_channels=4 * Z, num_layers=1, attention_head_dim=32, num_attention_heads=3,
           joint_attention_dim=TEXT["hidden_size"], axes_dims_rope=(6, 12, 14))
# at the model level: the transformer twin's config (tests/qwenimage_helpers.CONFIG), 2 blocks, 4 extra channels
MODEL_NET = dict(CONFIG, num_layers=2, extra_condition_channels=4)


def controlnet_twin(config, seed):
    from diffusers import QwenImageControlNetModel
    torch.manual_seed(seed)
    return randomize_(QwenImageControlNetModel(**config), seed=seed, scale=0.15).eval()


@pytest.fixture(autouse=True)
def _shared_fixtures_unchanged(request):
    yield from fixture_guard.unchanged(request, ["qwen_tiny"])


def test_controlnet_and_residuals_match_diffusers(tmp_path):
    """QwenImageControlNetModel's residuals (read through mlxdiff's folder reader), then the transformer with 2 of
    them over its 3 blocks (index // ceil(3 / 2)), float32, <= 1e-4, with and without the text mask."""
    net = controlnet_twin(MODEL_NET, 7)
    net.save_pretrained(str(tmp_path / "net"))
    ours_net = controlnet_folder(tmp_path / "net", "controlnet", "QwenImageControlNetModel", "a Qwen-Image").build()
    assert isinstance(ours_net, controlnet_qwenimage.Model)
    transformer = make_torch_model()
    transformer.save_pretrained(str(tmp_path / "transformer"))
    ours_transformer = load_ours(tmp_path / "transformer", qwenimage)
    inputs, shapes = make_inputs("text-to-image"), [(1, 3, 5)]
    cond = np.random.default_rng(3).standard_normal((2, 15, CONFIG["in_channels"] + 4)).astype(np.float32)
    t = {k: torch.from_numpy(v) for k, v in inputs.items()}
    for mask in (text_mask(), None):
        tm = None if mask is None else torch.from_numpy(mask)
        mm = None if mask is None else mx.array(mask)
        with torch.no_grad():
            ref = net(t["hidden_states"], torch.from_numpy(cond), 0.6, t["encoder_hidden_states"], tm, t["timestep"],
                      [shapes] * 2, return_dict=False)
        got = ours_net(mx.array(inputs["hidden_states"]), mx.array(cond), 0.6, mx.array(inputs[
            "encoder_hidden_states"]), mm, mx.array(inputs["timestep"]), shapes)
        assert len(got) == len(ref) == 2
        for g, r in zip(got, ref):
            err = max_rel_err(np.array(g), r.numpy())
            print(f"Qwen-Image ControlNet residual, mask {mask is not None}: max_rel_err {err:.2e}")
            assert err <= 1e-4
        with torch.no_grad():
            ref_out = transformer(**t, encoder_hidden_states_mask=tm, img_shapes=[shapes] * 2,
                                  controlnet_block_samples=list(ref), return_dict=False)[0].numpy()
            plain = transformer(**t, encoder_hidden_states_mask=tm, img_shapes=[shapes] * 2,
                                return_dict=False)[0].numpy()
        assert max_rel_err(ref_out, plain) > 1e-3         # the residuals reach the output
        out = ours_transformer(**{k: mx.array(v) for k, v in inputs.items()}, img_shapes=shapes,
                               encoder_hidden_states_mask=mm, controlnet_block_samples=[mx.array(r.numpy())
                                                                                        for r in ref])
        err = max_rel_err(np.array(out), ref_out)
        print(f"Qwen-Image transformer with ControlNet residuals, mask {mask is not None}: max_rel_err {err:.2e}")
        assert err <= 1e-4


@pytest.fixture(scope="module")
def controlled(qwen_tiny, tmp_path_factory):
    """(the ControlNet folder, diffusers' QwenImageControlNetPipeline, mlxdiff's pipeline with it at scale 0.8)."""
    from diffusers import QwenImageControlNetPipeline
    folder, pipe, _ = qwen_tiny
    root = tmp_path_factory.mktemp("qwenimage_controlnet")
    net = controlnet_twin(NET, 61)
    net.save_pretrained(str(root / "net"))
    reference = QwenImageControlNetPipeline(**pipe.components, controlnet=net)
    reference.set_progress_bar_config(disable=True)
    ours = mlxdiff.load(str(folder), controlnets=[(str(root / "net"), 0.8)], dtype="float32", keep="all")
    return root / "net", reference, ours


def draws(seed):
    """(control_noise, packed latents): QwenImageControlNetPipeline's first draw (the control image's posterior)
    from a Generator seeded `seed`; the latents are injected (np seeded)."""
    g = torch.Generator().manual_seed(seed)
    posterior = torch.randn((1, Z, 1, H // 4, W // 4), generator=g)[:, :, 0].numpy()
    return posterior, np.random.default_rng(seed).standard_normal((1, (H // 8) * (W // 8), 4 * Z)).astype(np.float32)


def test_controlnet_pipeline_matches_diffusers(controlled):
    """True CFG (both forwards take the positive prompt's residuals); the control image (of another size: resized),
    the scale and the control end each move diffusers' result."""
    _, reference, ours = controlled
    control_noise, latents = draws(8)
    base = dict(prompt=PROMPT, negative_prompt=NEGATIVE, true_cfg_scale=2.5, control_image=CONTROL,
                controlnet_conditioning_scale=0.8, height=H, width=W, num_inference_steps=STEPS,
                max_sequence_length=SEQ, generator_seed=8)
    ref_latents, ref_image = parity.assert_inputs_matter(
        lambda **kw: reference_unpacked(reference, latents=torch.from_numpy(latents), **kw), base,
        {"the control image": dict(control_image=OTHER_CONTROL),
         "the scale": dict(controlnet_conditioning_scale=1.7),
         "the control end": dict(control_guidance_end=0.5)})
    got = ours.generate(PROMPT, negative_prompt=NEGATIVE, true_cfg_scale=2.5, control_images=[CONTROL], width=W,
                        height=H, steps=STEPS, latents=latents, control_noise=[control_noise],
                        max_sequence_length=SEQ, progress_bar=False)
    check_parity(got, ref_latents, ref_image, "Qwen-Image ControlNet, true CFG")
    assert "reference" in got.timings
    assert any(n.startswith("ControlNet ") and "scale 0.8, from 0 to 1" in n for n in got.notes), got.notes


def test_one_union_controlnet_over_two_control_images(qwen_tiny, controlled):
    """QwenImageMultiControlNetModel([net]) with two control images (InstantX's Union ControlNet over several
    conditions: one net's residuals summed) against the same folder given twice, each image over its own share of
    the schedule with its own scale; the second image and the first's end each move diffusers' result."""
    from diffusers import QwenImageControlNetPipeline, QwenImageMultiControlNetModel
    folder, net = controlled[0], controlled[1].controlnet
    reference = QwenImageControlNetPipeline(**{**controlled[1].components,
                                               "controlnet": QwenImageMultiControlNetModel([net])})
    reference.set_progress_bar_config(disable=True)
    g = torch.Generator().manual_seed(9)
    control_noise = [torch.randn((1, Z, 1, H // 4, W // 4), generator=g)[:, :, 0].numpy() for _ in range(2)]
    latents = draws(9)[1]
    base = dict(prompt=PROMPT, control_image=[CONTROL, OTHER_CONTROL], controlnet_conditioning_scale=[0.9, 1.3],
                control_guidance_start=[0.0, 0.5], control_guidance_end=[0.5, 1.0], true_cfg_scale=1.0, height=H,
                width=W, num_inference_steps=STEPS, max_sequence_length=SEQ, generator_seed=9)
    ref_latents, ref_image = parity.assert_inputs_matter(
        lambda **kw: reference_unpacked(reference, latents=torch.from_numpy(latents), **kw), base,
        {"the second control image": dict(control_image=[CONTROL, picture(W, H, seed=53)]),
         "the first end": dict(control_guidance_end=[1.0, 1.0])})
    ours = mlxdiff.load(str(qwen_tiny[0]), controlnets=[str(folder), str(folder)], dtype="float32", keep="all")
    got = ours.generate(PROMPT, control_images=[CONTROL, OTHER_CONTROL], control_scales=[0.9, 1.3],
                        control_start=[0.0, 0.5], control_end=[0.5, 1.0], true_cfg_scale=1.0, width=W, height=H,
                        steps=STEPS, latents=latents, control_noise=control_noise, max_sequence_length=SEQ,
                        progress_bar=False)
    check_parity(got, ref_latents, ref_image, "Qwen-Image Union ControlNet, two control images")


def test_inpainting_controlnet_matches_diffusers(qwen_tiny, tmp_path):
    """QwenImageControlNetInpaintPipeline: the control image black where the mask (of another size: resized and
    binarized) repaints, its VAE posterior and 1 - the mask as the ControlNet's 4 extra channels. Its posterior is
    drawn from torch's global generator (no generator reaches it): seeded here, its draw given as control_noise=.
    The mask and the control image each move diffusers' result."""
    from diffusers import QwenImageControlNetInpaintPipeline
    net = controlnet_twin(dict(NET, extra_condition_channels=4), 71)
    net.save_pretrained(str(tmp_path / "inpaint"))
    reference = QwenImageControlNetInpaintPipeline(**qwen_tiny[1].components, controlnet=net)
    reference.set_progress_bar_config(disable=True)
    torch.manual_seed(10)
    control_noise = torch.randn((1, Z, 1, H // 4, W // 4))[:, :, 0].numpy()
    latents = draws(10)[1]

    def run(**kw):
        torch.manual_seed(10)
        return reference_unpacked(reference, latents=torch.from_numpy(latents), **kw)
    mask = mask_picture(40, 26)
    base = dict(prompt=PROMPT, control_image=CONTROL, control_mask=mask, controlnet_conditioning_scale=1.2,
                true_cfg_scale=1.0, height=H, width=W, num_inference_steps=STEPS, max_sequence_length=SEQ)
    ref_latents, ref_image = parity.assert_inputs_matter(run, base, {
        "the mask": dict(control_mask=mask_picture(26, 40)), "the control image": dict(control_image=OTHER_CONTROL)})
    ours = mlxdiff.load(str(qwen_tiny[0]), controlnets=[(str(tmp_path / "inpaint"), 1.2)], dtype="float32",
                        keep="all")
    got = ours.generate(PROMPT, control_images=[CONTROL], control_mask=mask, true_cfg_scale=1.0, width=W, height=H,
                        steps=STEPS, latents=latents, control_noise=[control_noise], max_sequence_length=SEQ,
                        progress_bar=False)
    check_parity(got, ref_latents, ref_image, "Qwen-Image Inpainting ControlNet")
    with pytest.raises(MlxdiffError, match="needs the mask of its control image"):
        ours.generate(PROMPT, control_images=[CONTROL], width=W, height=H, steps=STEPS, progress_bar=False)


def test_bad_controlnets_are_one_line(qwen_tiny, controlled, tmp_path):
    folder, _, plain = qwen_tiny
    _, _, ours = controlled
    wider = tmp_path / "wider"       # its config only and a weight file that is no safetensors: never read
    wider.mkdir()
    (wider / "config.json").write_text(json.dumps({"_class_name": "QwenImageControlNetModel",
                                                   **dict(NET, num_attention_heads=4)}))
    (wider / "diffusion_pytorch_model.safetensors").write_bytes(b"not read")
    odd = tmp_path / "odd_extra"
    controlnet_twin(dict(NET, extra_condition_channels=3), 2).save_pretrained(str(odd))
    inpaint = tmp_path / "inpaint"
    controlnet_twin(dict(NET, extra_condition_channels=4), 3).save_pretrained(str(inpaint))
    flux = tmp_path / "flux_controlnet"
    flux.mkdir()
    (flux / "config.json").write_text(json.dumps({"_class_name": "FluxControlNetModel"}))
    run = dict(width=W, height=H, steps=1, max_sequence_length=SEQ, progress_bar=False)
    cases = [
        (lambda: mlxdiff.load(str(folder), controlnets=[str(wider)]), f"ControlNet {wider}: its width .* is 128 "
                                                                      "but the model's is 96"),
        (lambda: mlxdiff.load(str(folder), controlnets=[str(odd)]), "extra_condition_channels is 3"),
        (lambda: mlxdiff.load(str(folder), controlnets=[str(controlled[0]), str(inpaint)]), "runs alone"),
        (lambda: ours.generate(PROMPT, control_images=[CONTROL], control_mask=CONTROL, **run),
         "is no Inpainting one"),
        (lambda: plain.generate(PROMPT, control_mask=CONTROL, **run), "has no ControlNet"),
        (lambda: mlxdiff.load(str(folder), controlnets=[str(flux)]), "FluxControlNetModel.*not a Qwen-Image"),
        (lambda: ours.generate(PROMPT, **run), "give one control image for each"),
        (lambda: ours.generate(PROMPT, control_images=[CONTROL], image=CONTROL, **run), "text-to-image"),
        (lambda: plain.generate(PROMPT, control_images=[CONTROL], **run), "has no ControlNet"),
    ]
    for call, message in cases:
        with pytest.raises(MlxdiffError, match=message) as e:
            call()
        assert "\n" not in str(e.value), str(e.value)


def test_command_line(qwen_tiny, controlled, tmp_path, capsys):
    """--controlnet PATH:SCALE on the Qwen-Image folder: a control image missing, and a ControlNet of another width,
    are one line each, exit 2, before anything is written."""
    from mlxdiff.generate import main
    folder = qwen_tiny[0]
    control = tmp_path / "control.png"
    CONTROL.save(control)
    out = tmp_path / "out.png"
    args = ["--model", str(folder), "--prompt", PROMPT, "--steps", "2", "--width", str(W), "--height", str(H),
            "--output", str(out), "--no-progress"]
    wider = tmp_path / "wider"
    controlnet_twin(dict(NET, num_attention_heads=4), 1).save_pretrained(str(wider))
    for extra, message in ((["--controlnet", f"{controlled[0]}:0.8"], "control image"),
                           (["--controlnet", str(wider), "--control-image", str(control)], "is 128 but the model's")):
        capsys.readouterr()
        assert main(args + extra) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], err
    assert not out.exists()
