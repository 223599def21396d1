"""Qwen3-VL's language model as a text encoder (models/text_llm.py's `qwen3_vl`, models/text_qwen3vl.py) against
transformers' Qwen3VLModel: the hidden states it returns with output_hidden_states=True, at a tiny float32 config
(every dimension different, an interleaved mrope_section, a vision tower with a deepstack merger that is never read),
saved with save_pretrained both as Qwen3VLModel (`language_model.*`) and Qwen3VLForConditionalGeneration
(`model.language_model.*`, an lm_head) and read through the loader users use; with transformers' own positions
(none given: 0 .. L-1) and with the positions Krea2Pipeline passes (padding in the middle takes no position, the
three mRoPE rows equal). The multimodal RoPE of text alone is checked to be the plain RoPE table."""

import json

import numpy as np
import pytest
import torch
import transformers

from mlxdiff import backend  # noqa: F401  (before mlx)
import mlx.core as mx
from mlx.utils import tree_flatten

from helpers import max_rel_err, randomize_
from mlxdiff.errors import MlxdiffError
from mlxdiff.loading.sources import text_encoder_spec
from mlxdiff.models import text_llm

TEXT = dict(vocab_size=301, hidden_size=40, intermediate_size=72, num_hidden_layers=5, num_attention_heads=4,
            num_key_value_heads=2, head_dim=14, max_position_embeddings=256, rms_norm_eps=1e-6,
            rope_parameters=dict(rope_type="default", rope_theta=5e5, mrope_section=[3, 2, 2], mrope_interleaved=True))
VISION = dict(depth=1, hidden_size=16, intermediate_size=24, num_heads=2, out_hidden_size=40, patch_size=4,
              spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16, deepstack_visual_indexes=[0])
L = 19


def save(folder, cls, seed):
    config = transformers.Qwen3VLConfig(text_config=TEXT, vision_config=VISION, tie_word_embeddings=False)
    model = randomize_(cls(config).eval(), seed, 0.2)
    model.save_pretrained(folder)
    return model


@pytest.fixture(scope="module", params=["Qwen3VLModel", "Qwen3VLForConditionalGeneration"])
def saved(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    model = save(folder, getattr(transformers, request.param), seed=len(request.param))
    assert json.loads((folder / "config.json").read_text())["architectures"] == [request.param]
    base = model if request.param == "Qwen3VLModel" else model.model
    return base, folder


def inputs():
    rng = np.random.default_rng(3)
    ids = rng.integers(0, TEXT["vocab_size"], (2, L)).astype(np.int64)
    mask = np.ones((2, L), np.int64)
    mask[1, 9:14] = 0          # Krea 2's layout: [prefix | prompt | PAD | suffix]
    mask[0, 16:] = 0           # a right-padded row
    return ids, mask


def reference(model, ids, mask, position_ids=None):
    with torch.no_grad():
        out = model(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask).bool(),
                    position_ids=position_ids, output_hidden_states=True)
    return [h.numpy() for h in out.hidden_states]


@pytest.mark.parametrize("krea_positions", [False, True], ids=["arange", "cumsum"])
def test_hidden_states_match_transformers(saved, krea_positions):
    model, folder = saved
    ids, mask = inputs()
    taps = (0, 2, 3, 5)         # the embeddings, two layers, the last (final-normed) one
    positions = None
    if krea_positions:          # Krea2Pipeline.get_text_hidden_states
        positions = (torch.from_numpy(mask).cumsum(-1) - 1).clamp(min=0)
    ref = reference(model, ids, mask, None if positions is None else positions[None].expand(3, -1, -1))
    encoder = text_encoder_spec(folder, taps).build()
    assert len(encoder.layers) == 5
    ours = np.array(encoder(ids, mask, None if positions is None else positions.numpy()))
    width = TEXT["hidden_size"]
    assert ours.shape == (2, L, len(taps) * width)
    for i, tap in enumerate(taps):
        err = max_rel_err(ours[..., i * width:(i + 1) * width], ref[tap])
        print(f"{folder.name} positions {'cumsum' if krea_positions else 'arange'} tap {tap}: max_rel_err {err:.2e}")
        assert err <= 1e-4


def test_positions_matter(saved):
    """The cumsum positions move transformers' hidden states (so the test above sees them), and ours as much."""
    model, folder = saved
    ids, mask = inputs()
    positions = (torch.from_numpy(mask).cumsum(-1) - 1).clamp(min=0)
    plain, moved = reference(model, ids, mask)[3], reference(model, ids, mask, positions[None].expand(3, -1, -1))[3]
    assert max_rel_err(moved[1, 14:], plain[1, 14:]) > 1e-2    # the suffix after the padding
    encoder = text_encoder_spec(folder, (3,)).build()
    ours = np.array(encoder(ids, mask, positions.numpy()))
    assert max_rel_err(ours, moved) <= 1e-4


def test_vision_tower_and_head_are_not_read(saved):
    _, folder = saved
    spec = text_encoder_spec(folder, (2,))
    encoder = spec.build()
    names = {k for k, _ in tree_flatten(encoder.parameters())}
    assert names and all(n.startswith(("embed_tokens.", "layers.0.", "layers.1.")) for n in names)
    # what it counts (and reads) is that: the embedding and layers 0, 1 in float32, no vision tower, head or norm
    assert spec.nbytes() == 4 * sum(v.size for _, v in tree_flatten(encoder.parameters()))
    assert spec.args.model_type == "qwen3_vl"
    assert text_llm.ARCHITECTURES["qwen3_vl"] == "Qwen3VLForConditionalGeneration"


def test_text_alone_multimodal_rope_is_plain_rope():
    """transformers' Qwen3VLTextRotaryEmbedding with its three position rows equal (any positions, as a text-only
    forward or Krea2Pipeline builds them) is the ordinary rotate-half RoPE table over the whole head, interleaved or
    not: what mlx-lm's Qwen3 layers apply."""
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding
    positions = torch.tensor([[0, 1, 2, 3, 3, 3, 4, 5, 9, 30]])
    for section, head, interleaved in (([3, 2, 2], 14, True), ([24, 20, 20], 128, True), ([24, 20, 20], 128, False)):
        config = transformers.Qwen3VLConfig(text_config=dict(
            TEXT, head_dim=head, rope_parameters=dict(rope_type="default", rope_theta=5e6, mrope_section=section,
                                                      mrope_interleaved=interleaved))).text_config
        rope = Qwen3VLTextRotaryEmbedding(config)
        cos, sin = rope(torch.zeros(1, dtype=torch.float32), positions[None].expand(3, -1, -1))
        inv_freq = 1.0 / (5e6 ** (torch.arange(0, head, 2, dtype=torch.float) / head))
        freqs = positions[0].float()[:, None] * inv_freq[None]
        plain = torch.cat([freqs, freqs], dim=-1)
        torch.testing.assert_close(cos[0], plain.cos(), rtol=0, atol=0)
        torch.testing.assert_close(sin[0], plain.sin(), rtol=0, atol=0)


def test_bad_positions_refused(saved):
    _, folder = saved
    ids, mask = inputs()
    encoder = text_encoder_spec(folder, (2,)).build()
    with pytest.raises(MlxdiffError, match="position_ids has shape"):
        encoder(ids, mask, np.zeros((2, L - 1), np.int32))
