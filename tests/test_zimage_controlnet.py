"""Z-Image's ControlNet: models/controlnet_zimage.py against diffusers' ZImageControlNetModel in its three layouts
(add_control_noise_refiner null: plain control refiner blocks, alibaba-pai's Fun ControlNet Union 1.0;
"control_layers": the control layers also refine the image tokens, 2.0; "control_noise_refiner": control refiner
blocks, 2.1), its hints and the transformer's output with them, loaded through mlxdiff's loader from diffusers
folders; the single files (diffusers' names, their config read off the shapes: the published places, 6 control
layers every 5th of 30 or 15 every 2nd) on a 30-layer transformer, as diffusers' from_single_file reads them with the
folder's config; then mlxdiff.load(controlnets=) + generate(control_images=) against ZImageControlNetPipeline from
the same injected noise (final latents within 1e-4, images within 2 levels: tests/parity.py), the control image and
the conditioning scale each moving diffusers' own result past the latent tolerance. Bad input (a ControlNet of another width, places
past the transformer, an unknown file layout, two ControlNets, control_noise): one line."""

import json

import mlx.core as mx
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import fixture_guard
import mlxdiff
import parity
from controlnet_helpers import one_torch_thread  # noqa: F401  (autouse: this module's torch on one thread)
from helpers import max_rel_err, randomize_
from mlxdiff.errors import MlxdiffError
from mlxdiff.loading.sources import folder_component
from mlxdiff.pipelines.controls import controlnet_folder
from mlxdiff.pipelines.zimage.folder import controlnet_file
from twins import QWEN3_TEMPLATE, build_tokenizer, picture, save_qwen3
from zimage_helpers import LATENT, SEQ, TEXT, check_parity, mask_picture, reference_run

H, W = 40, 48          # latents 20 x 24: 10 x 12 = 120 image tokens, padded to 128
DIM, HEADS = 48, 3     # 3 heads of 16 (RoPE axes 4, 6, 6); SwiGLU 128; 7 main layers, 2 of each refiner
LAYERS = 7
CONTROL_IN = 2 * LATENT + 1        # the 2.x layout: latents, mask, masked latents (the pipeline pads with zeros)
NETS = {"v1": dict(control_layers_places=[0, 3, 6], control_in_dim=LATENT),
        "v20": dict(control_layers_places=[0, 5], control_refiner_layers_places=[0, 1], control_in_dim=CONTROL_IN,
                    add_control_noise_refiner="control_layers"),
        "v21": dict(control_layers_places=[0, 2, 5], control_refiner_layers_places=[1], control_in_dim=CONTROL_IN,
                    add_control_noise_refiner="control_noise_refiner")}
# the published files' layouts (their config read off the shapes), on a 30-layer transformer
PUBLISHED = {"v1": dict(NETS["v1"], control_layers_places=list(range(0, 30, 5))),
             "v20": dict(NETS["v20"], control_layers_places=list(range(0, 30, 2))),
             "v21": dict(NETS["v21"], control_layers_places=list(range(0, 30, 2)),
                         control_refiner_layers_places=[0, 1])}
FILES = {"v1": "Z-Image-Turbo-Fun-Controlnet-Union.safetensors",
         "v20": "Z-Image-Turbo-Fun-Controlnet-Union-2.0.safetensors",
         "v21": "Z-Image-Turbo-Fun-Controlnet-Union-2.1.safetensors"}
PROMPT = "a red fox in the snow"
CONTROL, OTHER_CONTROL = picture(52, 44, seed=71), picture(52, 44, seed=72)     # another size: resized


def fresh(folder):
    """The diffusers ControlNet read afresh (from_transformer, which its pipeline calls, adds the transformer's
    modules to it)."""
    from diffusers import ZImageControlNetModel
    return ZImageControlNetModel.from_pretrained(str(folder)).eval()


def controlnet_twin(layout, seed, **changes):
    from diffusers import ZImageControlNetModel
    torch.manual_seed(seed)
    config = dict(all_patch_size=(2,), all_f_patch_size=(1,), dim=DIM, n_refiner_layers=2, n_heads=HEADS,
                  n_kv_heads=HEADS, **layout)
    return randomize_(ZImageControlNetModel(**{**config, **changes}), seed=seed, scale=0.15).eval()


@pytest.fixture(autouse=True)
def _shared_fixtures_unchanged(request):
    yield from fixture_guard.unchanged(request, ["zcn"])


