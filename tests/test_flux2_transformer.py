"""Parity of mlxdiff.models.flux2 with diffusers' Flux2Transformer2DModel: from a diffusers folder, and from a
single file in Black Forest Labs' original naming (with and without `model.diffusion_model.`)."""

import json

import numpy as np
import pytest

import mlxdiff  # noqa: F401  (OpenBLAS preload before mlx)
import mlx.core as mx

from helpers import load_ours, max_rel_err, saved_model_fixture
from mlxdiff.errors import MlxdiffError
from mlxdiff.formats.keymaps import remap
from mlxdiff.formats.safetensors import load_folder, load_safetensors
from mlxdiff.loading import sources
from mlxdiff.models import flux2
from twins import flux2_to_bfl
from flux2_helpers import CONFIGS, make_torch_model

GRID = {"dev": (3, 7), "klein": (5, 6)}        # latent grid (h, w) of the noise tokens
REF_GRID = {"dev": (2, 3), "klein": None}      # dev: a reference image appended, as in editing (ids t = 10)
TEXT_LEN = {"dev": 9, "klein": 7}


def make_inputs(name, seed=0):
    """Random latents/text and the position ids exactly as diffusers' Flux2Pipeline builds them."""
    import torch
    from diffusers import Flux2Pipeline
    cfg, (h, w), batch = CONFIGS[name], GRID[name], 2
    rng = np.random.default_rng(seed)
    img_ids = Flux2Pipeline._prepare_latent_ids(torch.zeros(batch, 1, h, w))   # (t=0, h, w, l=0)
    n_img = h * w
    if REF_GRID[name]:
        ref_ids = Flux2Pipeline._prepare_image_ids([torch.zeros(1, 1, *REF_GRID[name])])  # (t=10, h, w, 0)
        img_ids = torch.cat([img_ids, ref_ids.expand(batch, -1, -1)], dim=1)
        n_img += ref_ids.shape[1]
    text = rng.standard_normal((batch, TEXT_LEN[name], cfg["joint_attention_dim"])).astype(np.float32)
    txt_ids = Flux2Pipeline._prepare_text_ids(torch.from_numpy(text))           # (0, 0, 0, l)
    inputs = dict(hidden_states=rng.standard_normal((batch, n_img, cfg["in_channels"])).astype(np.float32),
                  encoder_hidden_states=text,
                  timestep=np.array([0.9731, 0.2125], dtype=np.float32),       # sigmas: the pipeline's t / 1000
                  img_ids=img_ids.numpy(), txt_ids=txt_ids.numpy())
    assert len(np.unique(inputs["img_ids"][0], axis=0)) == n_img                # every image token has its own id
    if cfg["guidance_embeds"]:
        inputs["guidance"] = np.array([4.0, 2.5], dtype=np.float32)
    return inputs


def torch_forward(model, inputs):
    import torch
    with torch.no_grad():
        out = model(**{k: torch.from_numpy(v) for k, v in inputs.items()}, return_dict=False)
    return out[0].float().numpy()


def mlx_forward(model, inputs):
    out = model(**{k: mx.array(v) for k, v in inputs.items()})
    return np.array(out.astype(mx.float32))


def out_channels(name):
    cfg = CONFIGS[name]
    return cfg["out_channels"] or cfg["in_channels"]


saved = saved_model_fixture(make_torch_model, CONFIGS, "flux2")   # (config name, torch model, its folder)


