"""Krea 2 transformer: diffusers' Krea2Transformer2DModel (models/transformers/transformer_krea2.py) in MLX.

A single-stream MMDiT. The text conditioning is a stack of hidden states tapped from several Qwen3-VL layers per
token (B, L_txt, num_text_layers, text_hidden_dim); a small text-fusion transformer (Krea2TextFusion) attends across
the layer axis of each token (layerwise_blocks, no mask), collapses it with a linear `projector` and attends across
the tokens (refiner_blocks, the text key mask); txt_in (zero-centred RMSNorm, Linear, GELU-tanh, Linear) brings it to
the width. [text; image] then runs through the blocks: zero-centred RMSNorms (the scale is 1 + weight, computed in
float32), grouped-query attention with q/k RMSNorm, FLUX's interleaved RoPE over (t, h, w) ids (text at the origin,
image tokens at (0, row, column)) and a sigmoid output gate (to_gate), a SwiGLU MLP; each block's modulation is one
shared time projection (time_mod_proj of GELU-tanh(temb)) plus the block's learned scale_shift_table (6 rows:
prescale, preshift, pregate, postscale, postshift, postgate). The timestep embedding is a cos-first sinusoid of
1000 t; the final layer modulates with temb itself plus its own 2-row table. Padded text tokens are masked as keys
everywhere; their own rows are never read back (the output is the image tokens'). So when every row of the batch
keeps the same number of text tokens (one prompt: the pipeline's case, 512 tokens of which a prompt's ~45 valid),
the padded ones are dropped before the text fusion instead: the same numbers, shorter sequences, no mask
(kept_text_tokens).

Files: diffusers' names (a Krea2Transformer2DModel folder), and krea-ai's original names (`first`, `tmlp`, `tproj`,
`txtmlp`, `txtfusion`, `blocks.N.attn.wq`, `.prenorm.scale`, `.mod.lin`, `last.*`; bare or under
`model.diffusion_model.`), which diffusers' convert_krea2_transformer_checkpoint_to_diffusers maps (ORIGINAL_KEYMAP
here: the same renames, a block's flattened `mod.lin` reshaped to its 6 rows). Its LoRAs: diffusers / PEFT names,
and the original names (`diffusion_model.` / `base_model.model.` prefixes) as
_convert_non_diffusers_krea2_lora_to_diffusers reads them (lora_original_rules).
"""

import math
import re
from dataclasses import dataclass

import numpy as np

from .. import backend  # noqa: F401  (OpenBLAS preload before mlx)
import mlx.core as mx
import mlx.nn as nn

from ..config_checks import MAX_HEAD_DIM, MAX_HEADS, MAX_LAYERS, MAX_WIDTH, CheckedArgs, Rule, between, positive
from ..errors import MlxdiffError
from ..formats.keymaps import compile_rules, remap, required_shape, under_prefix_if_present
from ..pacing import pace
from .flux2 import apply_rope, cached_rope
from .fused import attention, compiled_block, gated_residual

CLASS_NAMES = ("Krea2Transformer2DModel",)   # diffusers' class: its key in models/registry.ARCHITECTURES


