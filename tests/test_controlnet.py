"""ControlNets of the UNet family: models/controlnet.py against diffusers' ControlNetModel (SD 1.5 and SDXL shapes),
then mlxdiff.load(controlnets=) + generate(control_images=) against StableDiffusionControlNetPipeline with one
ControlNet and with two at once (MultiControlNetModel) with control_guidance_start / end, and against
StableDiffusionXLControlNetPipeline with one, on tiny twins (tests/ldm_helpers.py; the ControlNets' zero-initialised
convolutions randomised like every other weight) from the same injected noise: final latents within 1e-4, images
within 2 levels (tests/parity.py), the control image, the scale, the start / end and the prompt each moving
diffusers' own result past the latent tolerance. Bad input (a ControlNet of another family or size, a control image missing or
extra): one line, exit 2 on the command line."""

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import fixture_guard
import mlxdiff
from helpers import max_rel_err
from ldm_helpers import clip_tokenizer, clip_twin, reference, sd15_components, twin_, vae_twin
from mlxdiff.errors import MlxdiffError
from mlxdiff.pipelines.stable_diffusion.folder import read_controlnets
from parity import IMAGE_LEVELS, LATENT_TOL, assert_inputs_matter, levels
from twins import picture

H, W = 32, 24               # latents 8 x 6 (the tiny VAE's factor is 4: three conditioning widths)
SHAPE = (1, 4, H // 4, W // 4)
PROMPT, OTHER = "a red fox in the snow", "a blue boat on a lake"
STEPS = 3
CONTROL, OTHER_CONTROL, SECOND = picture(60, 72, seed=21), picture(60, 72, seed=22), picture(W, H, seed=23)
SD15_NET = dict(in_channels=4, block_out_channels=(16, 24), norm_num_groups=8, layers_per_block=1,
                down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), cross_attention_dim=20,
                attention_head_dim=4, conditioning_embedding_out_channels=(8, 12, 16))
SDXL_UNET = dict(in_channels=4, block_out_channels=(16, 32), norm_num_groups=8, layers_per_block=1,
                 down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), cross_attention_dim=40,
                 attention_head_dim=(2, 4), transformer_layers_per_block=(1, 2), use_linear_projection=True,
                 addition_embed_type="text_time", addition_time_embed_dim=8,
                 projection_class_embeddings_input_dim=12 + 6 * 8)


def controlnet_twin(config, seed):
    from diffusers import ControlNetModel
    torch.manual_seed(seed)
    return twin_(ControlNetModel(**config), seed=seed)


def quiet(pipe):
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """diffusers' twins on one thread for this module (restored after): at these sizes a second intra-op thread only
    waits, and beside MLX's own threads on a busy machine its convolutions ran 20 ms each."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _shared_fixtures_unchanged(request):
    yield from fixture_guard.unchanged(request, ["sd15", "sdxl"])


@pytest.fixture(scope="module")
def sd15(tmp_path_factory):
    """(SD 1.5 folder, [two ControlNet folders], their diffusers models, the components)."""
    from diffusers import StableDiffusionPipeline
    root = tmp_path_factory.mktemp("sd15_control")
    parts = sd15_components()
    StableDiffusionPipeline(**parts).save_pretrained(str(root / "model"))
    nets = [controlnet_twin(SD15_NET, seed) for seed in (31, 32)]
    for k, net in enumerate(nets):
        net.save_pretrained(str(root / f"controlnet{k}"))
    return root / "model", [root / f"controlnet{k}" for k in range(2)], nets, parts


@pytest.fixture(scope="module")
def sdxl(tmp_path_factory):
    """An SDXL folder whose UNet has one layer per level (diffusers' ControlNetModel takes one count for all), its
    ControlNet's folder, the ControlNet and the components."""
    from diffusers import EulerDiscreteScheduler, StableDiffusionXLPipeline, UNet2DConditionModel
    root = tmp_path_factory.mktemp("sdxl_control")
    torch.manual_seed(0)
    parts = dict(unet=twin_(UNet2DConditionModel(sample_size=12, out_channels=4, up_block_types=(
                     "CrossAttnUpBlock2D", "UpBlock2D"), **SDXL_UNET), seed=40, scale=0.1),
                 vae=twin_(vae_twin(0.13025, 3), seed=41),
                 text_encoder=twin_(clip_twin(False, 16, 2, 2, 28, seed=1), seed=42),
                 text_encoder_2=twin_(clip_twin(True, 24, 3, 3, 40, projection=12, act="gelu", seed=2), seed=43),
                 tokenizer=clip_tokenizer(), tokenizer_2=clip_tokenizer("!"),
                 scheduler=EulerDiscreteScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                                                  steps_offset=1, timestep_spacing="leading"))
    StableDiffusionXLPipeline(**parts).save_pretrained(str(root / "model"))
    net = controlnet_twin({**SDXL_UNET, "conditioning_embedding_out_channels": (8, 12, 16)}, 44)
    net.save_pretrained(str(root / "controlnet"))
    return root / "model", root / "controlnet", net, parts