def test_folder_parity(saved):
    name, torch_model, folder = saved
    inputs = make_inputs(name)
    ours_model = load_ours(folder, flux2)
    ref = torch_forward(torch_model, inputs)
    ours = mlx_forward(ours_model, inputs)
    err = max_rel_err(ours, ref)
    print(f"{name}: max_rel_err {err:.2e}")
    assert ours.shape == (2, inputs["hidden_states"].shape[1], out_channels(name))
    assert err <= 1e-4
    # the conditioning inputs must matter, or the comparison above proves little about them
    moved = dict(inputs, timestep=inputs["timestep"][::-1].copy())
    assert max_rel_err(torch_forward(torch_model, moved), ref) > 1e-2
    if "guidance" in inputs:
        no_guidance = dict(inputs)
        del no_guidance["guidance"]  # diffusers then embeds the timestep alone
        ref_ng = torch_forward(torch_model, no_guidance)
        err_ng = max_rel_err(mlx_forward(ours_model, no_guidance), ref_ng)
        print(f"{name} without guidance: max_rel_err {err_ng:.2e}")
        assert err_ng <= 1e-4
        assert max_rel_err(ref_ng, ref) > 1e-2
    # text positions matter (10x the tolerance; the text axis is only 1/4 of each head)
    reversed_ids = dict(inputs, txt_ids=inputs["txt_ids"][:, ::-1].copy())
    assert max_rel_err(torch_forward(torch_model, reversed_ids), ref) > 1e-3


def test_position_ids_must_cover_the_tokens(saved):
    name, _, folder = saved
    inputs = make_inputs(name)
    inputs["img_ids"] = inputs["img_ids"][:, 1:]
    with pytest.raises(MlxdiffError, match="position ids"):
        mlx_forward(load_ours(folder, flux2), inputs)


def test_rope_tables_match_diffusers():
    """Unequal axes and two thetas, text positions up to 511 (float64 angles, as diffusers)."""
    import torch
    from diffusers.models.transformers.transformer_flux2 import Flux2PosEmbed
    rng = np.random.default_rng(3)
    ids = np.concatenate([np.stack([np.zeros(512), np.zeros(512), np.zeros(512), np.arange(512)], 1),
                          rng.integers(0, 130, size=(40, 4))]).astype(np.int64)
    for axes, theta in [((2, 6, 4, 8), 2000), ((32, 32, 32, 32), 2000), ((4, 10, 6, 12), 10000)]:
        ref_cos, ref_sin = Flux2PosEmbed(theta=theta, axes_dim=list(axes))(torch.from_numpy(ids))
        cos, sin = flux2.rope_tables(ids, axes, theta)
        assert np.abs(np.array(cos) - ref_cos.numpy()).max() <= 1e-6
        assert np.abs(np.array(sin) - ref_sin.numpy()).max() <= 1e-6


def test_rope_rotation_matches_diffusers():
    import torch
    from diffusers.models.embeddings import apply_rotary_emb
    rng = np.random.default_rng(4)
    x = rng.standard_normal((2, 11, 3, 20)).astype(np.float32)           # (B, S, H, hd), diffusers' layout
    ids = rng.integers(0, 50, size=(11, 4))
    cos, sin = flux2.rope_tables(ids, (2, 6, 4, 8), 2000)
    ref = apply_rotary_emb(torch.from_numpy(x), (torch.from_numpy(np.array(cos)), torch.from_numpy(np.array(sin))),
                           sequence_dim=1).numpy()
    ours = np.array(flux2.apply_rope(mx.array(x).transpose(0, 2, 1, 3), cos, sin).transpose(0, 2, 1, 3))
    assert max_rel_err(ours, ref) <= 1e-6


def test_time_scaling_and_bf16_rounding():
    """timestep and guidance are multiplied by 1000 inside the transformer, after a cast to the compute dtype: in
    bfloat16 diffusers embeds sigma 0.99731 as 996, guidance 2.5 as 2496 (flux2.md section 7). Ours does the same."""
    import torch
    values = np.concatenate([np.linspace(0.0, 1.0, 997), [0.99731, 0.8675, 0.13372, 2.5, 4.0, 3.5]]).astype(np.float32)
    for torch_dtype, mx_dtype in [(torch.bfloat16, mx.bfloat16), (torch.float32, mx.float32),
                                  (torch.float16, mx.float16)]:
        ref = (torch.from_numpy(values).to(torch_dtype) * 1000).float().numpy()
        ours = np.array(flux2.scaled_time(mx.array(values), mx_dtype).astype(mx.float32))
        np.testing.assert_array_equal(ours, ref)
    bf16 = np.array(flux2.scaled_time(mx.array(np.float32([0.99731, 2.5, 4.0])), mx.bfloat16).astype(mx.float32))
    assert bf16.tolist() == [996.0, 2496.0, 4000.0]