@dataclass
class ModelArgs(CheckedArgs):
    # defaults: diffusers' Krea2Transformer2DModel (Krea 2's transformer/config.json)
    in_channels: int = 64
    num_layers: int = 28
    attention_head_dim: int = 128
    num_attention_heads: int = 48
    num_key_value_heads: int = 12
    intermediate_size: int = 16384
    timestep_embed_dim: int = 256
    text_hidden_dim: int = 2560
    num_text_layers: int = 12
    text_num_attention_heads: int = 20
    text_num_key_value_heads: int = 20
    text_intermediate_size: int = 6912
    num_layerwise_text_blocks: int = 2
    num_refiner_text_blocks: int = 2
    axes_dims_rope: tuple[int, ...] = (32, 48, 48)
    rope_theta: float = 1000.0
    norm_eps: float = 1e-5

    WHAT = "Krea 2 transformer config"
    LIMITS = {
        "in_channels": between(1, MAX_WIDTH),
        "num_layers": between(1, MAX_LAYERS),
        "attention_head_dim": between(1, MAX_HEAD_DIM),
        "num_attention_heads": between(1, MAX_HEADS),
        "num_key_value_heads": between(1, MAX_HEADS),
        "intermediate_size": between(1, MAX_WIDTH),
        "timestep_embed_dim": between(2, MAX_WIDTH),
        "text_hidden_dim": between(1, MAX_WIDTH),
        "num_text_layers": between(1, MAX_LAYERS),
        "text_num_attention_heads": between(1, MAX_HEADS),
        "text_num_key_value_heads": between(1, MAX_HEADS),
        "text_intermediate_size": between(1, MAX_WIDTH),
        "num_layerwise_text_blocks": between(0, MAX_LAYERS),
        "num_refiner_text_blocks": between(0, MAX_LAYERS),
        "axes_dims_rope": between(2, MAX_HEAD_DIM, items=(3, 3)),    # (t, h, w) position axes
        "rope_theta": between(1, 1e9),
        "norm_eps": positive(1),
    }
    RULES = (
        Rule("axes_dims_rope", lambda a: sum(a.axes_dims_rope) == a.attention_head_dim
             and not any(d % 2 for d in a.axes_dims_rope),
             lambda a: f"expected even numbers summing to attention_head_dim {a.attention_head_dim}"),
        Rule("num_attention_heads", lambda a: a.num_attention_heads * a.attention_head_dim <= MAX_WIDTH,
             lambda a: f"num_attention_heads * attention_head_dim (the width) must be at most {MAX_WIDTH}"),
        Rule("num_key_value_heads", lambda a: a.num_attention_heads % a.num_key_value_heads == 0,
             lambda a: f"must divide num_attention_heads {a.num_attention_heads}"),
        Rule("text_num_attention_heads", lambda a: a.text_hidden_dim % a.text_num_attention_heads == 0,
             lambda a: f"must divide text_hidden_dim {a.text_hidden_dim}"),
        Rule("text_num_key_value_heads", lambda a: a.text_num_attention_heads % a.text_num_key_value_heads == 0,
             lambda a: f"must divide text_num_attention_heads {a.text_num_attention_heads}"),
        Rule("timestep_embed_dim", lambda a: a.timestep_embed_dim % 2 == 0, lambda a: "must be even (cos | sin)"),
    )

    def __post_init__(self):
        self.axes_dims_rope = tuple(self.axes_dims_rope)

    @property
    def width(self) -> int:
        return self.num_attention_heads * self.attention_head_dim


# -- layers ----------------------------------------------------------------------------------------------------------