@pytest.fixture(scope="module")
def ours(sd15, sdxl):
    """mlxdiff's pipelines with one and with two ControlNets (load's scales 0.7, and 0.3 each) and SDXL's with one,
    built once and kept loaded (keep="all"; generate changes nothing else on them)."""
    model, folders, _, _ = sd15
    return {"one": mlxdiff.load(str(model), controlnets=[(str(folders[0]), 0.7)], keep="all"),
            "two": mlxdiff.load(str(model), controlnets=[(str(f), 0.3) for f in folders], keep="all"),
            "sdxl": mlxdiff.load(str(sdxl[0]), controlnets=[str(sdxl[1])], keep="all")}


def noise(seed):
    return np.random.default_rng(seed).standard_normal(SHAPE).astype(np.float32)


def assert_matches(what, ours, ref_latents, ref_image):
    err, shift = max_rel_err(ours.latents, ref_latents), levels(ours.image, ref_image)
    print(f"{what}: latents max_rel_err {err:.1e}, image {shift} levels")
    assert err <= LATENT_TOL, (what, err)
    assert shift <= IMAGE_LEVELS, (what, shift)


@pytest.mark.parametrize("kind", ["sd15", "sdxl"])
def test_controlnet_model_matches_diffusers(request, kind):
    """The residuals of ControlNetModel loaded through mlxdiff's loader (the folder's spec), float32, <= 1e-4."""
    from mlxdiff.pipelines.stable_diffusion.folder import controlnet_spec
    model_folder, folders, *rest = request.getfixturevalue(kind)
    folder, net = (folders[0], rest[0][0]) if kind == "sd15" else (folders, rest[0])
    ours = controlnet_spec(folder, "controlnet").build()
    rng = np.random.default_rng(0)
    x, cond = rng.standard_normal((2, *SHAPE[1:])).astype(np.float32), rng.random((2, 3, H, W)).astype(np.float32)
    context = rng.standard_normal((2, 7, net.config.cross_attention_dim)).astype(np.float32)
    added = None if kind == "sd15" else {"text_embeds": rng.standard_normal((2, 12)).astype(np.float32),
                                         "time_ids": np.array([[48, 40, 0, 0, 48, 40], [64, 64, 8, 4, 48, 40]],
                                                              np.float32)}
    with torch.no_grad():
        down, mid = net(torch.tensor(x), torch.tensor(601), torch.tensor(context), torch.tensor(cond),
                        conditioning_scale=0.7, added_cond_kwargs=None if added is None else
                        {k: torch.tensor(v) for k, v in added.items()}, return_dict=False)
    import mlx.core as mx
    got_down, got_mid = ours(mx.array(x), mx.array(601), mx.array(context), mx.array(cond), 0.7,
                             None if added is None else {k: mx.array(v) for k, v in added.items()})
    assert len(got_down) == len(down)
    for g, r in zip([*got_down, got_mid], [*down, mid]):
        assert max_rel_err(np.array(g).transpose(0, 3, 1, 2), r.numpy()) <= 1e-4


def test_one_controlnet_matches_diffusers(sd15, ours):
    """StableDiffusionControlNetPipeline with one ControlNet: the control image (of another size: resized) and its
    scale (load's) each move diffusers' result (the prompt's reach: tests/test_sd_pipeline.py)."""
    from diffusers import StableDiffusionControlNetPipeline
    model, folders, nets, parts = sd15
    pipe = quiet(StableDiffusionControlNetPipeline(**parts, controlnet=nets[0]))
    x = noise(1)
    run = lambda **kw: reference(pipe, height=H, width=W, num_inference_steps=STEPS, guidance_scale=4.0,
                                 latents=torch.tensor(x), **kw)
    ref_latents, ref_image = assert_inputs_matter(run, dict(prompt=PROMPT, image=CONTROL,
                                                            controlnet_conditioning_scale=0.7), {
        "the control image": {"image": OTHER_CONTROL}, "the scale": {"controlnet_conditioning_scale": 1.4}})
    got = ours["one"].generate(PROMPT, control_images=[CONTROL], width=W, height=H, steps=STEPS, guidance=4.0,
                               latents=x, progress_bar=False)
    assert_matches("sd15 one ControlNet", got, ref_latents, ref_image)
    assert set(got.timings) == {"encode", "denoise", "decode"}
    assert any(n.startswith("ControlNet ") and "scale 0.7, from 0 to 1" in n for n in got.notes), got.notes


