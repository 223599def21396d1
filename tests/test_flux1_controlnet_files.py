"""FLUX.1 ControlNets from the single files people have, and the command line's --control-mode, on a tiny FLUX.1 dev
twin of FLUX.1's own shape where it matters here (a VAE of factor 8 and 16 latent channels, a transformer taking the
64 packed channels: XLabs' hint block needs both):

- InstantX's / Shakker-Labs' diffusion_pytorch_model.safetensors alone (diffusers names, no config.json): a tiny
  random Union FluxControlNetModel's save_pretrained, its file read without the config, gives the same config and
  weights as its folder and diffusers' residuals, and through load(controlnets=[file]) + generate(control_modes=)
  FluxControlNetPipeline's latents (<= 1e-4) and image (<= 2 levels) from the same injected noise, the Union mode
  moving diffusers' result.
- XLabs' x-flux file (x-flux's own names, no config.json): its residuals against mlxdiff/reference/controlnet_xlabs.py
  (x-flux's ControlNetFlux: diffusers' FluxControlNetModel with x-flux's input_hint_block Sequential and
  pos_embed_input, its BFL-named parts by diffusers' own converter) <= 1e-4, and in a run against
  FluxControlNetPipeline with that reference (the pixels through the hint block, residuals repeated over the double
  blocks), the control image moving diffusers' result.
- --control-mode NAME_OR_INT: the CLI run in-process with `--control-mode depth` gives the API's image with
  control_modes=[2] (and not mode 1's); an unknown name, a mode for a plain ControlNet, a count that does not match:
  one line, exit 2 (a mode out of range or none for a Union ControlNet: generate()'s one line). A truncated file,
  another model's file, a MistoLine file, a file with a block missing or heads no RoPE split fits: one line.
"""

import shutil
from types import SimpleNamespace

import numpy as np
import PIL.Image
import pytest
import torch
from safetensors.torch import save_file

import fixture_guard
import mlxdiff
from flux1_helpers import diffusers_converter, flux1_components, reference_run
from controlnet_helpers import one_torch_thread  # noqa: F401  (autouse: this module's torch on one thread)
from helpers import max_rel_err, randomize_
from mlxdiff.errors import MlxdiffError
from mlxdiff.pipelines.controls import controlnet_folder
from mlxdiff.pipelines.flux1.folder import controlnet_file, read_controlnets
from mlxdiff.reference.controlnet_xlabs import xflux_controlnet, xflux_shapes
from parity import IMAGE_LEVELS, LATENT_TOL, assert_inputs_matter, levels, rel_diff
from twins import picture

PROMPT = "a lighthouse at dusk"
STEPS = 2
H, W, LATENT = 64, 48, 16       # a VAE of factor 8 with 16 latent channels: 8 x 6 latents, 4 x 3 packed tokens of 64
CONTROL, OTHER_CONTROL = picture(W, H, seed=71), picture(W, H, seed=72)
# the transformer's width (4 heads of 12, RoPE axes 2, 4, 6), prompt (44) and pooled (36) widths and packed channels
# (64); the Union ControlNet: 2 double and 1 single block, 4 modes
TRANSFORMER = dict(patch_size=1, in_channels=4 * LATENT, num_layers=2, num_single_layers=2, attention_head_dim=12,
                   num_attention_heads=4, joint_attention_dim=44, pooled_projection_dim=36, guidance_embeds=True,
                   axes_dims_rope=(2, 4, 6))
UNION = dict(TRANSFORMER, num_single_layers=1, num_mode=4)
PLAIN = dict(TRANSFORMER, num_layers=1, num_single_layers=1)
# x-flux's ControlNetFlux at the tiny width: 2 double blocks, its 16 hint channels x 2 x 2 = the 64 packed channels
XLABS = dict(TRANSFORMER, patch_size=2, num_single_layers=0, conditioning_embedding_channels=16)
AXES = SimpleNamespace(args=SimpleNamespace(axes_dims_rope=TRANSFORMER["axes_dims_rope"]))   # the model's transformer


def pipeline_components():
    """flux1_helpers' tiny FLUX.1 dev encoders and scheduler with a 64-channel transformer and a factor-8 VAE."""
    from diffusers import AutoencoderKL, FluxTransformer2DModel
    components = flux1_components("dev", seed=5)
    torch.manual_seed(0)
    components["transformer"] = randomize_(FluxTransformer2DModel(**TRANSFORMER), seed=91, scale=0.15).eval()
    components["vae"] = randomize_(AutoencoderKL(
        in_channels=3, out_channels=3, block_out_channels=(8, 12, 20, 24), layers_per_block=1,
        latent_channels=LATENT, norm_num_groups=4, down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4, scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False,
        use_post_quant_conv=False), seed=92, scale=0.15).eval()
    return components


