"""Qwen3-VL's language model as a text encoder (Krea 2; FLUX 3 Klein and Qwen-Image 2.1 read the same encoder): what
models/text_llm.py needs for it beyond its other LLMs. text_llm builds it (model_type "qwen3_vl", the text config
nested under text_config as transformers saves it) from mlx-lm's own Qwen3 layers, which is what mlx_lm.models.qwen3_vl
itself runs for text: Qwen3VLTextModel's decoder layer is Qwen3's (q/k RMSNorm per head, SwiGLU MLP, no biases).

The multimodal RoPE: transformers' Qwen3VLTextRotaryEmbedding computes one frequency table per axis (T, H, W) from
position rows (3, B, L) and interleaves them (mrope_section, mrope_interleaved). Text alone puts the same position on
the three rows (Qwen3VLTextModel expands one arange; a pipeline passes its own positions expanded over the three
axes, as Krea2Pipeline does), so the interleave picks equal values: the ordinary RoPE over the whole head, rotate-half
(non-traditional) with rope_theta. language_model_config drops the mrope scaling accordingly;
tests/test_qwen3vl_encoder.py checks the table and the hidden states against transformers.

Positions other than 0, 1, 2, ... (Krea2Pipeline: the prompt padded in the middle of its template, pads taking no
position, `cumsum(mask) - 1`): mlx-lm's attention takes one offset per call, so `block_at_positions` composes its
TransformerBlock with the RoPE applied at each token's own position (mx.fast.rope with one offset per token).

The vision tower (`visual.*`, its deepstack mergers) and the lm_head are never read: a text-only forward adds no
deepstack features, and the encoders tap hidden states. Weight names: Qwen3VLForConditionalGeneration's
`model.language_model.*` (transformers 5.25) and Qwen3VLModel's `language_model.*` (text_llm.KEYMAP)."""

from .. import backend  # noqa: F401  (OpenBLAS preload before mlx)
import mlx.core as mx
from .mlx_lm_models import base   # mlx-lm's model files without its package's torch import

MODEL_TYPE = "qwen3_vl"
# the transformers classes a Qwen3-VL text encoder folder names (diffusers' Krea2Pipeline takes a Qwen3VLModel)
CLASSES = ("Qwen3VLModel", "Qwen3VLForConditionalGeneration")


def language_model_config(text: dict) -> dict:
    """The text config with the multimodal RoPE read as the plain RoPE it is for text (module docstring); any other
    scaling type is left to mlx-lm."""
    text = dict(text)
    rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
    if rope.get("type", rope.get("rope_type", "default")) in ("default", "mrope"):
        if text.get("rope_theta") is None and "rope_theta" in rope:
            text["rope_theta"] = rope["rope_theta"]
        text["rope_scaling"] = None
        text.pop("rope_parameters", None)   # qwen3.ModelArgs would take it as the scaling again
    return text


def plain_positions(position_ids, length) -> bool:
    """Whether `position_ids` ((B, L), or None) is 0 .. L-1 on every row: mlx-lm's layers apply that RoPE as is."""
    return position_ids is None or bool((position_ids == mx.arange(length)[None]).all())


def rope_at(rope, x, positions):
    """mlx-lm's RoPE module `rope` (nn.RoPE) on x (B, heads, L, D) at each token's own position (positions (B, L)):
    each token a sequence of one, offset by its position."""
    b, heads, length, dim = x.shape
    tokens = x.transpose(0, 2, 1, 3).reshape(b * length, heads, 1, dim)
    out = rope(tokens, offset=positions.reshape(-1))
    return out.reshape(b, length, heads, dim).transpose(0, 2, 1, 3)


def attention_at(attn, x, mask, positions):
    """mlx_lm.models.qwen3.Attention.__call__ without a cache, its RoPE at `positions`."""
    b, length, _ = x.shape
    queries = attn.q_norm(attn.q_proj(x).reshape(b, length, attn.n_heads, -1)).transpose(0, 2, 1, 3)
    keys = attn.k_norm(attn.k_proj(x).reshape(b, length, attn.n_kv_heads, -1)).transpose(0, 2, 1, 3)
    values = attn.v_proj(x).reshape(b, length, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
    queries, keys = rope_at(attn.rope, queries, positions), rope_at(attn.rope, keys, positions)
    out = base.scaled_dot_product_attention(queries, keys, values, cache=None, scale=attn.scale, mask=mask)
    return attn.o_proj(out.transpose(0, 2, 1, 3).reshape(b, length, -1))


def block_at_positions(layer, h, mask, blind, positions):
    """mlx-lm's Qwen3 TransformerBlock.__call__ (pre-norm attention and MLP residuals) with the attention at
    `positions`; query rows that see no key (`blind` (B, L, 1), or None) get torch SDPA's zero attention output, as
    text_llm.block_with_blind_rows."""
    r = attention_at(layer.self_attn, layer.input_layernorm(h), mask, positions)
    if blind is not None:
        r = mx.where(blind, mx.zeros((), r.dtype), r)
    h = h + r
    return h + layer.mlp(layer.post_attention_layernorm(h))
