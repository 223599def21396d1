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

The vision tower (`visual.*`, its deepstack mergers) is models/vision_qwen3vl.py's, read only for Qwen-Image 2.1's
condition images (the prompts with images: the section below); the lm_head is never read (the encoders tap hidden
states). Weight names: Qwen3VLForConditionalGeneration's
`model.language_model.*` (transformers 5.25) and Qwen3VLModel's `language_model.*` (text_llm.KEYMAP)."""

import numpy as np

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


# -- prompts with images (Qwen-Image 2.1's condition images) ---------------------------------------------------------
# With images in the prompt the three RoPE axes differ (transformers' Qwen3VLModel.get_rope_index, from the
# processor's mm_token_type_ids): each text run advances one position on all three axes; an image's merged tokens
# (t, h / 2, w / 2) take (start + t, start + row, start + column) and the position after it advances by
# max(h, w) / 2; padding takes 0. Qwen3VLTextRotaryEmbedding computes one frequency table per axis and interleaves
# them (mrope_section: H at indices 1, 4, 7, ... below 3 * section[1], W at 2, 5, 8, ... below 3 * section[2], T
# elsewhere), the rotation rotate-half over the whole head. After each of the first len(deepstack) decoder layers
# the vision tower's deepstack features are added to the image tokens' hidden states (_deepstack_process).

def rope_index(ids, mask, image_token_id, grids, merge) -> np.ndarray:
    """get_rope_index: (3, B, L) positions of left- or right-padded rows `ids` / `mask` (B, L) whose image tokens
    (`image_token_id`, one contiguous run per image) take, in order over the rows, the images' (t, h, w) patch
    `grids` merged `merge` x `merge`."""
    ids, mask = np.asarray(ids), np.asarray(mask).astype(bool)
    out = np.zeros((3, *ids.shape), np.int64)
    images = iter(grids)
    for row in range(ids.shape[0]):
        is_image = ids[row][mask[row]] == image_token_id
        pieces, position, start = [], 0, 0
        while start < len(is_image):
            end = start
            while end < len(is_image) and is_image[end] == is_image[start]:
                end += 1
            if not is_image[start]:
                pieces.append(np.broadcast_to(np.arange(position, position + end - start), (3, end - start)))
                position += end - start
            else:
                t, h, w = (int(v) for v in next(images))
                grid = np.meshgrid(np.arange(t), np.arange(h // merge), np.arange(w // merge), indexing="ij")
                pieces.append(np.stack([axis.reshape(-1) for axis in grid]) + position)
                position += max(h, w) // merge
            start = end
        out[:, row, mask[row]] = np.concatenate(pieces, axis=1)
    return out


def mrope_tables(positions, head_dim, theta, section) -> tuple:
    """Qwen3VLTextRotaryEmbedding (interleaved) at positions (3, B, L) -> (cos, sin), each (B, 1, L, head_dim)
    float32."""
    inv_freq = (1.0 / theta ** (np.arange(0, head_dim, 2).astype(np.float32) / head_dim)).astype(np.float32)
    freqs = np.asarray(positions).astype(np.float32)[..., None] * inv_freq          # (3, B, L, head_dim / 2)
    table = freqs[0].copy()
    for axis in (1, 2):
        table[..., axis:3 * section[axis]:3] = freqs[axis][..., axis:3 * section[axis]:3]
    emb = np.concatenate([table, table], axis=-1)[:, None]
    return mx.array(np.cos(emb)), mx.array(np.sin(emb))


def _rotate(x, cos, sin):
    half = x.shape[-1] // 2
    rotated = mx.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos.astype(x.dtype) + rotated * sin.astype(x.dtype)


def block_with_tables(layer, h, mask, blind, cos, sin):
    """mlx-lm's Qwen3 TransformerBlock.__call__ with the attention rotated by (cos, sin) (mrope_tables); blind
    rows as block_at_positions."""
    attn = layer.self_attn
    x = layer.input_layernorm(h)
    b, length, _ = x.shape
    queries = attn.q_norm(attn.q_proj(x).reshape(b, length, attn.n_heads, -1)).transpose(0, 2, 1, 3)
    keys = attn.k_norm(attn.k_proj(x).reshape(b, length, attn.n_kv_heads, -1)).transpose(0, 2, 1, 3)
    values = attn.v_proj(x).reshape(b, length, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
    out = base.scaled_dot_product_attention(_rotate(queries, cos, sin), _rotate(keys, cos, sin), values, cache=None,
                                            scale=attn.scale, mask=mask)
    r = attn.o_proj(out.transpose(0, 2, 1, 3).reshape(b, length, -1))
    if blind is not None:
        r = mx.where(blind, mx.zeros((), r.dtype), r)
    h = h + r
    return h + layer.mlp(layer.post_attention_layernorm(h))


def scatter_images(ids, token_id, features, width, dtype):
    """(B, L, width): the k-th image token (row order) holds features[k], every other position 0."""
    is_image = np.asarray(ids).reshape(-1) == token_id
    take = mx.array(np.maximum(np.cumsum(is_image) - 1, 0).astype(np.int32))
    flat = mx.where(mx.array(is_image)[:, None], features.astype(dtype)[take], mx.zeros((), dtype))
    return flat.reshape(*np.asarray(ids).shape, width)


def mrope_settings(text_config: dict) -> tuple:
    """(head_dim, rope_theta, mrope_section) of a Qwen3-VL text config (transformers' names; mrope_section's
    default [24, 20, 20], Qwen3VLTextRotaryEmbedding's)."""
    rope = dict(text_config.get("rope_parameters") or text_config.get("rope_scaling") or {})
    theta = text_config.get("rope_theta") or rope.get("rope_theta", 5000000.0)
    head_dim = text_config.get("head_dim") or text_config["hidden_size"] // text_config["num_attention_heads"]
    return head_dim, float(theta), list(rope.get("mrope_section", [24, 20, 20]))