class RMSNorm(nn.Module):
    """Krea2RMSNorm: zero-centred scale (1 + weight), the normalization in float32, the result in the input's dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = mx.zeros((dim,))

    def __call__(self, x):
        return mx.fast.rms_norm(x.astype(mx.float32), 1.0 + self.weight.astype(mx.float32), self.eps).astype(x.dtype)


class Attention(nn.Module):
    """Krea2Attention: grouped-query projections, q/k RMSNorm per head, RoPE where given, a sigmoid output gate."""

    def __init__(self, dim: int, heads: int, kv_heads: int, eps: float):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.to_q = nn.Linear(dim, self.head_dim * heads, bias=False)
        self.to_k = nn.Linear(dim, self.head_dim * kv_heads, bias=False)
        self.to_v = nn.Linear(dim, self.head_dim * kv_heads, bias=False)
        self.to_gate = nn.Linear(dim, dim, bias=False)
        self.norm_q = RMSNorm(self.head_dim, eps)
        self.norm_k = RMSNorm(self.head_dim, eps)
        self.to_out = [nn.Linear(dim, dim, bias=False)]

    def __call__(self, x, mask=None, cos=None, sin=None):
        b, s, _ = x.shape
        q = self.norm_q(self.to_q(x).reshape(b, s, self.heads, self.head_dim)).transpose(0, 2, 1, 3)
        k = self.norm_k(self.to_k(x).reshape(b, s, self.kv_heads, self.head_dim)).transpose(0, 2, 1, 3)
        v = self.to_v(x).reshape(b, s, self.kv_heads, self.head_dim).transpose(0, 2, 1, 3)
        if cos is not None:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = attention(q, k, v, self.head_dim ** -0.5, mask)     # MLX's SDPA takes the key/value groups as they are
        out = out.transpose(0, 2, 1, 3).reshape(b, s, -1)
        return self.to_out[0](out * mx.sigmoid(self.to_gate(x)))


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate = nn.Linear(dim, hidden, bias=False)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def __call__(self, x):
        return self.down(pace(nn.silu(self.gate(x)) * self.up(x)))


class TextFusionBlock(nn.Module):
    """Krea2TextFusionBlock: pre-norm attention and SwiGLU residuals, no RoPE, no modulation."""

    def __init__(self, dim, heads, kv_heads, hidden, eps):
        super().__init__()
        self.norm1 = RMSNorm(dim, eps)
        self.norm2 = RMSNorm(dim, eps)
        self.attn = Attention(dim, heads, kv_heads, eps)
        self.ff = SwiGLU(dim, hidden)

    def __call__(self, x, mask=None):
        x = x + self.attn(self.norm1(x), mask)
        return x + self.ff(self.norm2(x))


class TextFusion(nn.Module):
    """Krea2TextFusion: (B, L, T, D) tapped states -> (B, L, D): layerwise blocks over each token's T states, the
    projector over T, refiner blocks over the tokens (the text key mask)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        block = (args.text_hidden_dim, args.text_num_attention_heads, args.text_num_key_value_heads,
                 args.text_intermediate_size, args.norm_eps)
        self.layerwise_blocks = [TextFusionBlock(*block) for _ in range(args.num_layerwise_text_blocks)]
        self.projector = nn.Linear(args.num_text_layers, 1, bias=False)
        self.refiner_blocks = [TextFusionBlock(*block) for _ in range(args.num_refiner_text_blocks)]

    def __call__(self, states, mask=None):
        b, length, layers, dim = states.shape
        h = states.reshape(b * length, layers, dim)
        for block in self.layerwise_blocks:
            h = block(h)
        h = self.projector(h.reshape(b, length, layers, dim).transpose(0, 1, 3, 2))[..., 0]
        for block in self.refiner_blocks:
            h = block(h, mask)
        return h


class TransformerBlock(nn.Module):
    """Krea2TransformerBlock: the shared time modulation plus the block's table, pre-norm gated attention and SwiGLU
    residuals (the gated sums in the stream's dtype)."""

    def __init__(self, dim, hidden, heads, kv_heads, eps):
        super().__init__()
        self.scale_shift_table = mx.zeros((6, dim))
        self.norm1 = RMSNorm(dim, eps)
        self.norm2 = RMSNorm(dim, eps)
        self.attn = Attention(dim, heads, kv_heads, eps)
        self.ff = SwiGLU(dim, hidden)

    def __call__(self, h, temb_mod, cos, sin, mask):
        dtype = temb_mod.dtype
        mod = temb_mod.reshape(*temb_mod.shape[:-1], 6, -1) + self.scale_shift_table.astype(dtype)
        prescale, preshift, pregate, postscale, postshift, postgate = (mod[..., i, :] for i in range(6))
        attn_out = self.attn((1.0 + prescale) * self.norm1(h).astype(dtype) + preshift, mask, cos, sin)
        h = gated_residual(h, pregate, attn_out)
        ff_out = self.ff((1.0 + postscale) * self.norm2(h).astype(dtype) + postshift)
        return pace(gated_residual(h, postgate, ff_out))


class TimestepEmbedding(nn.Module):
    """Krea2TimestepEmbedding: cos | sin of (1000 t) * exp(-ln(1e4) j / half), cast to the compute dtype, then
    Linear, GELU-tanh, Linear -> (B, 1, D)."""

    def __init__(self, embed_dim: int, dim: int):
        super().__init__()
        self.embed_dim = embed_dim
        self.linear_1 = nn.Linear(embed_dim, dim)
        self.linear_2 = nn.Linear(dim, dim)

    def __call__(self, timestep, dtype):
        half = self.embed_dim // 2
        freqs = mx.exp(-math.log(1e4) * mx.arange(half, dtype=mx.float32) / half)
        args = (timestep.astype(mx.float32) * 1e3)[:, None, None] * freqs
        emb = mx.concatenate([mx.cos(args), mx.sin(args)], axis=-1).astype(dtype)
        return self.linear_2(nn.gelu_approx(self.linear_1(emb)))