@pytest.fixture(scope="module")
def zcn(tmp_path_factory):
    """(ZImagePipeline folder, its diffusers twin, {kind: ControlNet folder}, root)."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, ZImagePipeline
    from transformers import AutoTokenizer
    root = tmp_path_factory.mktemp("zimage_controlnet")
    encoder = save_qwen3(root / "te_src", TEXT, seed=5)
    tok_dir = build_tokenizer(root / "tok_src", ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>",
                                                 "</think>"], QWEN3_TEMPLATE, "right", "<|endoftext|>",
                              eos="<|im_end|>")
    torch.manual_seed(0)
    transformer = transformer_twin(LAYERS)
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, block_out_channels=(8, 12), layers_per_block=1, latent_channels=LATENT,
        norm_num_groups=4, down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
        scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False)
    randomize_(vae, seed=21, scale=0.15).eval()
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)
    pipe = ZImagePipeline(scheduler=scheduler, vae=vae, text_encoder=encoder.float().eval(),
                          tokenizer=AutoTokenizer.from_pretrained(str(tok_dir)), transformer=transformer)
    pipe.save_pretrained(str(root / "model"))
    for seed, kind in enumerate(NETS, start=30):
        controlnet_twin(NETS[kind], seed).save_pretrained(str(root / kind))
    return root / "model", ZImagePipeline.from_pretrained(str(root / "model")), {k: root / k for k in NETS}, root


def transformer_twin(layers):
    from diffusers import ZImageTransformer2DModel
    torch.manual_seed(0)
    transformer = ZImageTransformer2DModel(
        all_patch_size=(2,), all_f_patch_size=(1,), in_channels=LATENT, dim=DIM, n_layers=layers, n_refiner_layers=2,
        n_heads=HEADS, n_kv_heads=HEADS, cap_feat_dim=TEXT["hidden_size"], axes_dims=(4, 6, 6),
        axes_lens=(128, 32, 32))
    return randomize_(transformer, seed=20, scale=0.15).eval()


@pytest.fixture(scope="module")
def ours(zcn):
    folder, _, nets, _ = zcn
    return mlxdiff.load(str(folder), controlnets=[(str(nets["v21"]), 0.8)], dtype="float32", keep="all")


def transformer_model(pipe, built={}):
    """mlxdiff's transformer of the pipeline, built once for the module's model tests."""
    if id(pipe) not in built:
        built[id(pipe)] = pipe.components["transformer"].build()
    return built[id(pipe)]


def model_inputs(seed=1):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((2, LATENT, H // 2, W // 2)).astype(np.float32)
    caps = rng.standard_normal((2, 37, TEXT["hidden_size"])).astype(np.float32)
    mask = np.zeros((2, 37), np.float32)
    mask[0, :37], mask[1, :5] = 1, 1            # captions of 37 and 5 tokens: padded to 64 and 32
    t = np.array([0.83, 0.41], np.float32)
    return x, caps, mask, t


def check_model(transformer, net, ours_transformer, ours_net, what, output=True):
    """diffusers' hints and (`output`) the transformer's output with them against mlxdiff's, float32 <= 1e-4 (the
    scale 0.6)."""
    from diffusers import ZImageControlNetModel
    net = ZImageControlNetModel.from_transformer(net, transformer)
    x, caps, mask, t = model_inputs()
    cond = np.random.default_rng(2).standard_normal((2, net.config.control_in_dim, H // 2, W // 2)).astype(np.float32)
    lists = dict(x=[torch.tensor(r)[:, None] for r in x], t=torch.tensor(t),
                 caps=[torch.tensor(c[m > 0]) for c, m in zip(caps, mask)])
    with torch.no_grad():
        ref = net(lists["x"], lists["t"], lists["caps"], [torch.tensor(c)[:, None] for c in cond], 0.6)
    got = ours_net(ours_transformer, mx.array(x), mx.array(t), mx.array(caps), mx.array(cond), 0.6, mx.array(mask))
    assert sorted(got) == sorted(ref)
    for place, r in ref.items():        # each row's tokens: 128 image + its caption's 64 or 32
        for row, n in enumerate((128 + 64, 128 + 32)):
            assert max_rel_err(np.array(got[place][row, :n]), r[row, :n].numpy()) <= 1e-4, (what, place, row)
    if not output:
        return
    with torch.no_grad():
        ref_out = transformer(lists["x"], lists["t"], lists["caps"], controlnet_block_samples=ref, return_dict=False)[0]
    out = ours_transformer(mx.array(x), mx.array(t), mx.array(caps), mx.array(mask), controlnet_block_samples=got)
    err = max_rel_err(np.array(out), torch.stack(ref_out).squeeze(2).numpy())
    print(f"{what}: transformer output with hints max_rel_err {err:.1e}")
    assert err <= 1e-4


@pytest.mark.parametrize("kind", list(NETS))
def test_controlnet_model_matches_diffusers(zcn, ours, kind):
    """Each layout's hints (keyed by the transformer's layer) and the transformer's output with them, the ControlNet
    read from its diffusers folder by mlxdiff's loader."""
    folder = zcn[2][kind]
    spec = controlnet_folder(folder, "controlnet", "ZImageControlNetModel", "a Z-Image")
    check_model(zcn[1].transformer, fresh(folder), transformer_model(ours), spec.build(), f"{kind} folder")


