"""Parity of mlxdiff.models.krea2 with diffusers' Krea2Transformer2DModel: a batch of two prompts with padding in
the middle of the text (Krea2Pipeline's layout) and without, a non-square latent grid, the positions and mask
mattering; compiled and plain blocks; rows of one valid count run without their padded tokens and without a mask,
as the masked forward; a file in krea-ai's original names (the names diffusers'
convert_krea2_transformer_checkpoint_to_diffusers reads, checked against it), its config read off the shapes."""

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import mlxdiff  # noqa: F401  (OpenBLAS preload before mlx)
import mlx.core as mx

from helpers import load_ours, max_rel_err
from mlxdiff.errors import MlxdiffError
from mlxdiff.loading.sources import transformer_from_file
from mlxdiff.models import krea2
from krea2_helpers import (CONFIG, GRID, TEXT_LEN, make_inputs, make_torch_model, mlx_forward, position_ids, text_mask,
                          to_original, torch_forward)

@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    model = make_torch_model()
    folder = tmp_path_factory.mktemp("krea2")
    model.save_pretrained(str(folder))
    return model, folder


def test_folder_parity(saved):
    torch_model, folder = saved
    ours = load_ours(folder, krea2)
    inputs, mask = make_inputs(), text_mask()
    ref = torch_forward(torch_model, inputs, mask)
    for m in (mask, None):
        out = mlx_forward(ours, inputs, m)
        assert out.shape == inputs["hidden_states"].shape
        err = max_rel_err(out, torch_forward(torch_model, inputs, m))
        print(f"Krea 2 transformer, mask {'on' if m is not None else 'off'}: max_rel_err {err:.2e}")
        assert err <= 1e-4
    # the mask, the timestep, the text and the positions each move the output, so the comparison sees them
    assert max_rel_err(torch_forward(torch_model, inputs, None), ref) > 1e-3
    for key in ("timestep", "encoder_hidden_states"):
        moved = dict(inputs, **{key: inputs[key][::-1].copy()})
        assert max_rel_err(torch_forward(torch_model, moved, mask), ref) > 1e-3, key
        assert max_rel_err(mlx_forward(ours, moved, mask), torch_forward(torch_model, moved, mask)) <= 1e-4, key
    ids = position_ids()[:, [0, 2, 1]].copy()       # rows and columns swapped
    moved = torch_forward(torch_model, inputs, mask, ids)
    assert max_rel_err(moved, ref) > 1e-3
    assert max_rel_err(mlx_forward(ours, inputs, mask, ids), moved) <= 1e-4


def test_block_by_block_compiled_and_plain(saved):
    from mlxdiff.policy import RunPolicy, installed
    _, folder = saved
    ours = load_ours(folder, krea2)
    inputs, mask = make_inputs(), text_mask()
    seen = []
    out = mlx_forward(ours, inputs, mask, after_block=lambda h: seen.append(h.shape))
    width = CONFIG["num_attention_heads"] * CONFIG["attention_head_dim"]
    assert seen == [(2, TEXT_LEN + GRID[0] * GRID[1], width)] * CONFIG["num_layers"]
    for policy in (RunPolicy(compile_blocks=True), RunPolicy(fuse=False)):
        with installed(policy):
            assert max_rel_err(mlx_forward(ours, inputs, mask), out) <= 1e-5, policy


def test_padded_text_dropped(saved, monkeypatch):
    """Rows that keep the same number of text tokens (here 7 of 11, the padding at different places) run without
    the padded ones and without a mask: the same image tokens as the masked forward, diffusers' numbers."""
    torch_model, folder = saved
    ours = load_ours(folder, krea2)
    two = make_inputs()
    mask = np.ones((2, TEXT_LEN), bool)
    mask[0, 4:8] = mask[1, 2:6] = False
    # the masked forward: with an all-valid third row the counts differ, so the mask stays
    three = {k: np.concatenate([v, v[:1]]) for k, v in two.items()}
    masks_seen = []

    def recording(q, k, v, scale, mask=None):
        masks_seen.append(mask)
        return fused_attention(q, k, v, scale, mask)
    fused_attention = krea2.attention
    monkeypatch.setattr(krea2, "attention", recording)
    masked = mlx_forward(ours, three, np.concatenate([mask, np.ones((1, TEXT_LEN), bool)]))[:2]
    assert any(m is not None for m in masks_seen)
    masks_seen.clear()
    shapes = []
    trimmed = mlx_forward(ours, two, mask, after_block=lambda h: shapes.append(h.shape))
    assert masks_seen and all(m is None for m in masks_seen)
    assert shapes[0][1] == 7 + GRID[0] * GRID[1]
    err = max_rel_err(trimmed, masked)
    print(f"Krea 2 trimmed vs masked forward: max_rel_err {err:.2e}, max abs {np.abs(trimmed - masked).max():.2e}")
    assert err <= 1e-5
    assert max_rel_err(trimmed, torch_forward(torch_model, two, mask)) <= 1e-4
    # one prompt (the pipeline's batch), and a batch whose counts differ keeps the mask
    one = {k: v[:1] for k, v in two.items()}
    assert max_rel_err(mlx_forward(ours, one, mask[:1]), masked[:1]) <= 1e-5
    assert krea2.kept_text_tokens(text_mask(), position_ids()[:TEXT_LEN]) is None


def test_original_file(saved, tmp_path):
    from diffusers.loaders.single_file_utils import convert_krea2_transformer_checkpoint_to_diffusers
    torch_model, folder = saved
    sd = torch_model.state_dict()
    original = to_original(sd)
    back = convert_krea2_transformer_checkpoint_to_diffusers(dict(original))
    assert sorted(back) == sorted(sd) and all(torch.equal(back[k], sd[k]) for k in sd)   # what diffusers reads
    path = tmp_path / "krea2_original.safetensors"
    save_file(original, str(path))
    assert krea2.is_original(original) and krea2.is_original(sd)
    spec = transformer_from_file(path, krea2)
    expected = {**CONFIG, "norm_eps": 1e-5, "axes_dims_rope": [6, 8, 10]}   # no folder: Krea 2's split of 24
    assert spec.config == expected
    spec = transformer_from_file(path, krea2, torch_model.config, folder / "config.json")
    assert spec.args == krea2.ModelArgs.from_dict(dict(torch_model.config))
    ours = spec.build()
    inputs, mask = make_inputs(), text_mask()
    err = max_rel_err(mlx_forward(ours, inputs, mask), torch_forward(torch_model, inputs, mask))
    print(f"Krea 2 transformer, original-name file: max_rel_err {err:.2e}")
    assert err <= 1e-4


def test_bad_inputs(saved):
    _, folder = saved
    ours = load_ours(folder, krea2)
    inputs, mask = make_inputs(), text_mask()
    with pytest.raises(MlxdiffError, match="position_ids has shape"):
        mlx_forward(ours, inputs, mask, position_ids()[1:])
    with pytest.raises(MlxdiffError, match="encoder_attention_mask has shape"):
        mlx_forward(ours, inputs, mask[:, 1:])
    with pytest.raises(MlxdiffError, match="encoder_hidden_states has shape"):
        mlx_forward(ours, dict(inputs, encoder_hidden_states=inputs["encoder_hidden_states"][:, :, :2]), mask)
    with pytest.raises(MlxdiffError, match="axes_dims_rope"):
        krea2.ModelArgs.from_dict({**CONFIG, "axes_dims_rope": [4, 10, 12]})
    with pytest.raises(MlxdiffError, match="num_key_value_heads"):
        krea2.ModelArgs.from_dict({**CONFIG, "num_key_value_heads": 3})