class TextProjection(nn.Module):
    def __init__(self, text_dim: int, dim: int, eps: float):
        super().__init__()
        self.norm = RMSNorm(text_dim, eps)
        self.linear_1 = nn.Linear(text_dim, dim)
        self.linear_2 = nn.Linear(dim, dim)

    def __call__(self, x):
        return self.linear_2(nn.gelu_approx(self.linear_1(self.norm(x))))


class FinalLayer(nn.Module):
    def __init__(self, dim: int, out_channels: int, eps: float):
        super().__init__()
        self.scale_shift_table = mx.zeros((2, dim))
        self.norm = RMSNorm(dim, eps)
        self.linear = nn.Linear(dim, out_channels)

    def __call__(self, h, temb):
        mod = temb + self.scale_shift_table.astype(temb.dtype)      # (B, 2, D)
        scale, shift = mod[:, :1], mod[:, 1:]
        return self.linear((1.0 + scale) * self.norm(h).astype(temb.dtype) + shift)


def kept_text_tokens(valid, txt_ids):
    """The valid text tokens' indices (B, n) when the key mask `valid` (B, L) can be dropped by dropping the padded
    tokens: every row keeps the same number n >= 1 (one prompt, or prompts of one length) and the kept tokens of
    every row have the same RoPE ids (`txt_ids` (L, 3) is shared by the batch; Krea2Pipeline's are all zero). Else
    None: the mask stays."""
    valid = valid.astype(bool)
    counts = valid.sum(axis=1)
    if counts.min() != counts.max() or counts[0] == 0:
        return None
    kept = np.stack([np.flatnonzero(row) for row in valid]).astype(np.int32)
    kept_ids = txt_ids[kept]
    return kept if (kept_ids == kept_ids[:1]).all() else None


# the embedders, the shared time projection, the text fusion's projector and the output layers stay in full
# precision (loading/quantize.py)
FULL_PRECISION = re.compile(r"(img_in|time_embed\..*|time_mod_proj|txt_in\..*|text_fusion\.projector|final_layer\..*)")