def test_two_controlnets_with_start_and_end(sd15, ours):
    """MultiControlNetModel: two ControlNets, each over its share of the schedule; generate's control_scales replace
    load's (never multiply them: load's 0.3 under generate's [0.8, 1.2] is diffusers' [0.8, 1.2]), and load's are
    used when generate gives none; the second image, the first's end and the second's start each move diffusers'
    result."""
    from diffusers import StableDiffusionControlNetPipeline
    model, folders, nets, parts = sd15
    pipe = quiet(StableDiffusionControlNetPipeline(**parts, controlnet=list(nets)))
    x = noise(2)
    run = lambda **kw: reference(pipe, height=H, width=W, num_inference_steps=STEPS, guidance_scale=4.0,
                                 latents=torch.tensor(x), **kw)
    base = dict(prompt=PROMPT, image=[CONTROL, SECOND], controlnet_conditioning_scale=[0.8, 1.2],
                control_guidance_start=[0.0, 0.5], control_guidance_end=[0.75, 1.0])
    ref_latents, ref_image = assert_inputs_matter(run, base, {
        "the second control image": {"image": [CONTROL, OTHER_CONTROL]},
        "the first end": {"control_guidance_end": [1.0, 1.0]},
        "the second start": {"control_guidance_start": [0.0, 0.0]}})
    pipe_ours = ours["two"]
    got = pipe_ours.generate(PROMPT, control_images=[CONTROL, SECOND], control_scales=[0.8, 1.2],
                              control_start=[0.0, 0.5], control_end=[0.75, 1.0], width=W, height=H, steps=STEPS,
                              guidance=4.0, latents=x, progress_bar=False)
    assert_matches("sd15 two ControlNets", got, ref_latents, ref_image)
    same = dict(control_images=[CONTROL, SECOND], control_start=[0.0, 0.5], control_end=[0.75, 1.0], width=W,
                height=H, steps=2, guidance=4.0, latents=x, progress_bar=False)
    by_load = pipe_ours.generate(PROMPT, **same)
    given = pipe_ours.generate(PROMPT, control_scales=[0.3, 0.3], **same)
    assert np.array_equal(by_load.latents, given.latents)
    assert not np.array_equal(by_load.latents, pipe_ours.generate(PROMPT, control_scales=[0.3, 0.6], **same).latents)


def test_sdxl_controlnet_matches_diffusers(sdxl, ours):
    """StableDiffusionXLControlNetPipeline with one ControlNet (the added time ids reach it too); the output size
    left out is the control image's."""
    from diffusers import StableDiffusionXLControlNetPipeline
    model, folder, net, parts = sdxl
    pipe = quiet(StableDiffusionXLControlNetPipeline(**parts, controlnet=net))
    control, other = picture(W, H, seed=24), picture(W, H, seed=25)
    x = noise(3)
    run = lambda **kw: reference(pipe, num_inference_steps=STEPS, guidance_scale=4.0, latents=torch.tensor(x), **kw)
    ref_latents, ref_image = assert_inputs_matter(run, dict(prompt=PROMPT, image=control,
                                                            controlnet_conditioning_scale=0.9), {
        "the control image": {"image": other}, "the scale": {"controlnet_conditioning_scale": 0.3}})
    got = ours["sdxl"].generate(PROMPT, control_images=[control], control_scales=0.9, steps=STEPS, guidance=4.0,
                                latents=x, progress_bar=False)
    assert got.image.size == (W, H)
    assert_matches("sdxl one ControlNet", got, ref_latents, ref_image)


