"""Parity of mlxdiff.models.flux1 with diffusers' FluxTransformer2DModel: from a diffusers folder, and from a single
file in Black Forest Labs' original naming (with and without `model.diffusion_model.`)."""

import json

import pytest

import mlxdiff  # noqa: F401  (OpenBLAS preload before mlx)
import mlx.core as mx

from helpers import load_ours, max_rel_err, saved_model_fixture
from mlxdiff.errors import MlxdiffError
from mlxdiff.formats.safetensors import load_folder, load_safetensors
from mlxdiff.loading import sources
from mlxdiff.models import flux1, flux2
from twins import flux1_to_bfl
from flux1_helpers import CONFIGS, diffusers_converter, make_inputs, make_torch_model, mlx_forward, torch_forward


saved = saved_model_fixture(make_torch_model, CONFIGS, "flux1")   # (config name, torch model, its folder)


def test_folder_parity(saved):
    name, torch_model, folder = saved
    inputs = make_inputs(name)
    ours_model = load_ours(folder, flux1)
    ref = torch_forward(torch_model, inputs)
    ours = mlx_forward(ours_model, inputs)
    err = max_rel_err(ours, ref)
    print(f"{name}: max_rel_err {err:.2e}")
    cfg = CONFIGS[name]
    assert ours.shape == (2, inputs["hidden_states"].shape[1], cfg["out_channels"] or cfg["in_channels"])
    assert err <= 1e-4
    # every conditioning input must matter, or the comparison above proves little about it
    for key, moved in (("timestep", inputs["timestep"][::-1]), ("pooled_projections", inputs["pooled_projections"][::-1]),
                       ("img_ids", inputs["img_ids"][::-1])):
        changed = dict(inputs, **{key: moved.copy()})
        assert max_rel_err(torch_forward(torch_model, changed), ref) > 1e-3, key
        assert max_rel_err(mlx_forward(ours_model, changed), torch_forward(torch_model, changed)) <= 1e-4, key
    if "guidance" in inputs:
        moved = dict(inputs, guidance=inputs["guidance"][::-1].copy())
        ref_moved = torch_forward(torch_model, moved)
        assert max_rel_err(ref_moved, ref) > 1e-3
        assert max_rel_err(mlx_forward(ours_model, moved), ref_moved) <= 1e-4


def test_position_ids_must_cover_the_tokens(saved):
    name, _, folder = saved
    inputs = make_inputs(name)
    inputs["txt_ids"] = inputs["txt_ids"][:-1]
    with pytest.raises(MlxdiffError, match="position ids cover"):
        mlx_forward(load_ours(folder, flux1), inputs)


# -- BFL original naming ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def single_files(tmp_path_factory):
    """The dev config's weights in BFL naming: a plain file (as BFL / GGUF) and a ComfyUI-style file with the
    `model.diffusion_model.` prefix plus a stray text-encoder key that the transformer loader must leave out."""
    import torch
    from safetensors.torch import save_file
    name = "dev"
    torch_model = make_torch_model(name, seed=3)
    folder = tmp_path_factory.mktemp("flux1_sf_folder")
    torch_model.save_pretrained(str(folder))
    sd = {k: v.detach().clone().contiguous() for k, v in torch_model.state_dict().items()}
    original = flux1_to_bfl(sd, CONFIGS[name])
    assert sum(v.numel() for v in original.values()) == sum(v.numel() for v in sd.values())  # nothing dropped
    root = tmp_path_factory.mktemp("flux1_sf")
    plain, prefixed = root / "flux1-dev.safetensors", root / "flux1-dev-comfy.safetensors"
    save_file(original, str(plain))
    tensors = {"model.diffusion_model." + k: v for k, v in original.items()}
    tensors["text_encoders.clip_l.transformer.text_model.final_layer_norm.weight"] = torch.zeros(3)
    save_file(tensors, str(prefixed))
    return name, torch_model, folder, plain, prefixed, original


def test_inverse_naming_is_diffusers_own(single_files):
    """diffusers' converter reads the test-side BFL names back to the exact state dict."""
    import torch
    name, torch_model, _, _, _, original = single_files
    cfg = CONFIGS[name]
    convert = diffusers_converter(cfg["num_attention_heads"] * cfg["attention_head_dim"])
    got = convert(dict(original))
    expected = torch_model.state_dict()
    assert expected.keys() == got.keys()
    for k in expected:
        assert torch.equal(expected[k], got[k]), k


@pytest.mark.parametrize("which", ["plain", "prefixed"])
def test_original_naming_parity(single_files, which):
    name, torch_model, folder, plain, prefixed, _ = single_files
    path = plain if which == "plain" else prefixed
    weights = load_safetensors(path)
    config = flux1.config_from_original(weights)
    saved_config = json.loads((folder / "config.json").read_text())
    assert config.keys() == {k for k in saved_config if not k.startswith("_")}
    for key, value in config.items():
        assert saved_config[key] == (list(value) if isinstance(value, tuple) else value), key
    mapped = {k: v for k, v in flux1.original_to_diffusers(weights).items() if not k.startswith("text_encoders.")}
    folder_weights = load_folder(folder)
    assert mapped.keys() == folder_weights.keys()
    for k in mapped:
        assert mx.array_equal(mapped[k], folder_weights[k]).item(), k
    # the pipeline's path: a spec from the file alone (config from the shapes), built and run
    spec = sources.transformer_from_file(path, flux1)
    assert spec.config == config
    inputs = make_inputs(name, seed=1)
    err = max_rel_err(mlx_forward(spec.build(), inputs), torch_forward(torch_model, inputs))
    print(f"{name} BFL names ({which}): max_rel_err {err:.2e}")
    assert err <= 1e-4


def test_flux1_and_flux2_files_are_told_apart(single_files):
    """A FLUX.1 file is not FLUX.2's and the reverse: each architecture's reader refuses the other's in one line."""
    _, _, _, plain, _, original = single_files
    names = list(original)
    assert flux1.is_original(names)
    with pytest.raises(MlxdiffError, match="a FLUX.1 transformer"):
        flux2.config_from_original(load_safetensors(plain))
    flux2_names = ["double_blocks.0.img_attn.qkv.weight", "single_blocks.0.linear1.weight", "img_in.weight",
                   "double_stream_modulation_img.lin.weight"]
    assert flux2.is_original(flux2_names) and not flux1.is_original(flux2_names)


def test_diffusers_named_file_needs_config(saved):
    _, _, folder = saved
    file = next(folder.glob("*.safetensors"))
    with pytest.raises(MlxdiffError, match="config"):
        sources.transformer_from_file(file, flux1)
    spec = sources.transformer_from_file(file, flux1, base_config=json.loads((folder / "config.json").read_text()))
    assert spec.keymap is None and spec.prefix == ""