class Model(nn.Module):
    """Krea2Transformer2DModel.

    __call__(hidden_states (B, N_img, C) packed 2x2 latents, encoder_hidden_states (B, L_txt, num_text_layers,
    text_hidden_dim) the tapped Qwen3-VL states, timestep (B,) = sigma in [0, 1] (the pipeline's t / 1000; scaled by
    1000 inside the embedding, as diffusers), position_ids (L_txt + N_img, 3) the (t, h, w) RoPE ids of [text;
    image], encoder_attention_mask (B, L_txt) bool / 0-1 or None: the text tokens that take part as keys) ->
    (B, N_img, C). `after_block(h)`: the caller's memory policy, after every block; step_cache (a first-block cache,
    pipelines/step_cache.py) and stream_dtype as flux2.Model."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.compute_dtype = mx.float32
        dim = args.width
        self.img_in = nn.Linear(args.in_channels, dim)
        self.time_embed = TimestepEmbedding(args.timestep_embed_dim, dim)
        self.time_mod_proj = nn.Linear(dim, 6 * dim)
        self.text_fusion = TextFusion(args)
        self.txt_in = TextProjection(args.text_hidden_dim, dim, args.norm_eps)
        self.transformer_blocks = [TransformerBlock(dim, args.intermediate_size, args.num_attention_heads,
                                                    args.num_key_value_heads, args.norm_eps)
                                   for _ in range(args.num_layers)]
        self.final_layer = FinalLayer(dim, args.in_channels, args.norm_eps)

    def __call__(self, hidden_states, encoder_hidden_states, timestep, position_ids, encoder_attention_mask=None,
                 after_block=None, step_cache=None, stream_dtype=None):
        dtype = self.compute_dtype
        stream = stream_dtype or dtype
        b, n_img = hidden_states.shape[:2]
        if encoder_hidden_states.ndim != 4 or encoder_hidden_states.shape[2:] != (self.args.num_text_layers,
                                                                                  self.args.text_hidden_dim):
            raise MlxdiffError(f"encoder_hidden_states has shape {tuple(encoder_hidden_states.shape)}; expected "
                               f"(batch, text tokens, {self.args.num_text_layers}, {self.args.text_hidden_dim}) (the "
                               "tapped text encoder states)")
        n_txt = encoder_hidden_states.shape[1]
        ids = np.asarray(position_ids)
        if ids.shape != (n_txt + n_img, 3):
            raise MlxdiffError(f"position_ids has shape {ids.shape}; expected (text + image tokens, 3) = "
                               f"({n_txt + n_img}, 3)")
        img_ids, txt_ids = ids[n_txt:], ids[:n_txt]
        text_mask = mask = None
        if encoder_attention_mask is not None:
            if tuple(encoder_attention_mask.shape) != (b, n_txt):
                raise MlxdiffError(f"encoder_attention_mask has shape {tuple(encoder_attention_mask.shape)}; "
                                   f"expected (batch, text tokens) = ({b}, {n_txt})")
            kept = kept_text_tokens(np.asarray(encoder_attention_mask), txt_ids)
            if kept is not None:
                # padded tokens only ever enter as masked keys and their rows are dropped at the output: without
                # them the numbers are the same, the sequences shorter, and SDPA gets no mask (its fused path)
                if kept.shape[1] < n_txt:
                    encoder_hidden_states = mx.take_along_axis(encoder_hidden_states,
                                                               mx.array(kept)[:, :, None, None], axis=1)
                    txt_ids, n_txt = txt_ids[kept[0]], kept.shape[1]
            else:
                keys = encoder_attention_mask.astype(mx.bool_)
                text_mask = keys[:, None, None, :]
                mask = mx.concatenate([keys, mx.ones((b, n_img), dtype=mx.bool_)], axis=1)[:, None, None, :]
        cos, sin = cached_rope(self, img_ids, txt_ids, self.args.axes_dims_rope, self.args.rope_theta)
        timestep = timestep if isinstance(timestep, mx.array) else mx.array(np.asarray(timestep, np.float32))
        temb = self.time_embed(timestep.reshape(-1), dtype)
        temb_mod = self.time_mod_proj(nn.gelu_approx(temb))
        context = self.txt_in(self.text_fusion(encoder_hidden_states.astype(dtype), text_mask))
        h = mx.concatenate([context, self.img_in(hidden_states.astype(dtype))], axis=1).astype(stream)
        head = None
        for i, block in enumerate(self.transformer_blocks):
            h_in = h
            h = compiled_block(block, h, temb_mod, cos, sin, mask)
            if after_block:
                after_block(h)
            if i == 0 and step_cache is not None:
                reused = step_cache.reuse(h[:, n_txt:] - h_in[:, n_txt:])    # only the image tokens are read back
                if reused is not None:
                    return self.final_layer(h[:, n_txt:] + reused, temb)
                head = h[:, n_txt:]
        if step_cache is not None:
            step_cache.remember(h[:, n_txt:] - head)
        return self.final_layer(h[:, n_txt:], temb)

    def quant_predicate(self, path, module) -> bool:
        """Which layers may be quantized: not the embedders, the time projection, the projector or the output."""
        return not FULL_PRECISION.fullmatch(path)

    def sanitize(self, weights: dict) -> dict:
        """diffusers' names and layouts are this module's own; a block table stored flat (original files) gets its
        6 rows."""
        out = dict(weights)
        for key, value in weights.items():
            if key.endswith("scale_shift_table") and key.startswith("transformer_blocks.") and value.ndim != 2:
                out[key] = value.reshape(6, -1)
        return out


# -- original (krea-ai) names: diffusers' convert_krea2_transformer_checkpoint_to_diffusers ----------------------

ORIGINAL_PREFIX = "model.diffusion_model."
_P = r"(?:model\.diffusion_model\.)?"
_BLOCK_PARTS = [   # (original, diffusers) within a block (transformer or text fusion)
    (r"attn\.wq\.weight", "attn.to_q.weight"), (r"attn\.wk\.weight", "attn.to_k.weight"),
    (r"attn\.wv\.weight", "attn.to_v.weight"), (r"attn\.wo\.weight", "attn.to_out.0.weight"),
    (r"attn\.gate\.weight", "attn.to_gate.weight"), (r"attn\.qknorm\.qnorm\.scale", "attn.norm_q.weight"),
    (r"attn\.qknorm\.knorm\.scale", "attn.norm_k.weight"), (r"mlp\.(gate|up|down)\.weight", r"ff.\2.weight"),
    (r"prenorm\.scale", "norm1.weight"), (r"postnorm\.scale", "norm2.weight")]


ORIGINAL_KEYMAP = [
    (_P + r"first\.(weight|bias)", r"img_in.\1"),
    (_P + r"tmlp\.0\.(weight|bias)", r"time_embed.linear_1.\1"),
    (_P + r"tmlp\.2\.(weight|bias)", r"time_embed.linear_2.\1"),
    (_P + r"tproj\.1\.(weight|bias)", r"time_mod_proj.\1"),
    (_P + r"txtmlp\.0\.scale", "txt_in.norm.weight"),
    (_P + r"txtmlp\.1\.(weight|bias)", r"txt_in.linear_1.\1"),
    (_P + r"txtmlp\.3\.(weight|bias)", r"txt_in.linear_2.\1"),
    (_P + r"txtfusion\.projector\.weight", "text_fusion.projector.weight"),
    (_P + r"last\.linear\.(weight|bias)", r"final_layer.linear.\1"),
    (_P + r"last\.norm\.scale", "final_layer.norm.weight"),
    (_P + r"last\.modulation\.lin", "final_layer.scale_shift_table"),
    (_P + r"blocks\.(\d+)\.mod\.lin", r"transformer_blocks.\1.scale_shift_table"),   # 6 rows: sanitize
    *[(_P + r"txtfusion\.(layerwise_blocks|refiner_blocks)\.(\d+)\." + part,
       r"text_fusion.\1.\2." + new.replace(r"\2", r"\3")) for part, new in _BLOCK_PARTS],
    *[(_P + r"blocks\.(\d+)\." + part, r"transformer_blocks.\1." + new) for part, new in _BLOCK_PARTS],
]
_ORIGINAL_RULES = compile_rules(ORIGINAL_KEYMAP)
_MARK = re.compile(_P + r"txtfusion\.projector\.weight")       # diffusers' CHECKPOINT_KEY_NAMES["krea2"]
_DIFFUSERS_MARK = re.compile(_P + r"text_fusion\.projector\.weight")
FROM_BASE_CONFIG = ("axes_dims_rope", "rope_theta", "norm_eps", "timestep_embed_dim")
NOT_IN_WEIGHTS = {"rope_theta": 1000.0, "norm_eps": 1e-5}


def is_original(names) -> bool:
    """Whether tensor names are a Krea 2 transformer file's: krea-ai's names (txtfusion.projector, as diffusers
    detects them) or diffusers' (text_fusion.projector), bare or under ComfyUI's prefix."""
    return any(_MARK.fullmatch(n) or _DIFFUSERS_MARK.fullmatch(n) for n in names)


def original_to_diffusers(weights: dict) -> dict:
    """A file's names -> diffusers' (lazy; diffusers' names pass through, the prefix stripped). Unchecked: the
    whole file was claimed by is_original before this key map is attached, and a streamed block's group
    (loading/streaming.py) holds its own names only."""
    return remap(under_prefix_if_present(weights, ORIGINAL_PREFIX), _ORIGINAL_RULES)


def _rope_axes(head_dim: int) -> list:
    """axes_dims_rope for a head size, split as Krea 2's (32, 48, 48) splits 128: a quarter for t, the rest in two
    equal even parts."""
    t = max(2, head_dim // 4 // 2 * 2)
    h = (head_dim - t) // 4 * 2
    return [t, h, head_dim - t - h]


def config_from_original(weights: dict) -> dict:
    """The diffusers config of a Krea 2 file from its shapes (either naming): widths, heads (q/k norm lengths),
    blocks, the text fusion's; axes_dims_rope as Krea 2 splits its heads when no folder gives it."""
    if not is_original(weights):
        raise MlxdiffError("not a Krea 2 transformer checkpoint: no txtfusion.projector.weight (krea-ai's names) or "
                           "text_fusion.projector.weight (diffusers')")
    w = original_to_diffusers(weights)
    what = "Krea 2 transformer"

    def shape(key, ndim=2):
        return required_shape(w, key, what, ndim)

    def count(pattern):
        found = sorted({int(m.group(1)) for k in w if (m := re.match(pattern, k))})
        if found != list(range(len(found))):
            raise MlxdiffError(f"{what} checkpoint: {pattern} indices are not 0..n-1 ({found[:8]}); the file is "
                               "damaged")
        return len(found)
    dim, in_channels = shape("img_in.weight")
    head_dim = shape("transformer_blocks.0.attn.norm_q.weight", 1)[0]
    kv_rows = shape("transformer_blocks.0.attn.to_k.weight")[0]
    text_dim = shape("txt_in.linear_1.weight")[1]
    text_layers = shape("text_fusion.projector.weight")[1]
    fusion = "text_fusion.layerwise_blocks.0." if "text_fusion.layerwise_blocks.0.attn.norm_q.weight" in w \
        else "text_fusion.refiner_blocks.0."
    text_head = shape(fusion + "attn.norm_q.weight", 1)[0]
    text_kv_rows = shape(fusion + "attn.to_k.weight")[0]
    if dim % head_dim or kv_rows % head_dim or text_dim % text_head or text_kv_rows % text_head:
        raise MlxdiffError(f"{what} checkpoint: the widths ({dim}, {text_dim}) are not whole heads of the q/k norms' "
                           f"lengths ({head_dim}, {text_head}); the file is damaged or another model's")
    return {**NOT_IN_WEIGHTS,
            "in_channels": in_channels,
            "num_layers": count(r"transformer_blocks\.(\d+)\."),
            "attention_head_dim": head_dim,
            "num_attention_heads": dim // head_dim,
            "num_key_value_heads": kv_rows // head_dim,
            "intermediate_size": shape("transformer_blocks.0.ff.gate.weight")[0],
            "timestep_embed_dim": shape("time_embed.linear_1.weight")[1],
            "text_hidden_dim": text_dim,
            "num_text_layers": text_layers,
            "text_num_attention_heads": text_dim // text_head,
            "text_num_key_value_heads": text_kv_rows // text_head,
            "text_intermediate_size": shape(fusion + "ff.gate.weight")[0],
            "num_layerwise_text_blocks": count(r"text_fusion\.layerwise_blocks\.(\d+)\."),
            "num_refiner_text_blocks": count(r"text_fusion\.refiner_blocks\.(\d+)\."),
            "axes_dims_rope": _rope_axes(head_dim)}


# LoRAs (lora/, the protocol's LoRADenoiser): diffusers / PEFT names are the model's own; krea-ai's original module
# names (the reference trainer's / ComfyUI's `diffusion_model.`, AI-Toolkit's `base_model.model.`) through these
# rules, as diffusers' _convert_non_diffusers_krea2_lora_to_diffusers maps them
LORA_NAME = "Krea 2 transformer"
LORA_ARCHITECTURE = "Krea 2"     # its label in lora.ARCHITECTURES
LORA_ORDER = 100     # its names match no earlier row
# the layer names that tell a LoRA is for it: (pattern, labels) rows of lora.ARCHITECTURES (lora/names.py tries
# them in the modules' LORA_ORDER, the first that a name matches saying which architectures it fits).
# In diffusers' and krea-ai's names: its text fusion, time projection, gated attention and SwiGLU
LORA_ARCHITECTURE_PATTERNS = (
    (re.compile(r"(^|[._])(text_fusion|txtfusion|time_mod_proj|tproj|attn[._](to_gate|wq|wk|wv|wo)|"
                r"transformer_blocks[._]\d+[._]ff[._](gate|up|down))([._]|$)"), (LORA_ARCHITECTURE,)),)


def lora_original_rules(args) -> list:
    """The original-name table itself (LoRA layer names + ".weight" are matched against it; lora/ strips the
    `diffusion_model.` / `base_model.model.` prefixes)."""
    return _ORIGINAL_RULES