# -- BFL original naming ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def single_files(saved, tmp_path_factory):
    """The saved model's weights in BFL naming: a plain file (as BFL / GGUF) and a ComfyUI-style file with the
    `model.diffusion_model.` prefix plus a stray text-encoder key that the transformer loader must leave out."""
    import torch
    from safetensors.torch import save_file
    name, torch_model, folder = saved
    sd = {k: v.detach().clone().contiguous() for k, v in torch_model.state_dict().items()}
    original = flux2_to_bfl(sd, CONFIGS[name])
    assert sum(v.numel() for v in original.values()) == sum(v.numel() for v in sd.values())  # nothing dropped
    root = tmp_path_factory.mktemp(f"flux2_sf_{name}")
    plain, prefixed = root / "flux2_bfl.safetensors", root / "flux2_comfy.safetensors"
    save_file(original, str(plain))
    tensors = {"model.diffusion_model." + k: v for k, v in original.items()}
    tensors["text_encoders.qwen3.embed.weight"] = torch.zeros(3, 2)
    save_file(tensors, str(prefixed))
    return name, torch_model, folder, plain, prefixed


def test_inverse_naming_is_diffusers_own(single_files):
    """diffusers' converter reads the test-side BFL file back to the exact state dict (its converter does not strip
    the prefix, so it gets the plain file)."""
    import torch
    from diffusers import Flux2Transformer2DModel
    name, torch_model, folder, plain, _ = single_files
    ref_model = Flux2Transformer2DModel.from_single_file(str(plain), config=str(folder), local_files_only=True,
                                                         torch_dtype=torch.float32)
    expected, got = torch_model.state_dict(), ref_model.state_dict()
    assert expected.keys() == got.keys()
    for k in expected:
        assert torch.equal(expected[k], got[k]), k


@pytest.mark.parametrize("which", ["plain", "prefixed"])
def test_original_naming_parity(single_files, which):
    name, torch_model, folder, plain, prefixed = single_files
    path = plain if which == "plain" else prefixed
    weights = load_safetensors(path)

    config = flux2.config_from_original(weights)
    saved_config = json.loads((folder / "config.json").read_text())
    assert config.keys() == {k for k in saved_config if not k.startswith("_")}
    for key, value in config.items():
        assert saved_config[key] == value, key

    # the rule table alone maps every transformer key to the exact diffusers tensor (the stray key passes through)
    mapped = flux2.original_to_diffusers(weights)
    folder_weights = load_folder(folder)
    assert mapped.keys() == folder_weights.keys()
    for k in mapped:
        assert mx.array_equal(mapped[k], folder_weights[k]).item(), k
    by_table = remap(weights, flux2.ORIGINAL_KEYMAP)
    assert by_table.keys() - mapped.keys() == ({"text_encoders.qwen3.embed.weight"} if which == "prefixed" else set())

    # the pipeline's path: a spec from the file alone (config from the shapes), built and run
    spec = sources.transformer_from_file(path, flux2)
    assert spec.config == config
    inputs = make_inputs(name, seed=1)
    ref = torch_forward(torch_model, inputs)
    err = max_rel_err(mlx_forward(spec.build(), inputs), ref)
    print(f"{name} BFL names ({which}): max_rel_err {err:.2e}")
    assert err <= 1e-4


def test_diffusers_named_file_needs_config(saved):
    _, _, folder = saved
    file = next(folder.glob("*.safetensors"))
    with pytest.raises(MlxdiffError, match="config"):
        sources.transformer_from_file(file, flux2)
    spec = sources.transformer_from_file(file, flux2, base_config=json.loads((folder / "config.json").read_text()))
    assert spec.keymap is None and spec.prefix == ""