def xflux_state_dict(head_dim, seed):
    """x-flux's ControlNetFlux tensors at the tiny width (48) with heads of `head_dim`, seeded noise (norm scales
    about 1)."""
    g = torch.Generator().manual_seed(seed)
    shapes = xflux_shapes(48, head_dim, 4 * LATENT, 44, 36)
    return {name: torch.randn(shape, generator=g) * 0.15 + (1.0 if name.endswith(".scale") else 0.0)
            for name, shape in shapes.items()}


@pytest.fixture(autouse=True)
def _shared_fixtures_unchanged(request):
    yield from fixture_guard.unchanged(request, ["files"])


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The tiny FLUX.1 dev folder (and diffusers' pipeline it was saved from), the Union ControlNet as a folder, as
    its file alone and as a folder holding only that file, a plain one's folder, the XLabs file, its state dict and its
    reference model."""
    from diffusers import FluxControlNetModel, FluxPipeline
    root = tmp_path_factory.mktemp("flux1_controlnet_files")
    reference = FluxPipeline(**pipeline_components())
    reference.save_pretrained(str(root / "model"))
    torch.manual_seed(0)
    union = randomize_(FluxControlNetModel(**UNION), seed=81, scale=0.15).eval()
    union.save_pretrained(str(root / "union"))
    weights = root / "union" / "diffusion_pytorch_model.safetensors"
    shutil.copy(weights, root / "FLUX.1-dev-Controlnet-Union.safetensors")
    (root / "union_weights_only").mkdir()
    shutil.copy(weights, root / "union_weights_only" / weights.name)
    randomize_(FluxControlNetModel(**PLAIN), seed=82, scale=0.15).save_pretrained(str(root / "plain"))
    xlabs = xflux_state_dict(12, seed=83)
    save_file(xlabs, str(root / "flux-canny-controlnet-v3.safetensors"))
    return SimpleNamespace(root=root, model=root / "model", union_net=union, union=root / "union",
                           union_file=root / "FLUX.1-dev-Controlnet-Union.safetensors",
                           weights_only=root / "union_weights_only", plain=root / "plain",
                           xlabs_file=root / "flux-canny-controlnet-v3.safetensors", xlabs=xlabs,
                           xlabs_net=xflux_controlnet(xlabs, XLABS, diffusers_converter(48)), reference=reference)


@pytest.fixture(scope="module")
def ours(files):
    """mlxdiff.load with the Union ControlNet given as its file alone, kept loaded."""
    return mlxdiff.load(str(files.model), controlnets=[(str(files.union_file), 0.9)], dtype="float32", keep="all")


def forwards(ours_net, ref_net, cond, mode=None, seed=1):
    """Both residual lists of our ControlNet and the reference's on the same inputs (3 x 4 tokens, 6 text tokens)."""
    import mlx.core as mx
    from diffusers import FluxPipeline
    rng = np.random.default_rng(seed)
    h, w, channels = 3, 4, ref_net.config.in_channels
    x = rng.standard_normal((2, h * w, channels)).astype(np.float32)
    context = rng.standard_normal((2, 6, 44)).astype(np.float32)
    pooled = rng.standard_normal((2, 36)).astype(np.float32)
    t, guidance = np.array([0.83, 0.29], np.float32), np.array([3.5, 2.0], np.float32)
    img_ids = FluxPipeline._prepare_latent_image_ids(1, h, w, "cpu", torch.float32).numpy()
    txt_ids = np.zeros((6, 3), np.float32)
    with torch.no_grad():
        ref = ref_net(torch.tensor(x), torch.tensor(cond), None if mode is None else torch.tensor(mode)[:, None], 0.8,
                      torch.tensor(context), torch.tensor(pooled), torch.tensor(t), torch.tensor(img_ids),
                      torch.tensor(txt_ids), torch.tensor(guidance), return_dict=False)
    got = ours_net(mx.array(x), mx.array(cond), 0.8, mx.array(context), mx.array(pooled), mx.array(t), img_ids,
                   txt_ids, mx.array(guidance), None if mode is None else mx.array(mode))
    ref = [[b.numpy() for b in side] if side is not None else [] for side in ref]
    got = [[np.array(a) for a in side] if side is not None else [] for side in got]
    return got, ref


def test_union_file_alone_is_its_folder(files):
    """The file without config.json (given as a file, or as a folder holding only it) reads to the folder's config
    and weights, and its residuals match diffusers' FluxControlNetModel (the Union mode token included)."""
    from mlx.utils import tree_flatten
    components = {"transformer": AXES}
    folder = controlnet_folder(files.union, "controlnet", "FluxControlNetModel", "a FLUX.1")
    specs = [controlnet_folder(path, "controlnet", "FluxControlNetModel", "a FLUX.1",
                               lambda p: controlnet_file(p, components))
             for path in (files.union_file, files.weights_only)]
    ours = folder.build()
    expected = dict(tree_flatten(ours.parameters()))
    for spec in specs:
        assert spec.args == folder.args, (spec.config, folder.config)
        got = dict(tree_flatten(spec.build().parameters()))
        assert got.keys() == expected.keys()
        assert all(np.array_equal(np.array(got[k]), np.array(expected[k])) for k in expected)
    cond = np.random.default_rng(2).standard_normal((2, 12, 4 * LATENT)).astype(np.float32)
    got, ref = forwards(specs[0].build(), files.union_net, cond, mode=np.array([3, 1]))
    assert [len(s) for s in got] == [len(s) for s in ref] == [2, 1]
    errors = [max_rel_err(a, b) for g, r in zip(got, ref) for a, b in zip(g, r)]
    print(f"flux1 Union ControlNet file: residuals max_rel_err {max(errors):.1e}")
    assert max(errors) <= LATENT_TOL


def packed_noise(seed):
    return np.random.default_rng(seed).standard_normal((1, (H // 16) * (W // 16), 4 * LATENT)).astype(np.float32)


def diffusers_run(files, net, seed, **kw):
    """FluxControlNetPipeline with `net` on the tiny model: run(**kw) -> (final latents, image) from packed noise."""
    from diffusers import FluxControlNetPipeline
    pipe = FluxControlNetPipeline(**files.reference.components, controlnet=net)
    pipe.set_progress_bar_config(disable=True)
    x = packed_noise(seed)
    return x, lambda **more: reference_run(pipe, x, generator_seed=seed, height=H, width=W, num_inference_steps=STEPS,
                                           guidance_scale=3.5, max_sequence_length=32, **kw, **more)


def assert_matches(what, got, ref_latents, ref_image):
    err, shift = max_rel_err(got.latents, ref_latents), levels(got.image, ref_image)
    print(f"{what}: latents max_rel_err {err:.1e}, image {shift} levels")
    assert err <= LATENT_TOL and shift <= IMAGE_LEVELS, (what, err, shift)


def test_union_file_in_a_run_matches_diffusers(files, ours):
    """load(controlnets=[file]) + generate(control_modes=) against FluxControlNetPipeline with the folder's model,
    from the same injected noise (the control image's posterior noise given as control_noise); the mode moves
    diffusers' result."""
    x, run = diffusers_run(files, files.union_net, 6, controlnet_conditioning_scale=0.9)
    ref_latents, ref_image = assert_inputs_matter(run, dict(prompt=PROMPT, control_image=CONTROL, control_mode=2),
                                                  {"the Union mode": {"control_mode": 1}})
    noise = torch.randn((1, LATENT, H // 8, W // 8), generator=torch.Generator().manual_seed(6)).numpy()
    got = ours.generate(PROMPT, control_images=[CONTROL], control_modes=[2], width=W, height=H, steps=STEPS,
                        guidance=3.5, latents=x, control_noise=[noise], max_sequence_length=32, progress_bar=False)
    assert_matches("flux1 Union ControlNet file in a run", got, ref_latents, ref_image)


def test_xlabs_file_matches_xflux(files):
    """XLabs' file read by its names and shapes matches x-flux's ControlNetFlux (the reference), residuals <= 1e-4;
    the control image (pixels through the hint block) moves the reference's."""
    spec = controlnet_file(files.xlabs_file, {"transformer": AXES})
    assert spec.args.conditioning_embedding_channels == 16 and spec.args.patch_size == 2
    assert (spec.args.num_layers, spec.args.num_single_layers, spec.args.num_mode) == (2, 0, None)
    rng = np.random.default_rng(3)
    cond, other = (rng.uniform(-1, 1, (2, 3, 48, 64)).astype(np.float32) for _ in range(2))
    got, ref = forwards(spec.build(), files.xlabs_net, cond)
    _, moved = forwards(spec.build(), files.xlabs_net, other)
    assert [len(s) for s in got] == [len(s) for s in ref] == [2, 0]
    assert rel_diff(moved[0][1], ref[0][1]) > LATENT_TOL
    errors = [max_rel_err(a, b) for a, b in zip(got[0], ref[0])]
    print(f"flux1 XLabs ControlNet file: residuals max_rel_err {max(errors):.1e}")
    assert max(errors) <= LATENT_TOL


def test_xlabs_file_in_a_run_matches_diffusers(files):
    """load(controlnets=[XLabs file]) + generate against FluxControlNetPipeline with x-flux's ControlNetFlux (the
    reference): the control image's pixels through the hint block, the residuals repeated over the transformer's
    double blocks; the control image moves diffusers' result."""
    _, run = diffusers_run(files, files.xlabs_net, 7, controlnet_conditioning_scale=0.8)
    ref_latents, ref_image = assert_inputs_matter(run, dict(prompt=PROMPT, control_image=CONTROL),
                                                  {"the control image": {"control_image": OTHER_CONTROL}})
    ours = mlxdiff.load(str(files.model), controlnets=[(str(files.xlabs_file), 0.8)], dtype="float32", keep="all")
    got = ours.generate(PROMPT, control_images=[CONTROL], width=W, height=H, steps=STEPS, guidance=3.5,
                        latents=packed_noise(7), max_sequence_length=32, progress_bar=False)
    assert_matches("flux1 XLabs ControlNet file in a run", got, ref_latents, ref_image)


def cli(files, tmp_path, capsys, *extra, controlnet=None):
    """The command line in-process on the tiny model with one ControlNet (the Union file at load's scale; --keep all:
    no collection after each phase in this process full of torch objects): (exit code, stderr lines, the image
    written)."""
    from mlxdiff.generate import main
    control = tmp_path / "control.png"
    CONTROL.save(control)
    out = tmp_path / "out.png"
    capsys.readouterr()
    code = main(["--model", str(files.model), "--prompt", PROMPT, "--steps", "1", "--width", str(W),
                 "--height", str(H), "--seed", "7", "--output", str(out), "--no-progress", "--dtype", "float32",
                 "--keep", "all", "--controlnet", f"{controlnet or files.union_file}:0.9", "--control-image",
                 str(control), *extra])
    err = capsys.readouterr().err.strip().splitlines()
    return code, err, (np.asarray(PIL.Image.open(out).convert("RGB")) if code == 0 else None)


def test_control_mode_flag(files, ours, tmp_path, capsys):
    """--control-mode depth on the command line is generate(control_modes=[2]) (the same image from the same seed,
    not mode 1's); its refusals are one line, exit 2 (a mode the ControlNet has not, or none for a Union one:
    generate()'s refusals, the same rule)."""
    code, err, image = cli(files, tmp_path, capsys, "--control-mode", "depth")
    assert code == 0, err
    pipe = ours
    run = dict(control_images=[CONTROL], width=W, height=H, steps=1, seed=7, progress_bar=False)
    depth, tile = (np.asarray(pipe.generate(PROMPT, control_modes=[m], **run).image) for m in (2, 1))
    assert levels(image, depth) == 0 and levels(tile, depth) > 0      # the same code: exactly mode 2's image
    for extra, message, controlnet in (
            (["--control-mode", "sketch"], "not a Union ControlNet mode", None),
            (["--control-mode", "depth", "--control-mode", "tile"], "--control-mode 2", None),
            (["--control-mode", "canny"], "no Union ControlNet", files.plain)):
        code, err, _ = cli(files, tmp_path, capsys, *extra, controlnet=controlnet)
        assert code == 2 and len(err) == 1 and message in err[0], (extra, err)
    for modes, message in ((None, "needs the mode of its image"), ([7], "from 0 to 3")):
        with pytest.raises(MlxdiffError, match=message) as e:
            pipe.generate(PROMPT, control_modes=modes, **run)
        assert "--control-mode" in str(e.value) and "\n" not in str(e.value)


def test_bad_controlnet_files_are_one_line(files, ours, tmp_path):
    """A truncated file, another model's file, a MistoLine file, an XLabs file with a block missing, one whose heads
    no RoPE split known fits (the axes are in no tensor): one line each, from load(controlnets=)'s step once the
    model is read."""
    data = files.union_file.read_bytes()
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(data[: len(data) // 2])
    foreign = tmp_path / "foreign.safetensors"
    save_file({"conv_in.weight": torch.zeros(4, 3, 3, 3)}, str(foreign))
    mistoline = tmp_path / "mistoline.safetensors"
    save_file({"controlnet_blocks.0.linear.weight": torch.zeros(4, 4)}, str(mistoline))
    gappy = tmp_path / "gappy.safetensors"
    save_file({k: v for k, v in files.xlabs.items() if not k.startswith("double_blocks.0.")}, str(gappy))
    wide_heads = tmp_path / "wide_heads.safetensors"
    save_file(xflux_state_dict(16, seed=84), str(wide_heads))
    for path, message in ((truncated, "truncated"), (foreign, "not a FLUX.1 ControlNet file"),
                          (mistoline, "MistoLine"), (gappy, "not 0..n-1"),
                          (wide_heads, "heads are 16 wide, which neither the model's RoPE axes")):
        found = SimpleNamespace(components={n: s for n, s in ours.components.items() if n != "controlnet"},
                                options={}, pipeline_class="FluxPipeline")
        with pytest.raises(MlxdiffError, match=message) as e:
            read_controlnets(found, [(str(path), 1.0)])
        assert "\n" not in str(e.value), str(e.value)
