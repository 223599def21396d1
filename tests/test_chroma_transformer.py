"""Parity of mlxdiff.models.chroma with diffusers' ChromaTransformer2DModel (with its text mask), from a diffusers
folder and from a file in lodestones' original naming (with and without `model.diffusion_model.`)."""

import json

import numpy as np
import pytest

import mlxdiff  # noqa: F401  (OpenBLAS preload before mlx)
import mlx.core as mx

from helpers import load_ours, max_rel_err, randomize_
from mlxdiff.errors import MlxdiffError
from mlxdiff.formats.safetensors import load_folder, load_safetensors
from mlxdiff.loading import sources
from mlxdiff.models import chroma, flux1, flux2
from twins import chroma_to_original
from chroma_helpers import diffusers_converter

# every dimension differs from the others (heads, head dim, D, 4D, in, out, joint, approximator width and input,
# text length, image tokens); RoPE axes unequal as Chroma's (16, 56, 56); head_dim / 8 first, as the shapes say
CONFIG = dict(patch_size=1, in_channels=20, out_channels=None, num_layers=2, num_single_layers=3,
              attention_head_dim=32, num_attention_heads=3, joint_attention_dim=28, axes_dims_rope=(4, 14, 14),
              approximator_num_channels=16, approximator_hidden_dim=44, approximator_layers=2)
GRID, TEXT_LEN, PROMPT_LEN = (3, 7), 9, (4, 6)     # batch row b: PROMPT_LEN[b] tokens, then padding


def make_torch_model(seed=5):
    import torch
    from diffusers import ChromaTransformer2DModel
    torch.manual_seed(seed)
    return randomize_(ChromaTransformer2DModel(**CONFIG), seed=seed).eval()


def text_mask():
    """ChromaPipeline's mask: the prompt's tokens and its first padding token."""
    return np.stack([(np.arange(TEXT_LEN) <= n).astype(np.float32) for n in PROMPT_LEN])


def make_inputs(seed=0):
    import torch
    from diffusers import FluxPipeline
    rng = np.random.default_rng(seed)
    h, w = GRID
    img_ids = FluxPipeline._prepare_latent_image_ids(2, h, w, "cpu", torch.float32).numpy()   # (0, row, col)
    return dict(hidden_states=rng.standard_normal((2, h * w, CONFIG["in_channels"])).astype(np.float32),
                encoder_hidden_states=rng.standard_normal((2, TEXT_LEN, CONFIG["joint_attention_dim"])).astype(
                    np.float32),
                timestep=np.array([0.9731, 0.2125], dtype=np.float32),
                img_ids=img_ids, txt_ids=np.zeros((TEXT_LEN, 3), dtype=np.float32))


def torch_forward(model, inputs, mask=None):
    """diffusers' forward; the mask boolean over [text; image], as the pipeline's _prepare_attention_mask extends it
    (a float mask would be added to the scores: diffusers #11724)."""
    import torch
    kwargs = {k: torch.from_numpy(v) for k, v in inputs.items()}
    if mask is not None:
        full = np.concatenate([mask, np.ones((2, inputs["hidden_states"].shape[1]), np.float32)], axis=1)
        kwargs["attention_mask"] = torch.from_numpy(full > 0)
    with torch.no_grad():
        return model(**kwargs, return_dict=False)[0].float().numpy()


def mlx_forward(model, inputs, mask=None):
    kwargs = {k: mx.array(v) for k, v in inputs.items()}
    return np.array(model(**kwargs, text_mask=None if mask is None else mx.array(mask)).astype(mx.float32))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    model = make_torch_model()
    folder = tmp_path_factory.mktemp("chroma")
    model.save_pretrained(str(folder))
    return model, folder


def test_folder_parity_with_and_without_the_text_mask(saved):
    torch_model, folder = saved
    ours = load_ours(folder, chroma)
    inputs, mask = make_inputs(), text_mask()
    for m in (mask, None):
        ref = torch_forward(torch_model, inputs, m)
        err = max_rel_err(mlx_forward(ours, inputs, m), ref)
        print(f"Chroma transformer, mask {'on' if m is not None else 'off'}: max_rel_err {err:.2e}")
        assert err <= 1e-4
    # the mask, the timestep and the text each change the output, so the comparison above sees them
    ref = torch_forward(torch_model, inputs, mask)
    assert max_rel_err(torch_forward(torch_model, inputs, None), ref) > 1e-3
    for key in ("timestep", "encoder_hidden_states"):
        moved = dict(inputs, **{key: inputs[key][::-1].copy()})
        assert max_rel_err(torch_forward(torch_model, moved, mask[::-1].copy()), ref) > 1e-3, key
        assert max_rel_err(mlx_forward(ours, moved, mask[::-1].copy()),
                           torch_forward(torch_model, moved, mask[::-1].copy())) <= 1e-4, key


@pytest.fixture(scope="module")
def original_files(saved, tmp_path_factory):
    from safetensors.torch import save_file
    torch_model, _ = saved
    sd = {k: v.detach().clone().contiguous() for k, v in torch_model.state_dict().items()}
    original = chroma_to_original(sd, CONFIG)
    assert sum(v.numel() for v in original.values()) == sum(v.numel() for v in sd.values())   # nothing dropped
    root = tmp_path_factory.mktemp("chroma_files")
    plain, prefixed = root / "chroma-unlocked-v48.safetensors", root / "chroma-comfy.safetensors"
    save_file(original, str(plain))
    save_file({"model.diffusion_model." + k: v for k, v in original.items()}, str(prefixed))
    return original, plain, prefixed


def test_original_names_are_diffusers_own(saved, original_files):
    import torch
    torch_model, _ = saved
    original, _, _ = original_files
    got = diffusers_converter(CONFIG["num_attention_heads"] * CONFIG["attention_head_dim"])(dict(original))
    expected = torch_model.state_dict()
    assert expected.keys() == got.keys()
    for k in expected:
        assert torch.equal(expected[k], got[k]), k


@pytest.mark.parametrize("which", [1, 2])
def test_original_naming_parity(saved, original_files, which):
    torch_model, folder = saved
    path = original_files[which]
    weights = load_safetensors(path)
    config = chroma.config_from_original(weights)
    saved_config = json.loads((folder / "config.json").read_text())
    assert config.keys() == {k for k in saved_config if not k.startswith("_")}
    for key, value in config.items():
        assert saved_config[key] == (list(value) if isinstance(value, tuple) else value), key
    mapped, folder_weights = chroma.original_to_diffusers(weights), load_folder(folder)
    assert mapped.keys() == folder_weights.keys()
    assert all(mx.array_equal(mapped[k], folder_weights[k]).item() for k in mapped)
    spec = sources.transformer_from_file(path, chroma)
    inputs, mask = make_inputs(seed=1), text_mask()
    err = max_rel_err(mlx_forward(spec.build(), inputs, mask), torch_forward(torch_model, inputs, mask))
    print(f"Chroma original names ({path.name}): max_rel_err {err:.2e}")
    assert err <= 1e-4


def test_chroma_flux1_and_flux2_files_are_told_apart(original_files):
    original, _, _ = original_files
    names = list(original)
    assert chroma.is_original(names) and not flux1.is_original(names) and not flux2.is_original(names)
    with pytest.raises(MlxdiffError, match="not a Chroma"):
        chroma.config_from_original({"double_blocks.0.img_mod.lin.weight": mx.zeros((2, 2))})