REAL_CONFIGS = {  # scripts/convert_flux2_to_diffusers.py get_flux2_transformer_config; parameter counts: flux2.md 6
    "dev": (dict(), 32_223_281_152),
    "klein-4b": (dict(num_layers=5, num_single_layers=20, num_attention_heads=24, joint_attention_dim=7680,
                      guidance_embeds=False), 3_875_544_576),
    "klein-9b": (dict(num_layers=8, num_single_layers=24, num_attention_heads=32, joint_attention_dim=12288,
                      guidance_embeds=False), 9_078_581_248),
}


@pytest.mark.parametrize("variant", list(REAL_CONFIGS))
def test_real_configs_from_shapes(variant):
    """Shapes only (diffusers' model on the meta device, our arrays lazy and never evaluated): the BFL layouts of
    dev / klein 4B / klein 9B give back their configs, and our module has the published parameter count."""
    import torch
    from diffusers import Flux2Transformer2DModel
    from mlx.utils import tree_flatten
    overrides, params = REAL_CONFIGS[variant]
    with torch.device("meta"):
        ref = Flux2Transformer2DModel(**overrides)
    config = {k: v for k, v in ref.config.items() if not k.startswith("_")}
    original = flux2_to_bfl(ref.state_dict(), config)
    shapes = {"model.diffusion_model." + k: mx.zeros(tuple(v.shape), dtype=mx.bfloat16) for k, v in original.items()}
    got = flux2.config_from_original(shapes)
    assert got == {k: (list(v) if isinstance(v, tuple) else v) for k, v in config.items()}
    model = flux2.Model(flux2.ModelArgs.from_dict(got))
    assert sum(v.size for _, v in tree_flatten(model.parameters())) == params
    if variant == "dev":
        assert vars(flux2.ModelArgs.from_dict(got)) == vars(flux2.ModelArgs())  # the defaults are FLUX.2-dev


def test_bf16_weights_stay_bf16_and_compute_in_float32(saved, tmp_path):
    """dtype policy: bf16 weights are kept as stored; the arithmetic is float32. The reference is diffusers with the
    same bf16-rounded weights, run in float32."""
    import torch
    from mlx.utils import tree_flatten
    name, _, _ = saved
    bf16_model = make_torch_model(name, seed=len(name), dtype=torch.bfloat16)
    bf16_model.save_pretrained(str(tmp_path))
    ours = load_ours(tmp_path, flux2)
    assert {v.dtype for _, v in tree_flatten(ours.parameters())} == {mx.bfloat16}
    inputs = make_inputs(name, seed=2)
    out = ours(**{k: mx.array(v) for k, v in inputs.items()})
    assert out.dtype == mx.float32
    err = max_rel_err(np.array(out), torch_forward(bf16_model.float(), inputs))
    print(f"{name} bf16 weights, float32 compute: max_rel_err {err:.2e}")
    assert err <= 1e-4


def test_compiled_blocks_match_diffusers(saved):
    """Each double and single block compiled whole (models/fused.compiled_block), its outputs paced as the
    pipelines pace them: the same numbers as diffusers, as the eager blocks give."""
    from mlxdiff.pipelines.base import evaluate_each_block
    from mlxdiff.policy import RunPolicy, installed
    name, torch_model, folder = saved
    inputs = make_inputs(name)
    ref = torch_forward(torch_model, inputs)
    model = load_ours(folder, flux2)
    with installed(RunPolicy(compile_blocks=True)):
        out = model(**{k: mx.array(v) for k, v in inputs.items()}, after_block=evaluate_each_block)
        ours = np.array(out.astype(mx.float32))
        blocks = list(model.transformer_blocks) + list(model.single_transformer_blocks)
        assert all(b.__dict__.get("_compiled") for b in blocks)   # really compiled
    err = max_rel_err(ours, ref)
    print(f"{name} compiled blocks: max_rel_err {err:.2e}")
    assert err <= 1e-4