def test_bad_controlnets_are_one_line(sd15, sdxl, ours, tmp_path):
    model, folders, _, _ = sd15
    xl_model, xl_folder, _, _ = sdxl
    bigger = tmp_path / "bigger"
    controlnet_twin({**SD15_NET, "block_out_channels": (16, 32)}, 1).save_pretrained(str(bigger))
    sd3 = tmp_path / "sd3_controlnet"
    sd3.mkdir()
    (sd3 / "config.json").write_text(json.dumps({"_class_name": "SD3ControlNetModel", "num_layers": 2}))
    pipe, plain = ours["one"], mlxdiff.load(str(model))
    run = dict(width=W, height=H, steps=2, progress_bar=False)

    def read(pipeline, *controlnets):     # what load(controlnets=) does once the model is read (each load reads
        found = SimpleNamespace(components={n: s for n, s in pipeline.components.items()    # its tokenizers)
                                            if not n.startswith("controlnet")}, options={})
        read_controlnets(found, [(str(c), 1.0) for c in controlnets])
    cases = [
        (lambda: mlxdiff.load(str(model), controlnets=[str(xl_folder)]), "cross_attention_dim is 40 .* 20"),
        (lambda: read(ours["sdxl"], folders[0]), "cross_attention_dim is 20"),
        (lambda: read(plain, bigger), "block_out_channels is \\[16, 32\\]"),
        (lambda: read(plain, sd3), "SD3ControlNetModel"),
        (lambda: read(plain, tmp_path / "nowhere"), "no such folder"),
        (lambda: mlxdiff.load(str(model), controlnets=[(str(folders[0]), -1.0)]), "controlnet_scale=-1"),
        (lambda: mlxdiff.load(str(model), controlnets=str(folders[0])), "expected a list"),
        (lambda: pipe.generate(PROMPT, **run), "give one control image for each"),
        (lambda: pipe.generate(PROMPT, control_images=[CONTROL, SECOND], **run), "2 control images for 1"),
        (lambda: plain.generate(PROMPT, control_images=[CONTROL], **run), "has no ControlNet"),
        (lambda: pipe.generate(PROMPT, control_images=[CONTROL], control_start=0.6, control_end=0.5, **run),
         "control_start 0.6 is not below control_end 0.5"),
        (lambda: pipe.generate(PROMPT, control_images=[CONTROL], image=SECOND, **run), "text-to-image"),
    ]
    for call, message in cases:
        with pytest.raises(MlxdiffError, match=message) as e:
            call()
        assert "\n" not in str(e.value), str(e.value)


def test_command_line(sd15, tmp_path, capsys):
    """--controlnet PATH[:SCALE] (repeatable) and --control-image FILE (one per ControlNet), --control-start /
    --control-end; a control image missing is one line and exit 2."""
    from mlxdiff.generate import main
    model, folders, _, _ = sd15
    control = tmp_path / "control.png"
    CONTROL.save(control)
    out = tmp_path / "out.png"
    args = ["--model", str(model), "--prompt", PROMPT, "--steps", "2", "--width", str(W), "--height", str(H),
            "--output", str(out), "--no-progress", "--controlnet", f"{folders[0]}:0.8"]
    assert main(args + ["--control-image", str(control), "--control-start", "0.25"]) == 0
    assert out.exists()
    capsys.readouterr()
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "control image" in err[0], err


def controlnet_to_ldm(state: dict, layers_per_block: int) -> dict:
    """diffusers ControlNetModel state dict -> the ldm ControlNet's names (lllyasviel's cldm.py: the encoder copy in
    the UNet's input_blocks / middle_block names, zero_convs.N.0, middle_block_out.0, and input_hint_block's convs at
    0, 2, 4, ... between SiLUs), under `control_model.`; written from the ldm layout (the UNet part by
    ldm_helpers.unet_to_ldm), checked against diffusers' own converter below."""
    from ldm_helpers import unet_to_ldm
    blocks = len({k.split(".")[2] for k in state if k.startswith("controlnet_cond_embedding.blocks.")})
    own, rest = {}, {}
    for key, value in state.items():
        module, leaf = key.rsplit(".", 1)
        parts = module.split(".")
        if parts[0] == "controlnet_down_blocks":
            own[f"zero_convs.{parts[1]}.0.{leaf}"] = value
        elif parts[0] == "controlnet_mid_block":
            own[f"middle_block_out.0.{leaf}"] = value
        elif parts[0] == "controlnet_cond_embedding":
            n = 0 if parts[1] == "conv_in" else 2 * (blocks + 1) if parts[1] == "conv_out" else 2 * (int(parts[2]) + 1)
            own[f"input_hint_block.{n}.{leaf}"] = value
        else:
            rest[key] = value
    own.update(unet_to_ldm(rest, layers_per_block, []))
    return {f"control_model.{k}": v for k, v in own.items()}