def test_single_files_match_diffusers(zcn, tmp_path):
    """alibaba-pai's three files (diffusers' names): their configs read off the shapes are the published ones; the
    2.1 file's hints on a 30-layer transformer against diffusers' from_single_file of it (with the config)."""
    from diffusers import ZImageControlNetModel
    for seed, kind in enumerate(NETS, start=40):
        net = controlnet_twin(PUBLISHED[kind], seed)
        file = tmp_path / FILES[kind]
        save_file({k: v.contiguous() for k, v in net.state_dict().items()}, str(file))
        spec = controlnet_file(file, "controlnet")
        assert spec.config == {**spec.config, **PUBLISHED[kind]}, spec.config
    folder = tmp_path / "v21_config"
    net.save_config(str(folder))
    theirs = ZImageControlNetModel.from_single_file(str(file), config=str(folder)).eval()
    transformer = transformer_twin(30)
    transformer.save_pretrained(str(tmp_path / "transformer"))
    ours_transformer = folder_component(tmp_path, "transformer", "ZImageTransformer2DModel").build()
    check_model(transformer, theirs, ours_transformer, spec.build(), "2.1 single file, 30 layers", output=False)


def control_pipeline(zcn, kind="v21"):
    from diffusers import ZImageControlNetPipeline
    pipe = ZImageControlNetPipeline(**zcn[1].components, controlnet=fresh(zcn[2][kind]))
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.mark.parametrize("guidance", [0.0, 2.5], ids=["turbo", "cfg"])
def test_pipeline_matches_diffusers(zcn, ours, guidance):
    """ZImageControlNetPipeline with the 2.1 layout (control latents zero-padded to 9 channels), Turbo's way (no
    CFG) and with CFG (each half its prompt's hints): the control image and the scale each move diffusers' result."""
    pipe = control_pipeline(zcn)
    noise = np.random.default_rng(3).standard_normal((1, LATENT, H // 2, W // 2)).astype(np.float32)
    base = dict(prompt=PROMPT, height=H, width=W, num_inference_steps=2, guidance_scale=guidance,
                control_image=CONTROL, controlnet_conditioning_scale=0.8)
    changes = {"the control image": dict(control_image=OTHER_CONTROL)}
    if not guidance:
        changes["the scale"] = dict(controlnet_conditioning_scale=1.7)
    ref_latents, ref = parity.assert_inputs_matter(lambda **kw: reference_run(pipe, noise, **kw), base, changes)
    got = ours.generate(PROMPT, control_images=[CONTROL], width=W, height=H, steps=2, guidance=guidance,
                        latents=noise, max_sequence_length=SEQ, progress_bar=False)
    check_parity(got, ref_latents, ref, f"Z-Image ControlNet guidance {guidance}")
    assert "reference" in got.timings
    assert any(n.startswith("ControlNet ") and "scale 0.8, from 0 to 1" in n for n in got.notes), got.notes


def test_inpaint_matches_diffusers(zcn, ours):
    """ZImageControlNetInpaintPipeline (the 2.1 layout's 9 control channels: the control latents, the mask, the masked
    image's latents), from the same noise: the image and the mask each move diffusers' result."""
    from diffusers import ZImageControlNetInpaintPipeline
    pipe = ZImageControlNetInpaintPipeline(**zcn[1].components, controlnet=fresh(zcn[2]["v21"]))
    pipe.set_progress_bar_config(disable=True)
    noise = np.random.default_rng(4).standard_normal((1, LATENT, H // 2, W // 2)).astype(np.float32)
    image, mask = picture(W, H, seed=73), mask_picture(60, 50)
    base = dict(prompt=PROMPT, height=H, width=W, num_inference_steps=2, guidance_scale=0.0, image=image,
                mask_image=mask, control_image=CONTROL, controlnet_conditioning_scale=0.8)
    ref_latents, ref = parity.assert_inputs_matter(lambda **kw: reference_run(pipe, noise, **kw), base, {
        "the image": dict(image=picture(W, H, seed=74)), "the mask": dict(mask_image=mask.rotate(180))})
    got = ours.generate(PROMPT, image=image, mask=mask, control_images=[CONTROL], width=W, height=H, steps=2,
                        guidance=0.0, latents=noise, max_sequence_length=SEQ, progress_bar=False)
    check_parity(got, ref_latents, ref, "Z-Image ControlNet inpainting")
    assert any(n.startswith("inpainting where") for n in got.notes), got.notes


def test_bad_controlnets_are_one_line(zcn, ours, tmp_path):
    folder, _, nets, _ = zcn
    wider = tmp_path / "wider"
    controlnet_twin(NETS["v1"], 1, dim=64, n_heads=4, n_kv_heads=4).save_pretrained(str(wider))
    deep = tmp_path / "deep"
    controlnet_twin(NETS["v1"], 2, control_layers_places=[0, 7]).save_pretrained(str(deep))
    lite = tmp_path / "lite.safetensors"
    save_file({k: v.contiguous() for k, v in controlnet_twin(NETS["v21"], 3).state_dict().items()}, str(lite))
    published = tmp_path / FILES["v1"]
    save_file({k: v.contiguous() for k, v in controlnet_twin(PUBLISHED["v1"], 4).state_dict().items()},
              str(published))
    flux = tmp_path / "flux_controlnet"
    flux.mkdir()
    (flux / "config.json").write_text(json.dumps({"_class_name": "FluxControlNetModel"}))
    run = dict(width=W, height=H, steps=1, max_sequence_length=SEQ, progress_bar=False)
    cases = [
        (lambda: mlxdiff.load(str(folder), controlnets=[str(wider)]), f"ControlNet {wider}: its dim is 64 but the "
         "model's is 48"),
        (lambda: mlxdiff.load(str(folder), controlnets=[str(tmp_path / "missing.safetensors")]), "not found"),
        (lambda: mlxdiff.load(str(folder), controlnets=[str(deep)]), "control_layers_places reach is 7 but the "
         "model's is 6"),
        (lambda: mlxdiff.load(str(folder), controlnets=[str(published)]), "control_layers_places reach is 25"),
        (lambda: mlxdiff.load(str(folder), controlnets=[str(lite)]), f"{lite}: Z-Image ControlNet file with 3 "
         "control layers"),
        (lambda: mlxdiff.load(str(folder), controlnets=[str(zcn[3] / "model" / "vae" /
                                                            "diffusion_pytorch_model.safetensors")]),
         "not a Z-Image ControlNet file"),
        (lambda: mlxdiff.load(str(folder), controlnets=[str(flux)]), "FluxControlNetModel.*not a Z-Image"),
        (lambda: mlxdiff.load(str(folder), controlnets=[str(nets["v1"])] * 2), "takes one"),
        (lambda: ours.generate(PROMPT, **run), "give one control image for each"),
        (lambda: ours.generate(PROMPT, control_images=[CONTROL], control_noise=[np.zeros((1, 4, 20, 24))], **run),
         "posterior's mean"),
        (lambda: ours.generate(PROMPT, control_images=[CONTROL], image=OTHER_CONTROL, **run), "no mask"),
        (lambda: ours.generate(PROMPT, control_images=[CONTROL], image=OTHER_CONTROL, mask=mask_picture(W, H),
                               strength=0.6, **run), "repaints from noise"),
        (lambda: mlxdiff.load(str(folder), controlnets=[str(nets["v1"])]).generate(
            PROMPT, control_images=[CONTROL], image=OTHER_CONTROL, mask=mask_picture(W, H), **run),
         "control_in_dim is 4, not 9"),
    ]
    for call, message in cases:
        with pytest.raises(MlxdiffError, match=message) as e:
            call()
        assert "\n" not in str(e.value), str(e.value)


def test_command_line_refuses_a_wider_controlnet(zcn, tmp_path, capsys):
    """--controlnet FILE --control-image FILE: a ControlNet file of another width is one line naming it, exit 2,
    before any weight is read."""
    from mlxdiff.generate import main
    wider = tmp_path / FILES["v21"]
    save_file({k: v.contiguous() for k, v in controlnet_twin(PUBLISHED["v21"], 5, dim=64, n_heads=4, n_kv_heads=4)
               .state_dict().items()}, str(wider))
    control = tmp_path / "control.png"
    CONTROL.save(control)
    assert main(["--model", str(zcn[0]), "--prompt", PROMPT, "--steps", "1", "--width", str(W), "--height", str(H),
                 "--output", str(tmp_path / "out.png"), "--no-progress", "--controlnet", f"{wider}:0.7",
                 "--control-image", str(control)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"ControlNet {wider}: its dim is 64 but the model's is 48" in err[0], err
    assert not (tmp_path / "out.png").exists()