def test_original_controlnet_file(sd15, ours, tmp_path):
    """An original-named ControlNet file (control_v11p_sd15_*'s layout): diffusers' convert_controlnet_checkpoint
    gives back the state dict the test's writer started from (its four conditioning widths are what that converter
    hard-codes); mlxdiff's reader (config off the shapes, heads from the UNet) gives diffusers' residuals within
    1e-4; and a file of the pipeline's ControlNet through load(controlnets=) gives the folder's run bit for bit."""
    import mlx.core as mx
    from diffusers.loaders.single_file_utils import convert_controlnet_checkpoint
    from safetensors.torch import save_file
    from mlxdiff.pipelines.stable_diffusion.folder import controlnet_spec
    model, folders, nets, _ = sd15
    net = controlnet_twin({**SD15_NET, "conditioning_embedding_out_channels": (4, 8, 12, 16)}, 33)
    state = {k: v.detach().clone().contiguous() for k, v in net.state_dict().items()}
    ldm = controlnet_to_ldm(state, 1)
    back = convert_controlnet_checkpoint(dict(ldm), dict(net.config))
    assert set(back) == set(state) and all(torch.equal(back[k], state[k]) for k in state)
    path = tmp_path / "control_tiny_canny.safetensors"
    save_file(ldm, str(path))
    net_file = controlnet_spec(path, "controlnet", ours["one"].components["unet"]).build()
    rng = np.random.default_rng(1)
    x, cond = rng.standard_normal((1, *SHAPE[1:])).astype(np.float32), rng.random((1, 3, 8 * SHAPE[2], 8 * SHAPE[3]))
    context = rng.standard_normal((1, 5, 20)).astype(np.float32)
    with torch.no_grad():
        down, mid = net(torch.tensor(x), torch.tensor(311), torch.tensor(context),
                        torch.tensor(cond, dtype=torch.float32), return_dict=False)
    got_down, got_mid = net_file(mx.array(x), mx.array(311), mx.array(context), mx.array(cond.astype(np.float32)))
    for g, r in zip([*got_down, got_mid], [*down, mid]):
        assert max_rel_err(np.array(g).transpose(0, 3, 1, 2), r.numpy()) <= 1e-4
    # the pipeline's own ControlNet as a file: the same run as from its folder
    file = tmp_path / "control_pipeline.safetensors"
    save_file(controlnet_to_ldm({k: v.detach().clone().contiguous() for k, v in nets[0].state_dict().items()}, 1),
              str(file))
    run = dict(control_images=[CONTROL], width=W, height=H, steps=2, guidance=4.0, latents=noise(4), progress_bar=False)
    from_file = mlxdiff.load(str(model), controlnets=[(str(file), 0.9)]).generate(PROMPT, **run)
    from_folder = ours["one"].generate(PROMPT, control_scales=0.9, **run)
    assert np.array_equal(from_file.latents, from_folder.latents)


def test_controlnet_is_a_component(sd15):
    """The ControlNet is a component like the others: quantized while loading under its name (quantize=), counted
    (loaded_nbytes, the budget's keep="auto"), loaded in the denoise phase and freed with it (keep="none"), kept
    with keep="all"."""
    import mlx.nn as nn
    model, folders, _, _ = sd15
    run = dict(control_images=[CONTROL], width=W, height=H, steps=1, guidance=4.0, latents=noise(5),
               progress_bar=False)
    pipe = mlxdiff.load(str(model), controlnets=[str(folders[0])], quantize={"controlnet": {"bits": 8,
                                                                                         "group_size": 32}})
    spec = pipe.components["controlnet"]
    assert spec.quantize is not None and pipe.components["unet"].quantize is None
    assert 0 < spec.loaded_nbytes() < spec.nbytes()
    built = spec.build()
    assert any(isinstance(m, nn.QuantizedLinear) for _, m in built.named_modules())
    pipe.generate(PROMPT, **run)
    assert not pipe.residency.models       # keep="none": freed with the denoise phase
    kept = mlxdiff.load(str(model), controlnets=[str(folders[0])], keep="all")
    first = kept.generate(PROMPT, **run)
    assert "controlnet" in {key[0] for key in kept.residency.models}
    again = kept.generate(PROMPT, **run)
    assert np.array_equal(first.latents, again.latents)
