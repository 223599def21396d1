"""Qwen-Image 2.1 transformer: diffusers' QwenImage21Transformer2DModel (models/transformers/transformer_qwenimage21.py)
in MLX.

A single-stream transformer over one joint sequence: the Qwen3-VL prompt states (txt_in: zero-centred RMSNorm,
Linear, GELU-tanh, Linear) with each condition image's latent tokens substituted at the image slots the encoder
reserved for it (one slot = 2x2 latent tokens), then the target image's tokens. One shared modulation
(Linear(silu(temb)) -> [scale1, gate1, scale2, gate2]) feeds every block: affine-free LayerNorm * (1 + scale),
q/k-RMSNormed attention with a 3-axis interleaved RoPE, tanh(gate) residuals, a SwiGLU MLP; the output norm is
scale-only. No biases anywhere.

Attention is block-causal: `(q >= kv) or same image block`, so text is causal, each image block bidirectional, and
the target image (last) sees everything. Nothing before the target attends to it, so the prefix (text and condition
images) never depends on the target; with `causal_condition` the prefix is modulated from t = 0 and does not depend
on the step either. This module therefore runs the prefix and the target as two streams through each block: the
prefix with its block-causal mask, the target attending to [prefix keys; its own keys]. That is diffusers'
computation split where its masks already split it, and it is what diffusers' QwenImage21KVCache exploits: a
PrefixCache here keeps each block's prefix keys / values (after RoPE), so later steps run only the target stream
(diffusers' kv_cache_mode "cached"). Without a cache (or without causal_condition) every call runs both streams.

RoPE positions (QwenImage21Rope): text tokens advance one position on all three axes; an image block freezes the
frame axis at the position reached, lays its rows / columns centred on 0, and advances the position by max(h, w).
"""

import re
from dataclasses import dataclass

import numpy as np

from .. import backend  # noqa: F401  (OpenBLAS preload before mlx)
import mlx.core as mx
import mlx.nn as nn

from ..config_checks import MAX_WIDTH, Rule, between, positive
from ..errors import MlxdiffError
from ..formats.keymaps import compile_rules, remap, required_shape
from ..pacing import pace
from .embeddings import TimestepEmbedding, timestep_embedding
from .flux2 import apply_rope, clip_fp16, rope_tables
from .fused import attention, compiled_block, gated_residual, through
from .krea2 import RMSNorm as ZeroCenteredRMSNorm
from .qwenimage import TransformerArgs

ROPE_THETA = 10000           # QwenImage21Rope(theta=10000): fixed in diffusers
TOKENS_PER_SLOT = 4          # one vision-language image slot = a 2x2 group of latent tokens
MAX_POSITION = 8192          # QwenImage21Rope's tables: positions 0..8191 ...
MAX_NEGATIVE = 1024          # ... and -1024..-1 per axis

CLASS_NAMES = ("QwenImage21Transformer2DModel",)   # diffusers' class: its key in models/registry.ARCHITECTURES


@dataclass
class ModelArgs(TransformerArgs):
    # defaults: diffusers' QwenImage21Transformer2DModel (Qwen-Image 2.1's transformer/config.json)
    patch_size: int = 1
    in_channels: int = 64
    out_channels: int | None = 64            # None: same as in_channels
    num_layers: int = 32
    attention_head_dim: int = 128
    num_attention_heads: int = 32
    context_in_dim: int = 4096
    mlp_ratio: int = 3
    axes_dims_rope: tuple[int, ...] = (16, 56, 56)
    eps: float = 1e-6
    causal_condition: bool = True

    WHAT = "Qwen-Image 2.1 transformer config"
    LIMITS = {**TransformerArgs.SHARED_LIMITS, "context_in_dim": between(1, MAX_WIDTH), "mlp_ratio": between(1, 64),
              "eps": positive(1)}
    RULES = (
        TransformerArgs.ROPE_RULE,
        Rule("num_attention_heads", lambda a: a.num_attention_heads * a.attention_head_dim * a.mlp_ratio <= MAX_WIDTH,
             lambda a: f"num_attention_heads * attention_head_dim * mlp_ratio (the MLP width) must be at most "
                       f"{MAX_WIDTH}"),
    )


# -- the joint sequence ----------------------------------------------------------------------------------------------

@dataclass
class Layout:
    """Where every token of the joint sequence comes from, host-side (numpy), the same for every step of a run.

    gather: (total,) indices into [projected text (L_vlm); projected latents (N)] (the padding mask gathers the
    same way); image_ids: (total,) -1 at text, a block number per image; prefix: the tokens before the target
    image; positions: (total, 3) RoPE ids."""
    gather: np.ndarray
    image_ids: np.ndarray
    prefix: int
    positions: np.ndarray

    @property
    def total(self) -> int:
        return len(self.gather)


def image_grids(img_shapes) -> tuple:
    """(frame, height, width) token grids, condition images first and the target last: a list of 3-tuples, or
    diffusers' per-batch-row list of such lists (its first row serves the whole batch, as diffusers)."""
    shapes = img_shapes
    if isinstance(shapes, (list, tuple)) and shapes and isinstance(shapes[0], (list, tuple)) \
            and shapes[0] and isinstance(shapes[0][0], (list, tuple)):
        shapes = shapes[0]
    try:
        out = tuple(tuple(int(v) for v in s) for s in shapes)
    except (TypeError, ValueError):
        raise MlxdiffError(f"img_shapes must be a list of (frame, height, width) token grids, got {img_shapes!r}")
    if not out or any(len(s) != 3 or min(s) < 1 for s in out):
        raise MlxdiffError(f"img_shapes must be a list of (frame, height, width) token grids, got {img_shapes!r}")
    return out


def joint_layout(img_mask, grids, n_vlm: int, n_latents: int) -> Layout:
    """The transformer's forward up to the blocks, as indices: each True of img_mask (row 0: samples share a layout,
    as diffusers) stands for 4 latent tokens, filled in order with the latents; build_token_metadata's blocks from
    the grids' token counts; QwenImage21Rope's positions."""
    slots = np.asarray(img_mask).astype(bool)
    slots = slots[0] if slots.ndim == 2 else slots
    lengths = [f * h * w for f, h, w in grids]
    if slots.ndim != 1 or slots.shape[0] < n_vlm or slots[n_vlm:].sum() != slots[n_vlm:].size:
        raise MlxdiffError(f"img_mask has shape {np.asarray(img_mask).shape}; expected (batch, {n_vlm} text encoder "
                           "positions + one slot per 2x2 target tokens), True at image slots")
    if int(slots.sum()) * TOKENS_PER_SLOT != sum(lengths) or sum(lengths) != n_latents:
        raise MlxdiffError(f"img_mask has {int(slots.sum())} image slots ({TOKENS_PER_SLOT} tokens each), img_shapes "
                           f"{list(grids)} {sum(lengths)} tokens and hidden_states {n_latents}: they must agree")
    is_image = np.repeat(slots, np.where(slots, TOKENS_PER_SLOT, 1))
    total = is_image.shape[0]
    gather = np.empty(total, np.int64)
    gather[~is_image] = np.nonzero(~slots)[0]
    gather[is_image] = n_vlm + np.arange(n_latents)
    image_ids = np.full(total, -1, np.int64)
    image_ids[is_image] = np.repeat(np.arange(len(lengths)), lengths)
    target_start = np.nonzero(is_image)[0][-lengths[-1]]
    if not is_image[target_start:].all():
        raise MlxdiffError("img_mask: the target image's slots must come last (after every text position)")
    # QwenImage21Rope.forward
    frame = np.empty(total, np.int64)
    rows = frame.copy()
    cols = frame.copy()
    cursor = position = 0
    for _, h, w in grids:
        start = cursor + int(np.argmax(is_image[cursor:]))
        frame[cursor:start] = np.arange(position, position + start - cursor)
        rows[cursor:start] = cols[cursor:start] = frame[cursor:start]
        position += start - cursor
        n = h * w
        frame[start:start + n] = position
        rows[start:start + n] = np.repeat(np.arange(h) - (h - h // 2), w)
        cols[start:start + n] = np.tile(np.arange(w) - (w - w // 2), h)
        position += max(h, w)
        cursor = start + n
    if cursor < total:
        frame[cursor:] = rows[cursor:] = cols[cursor:] = np.arange(position, position + total - cursor)
    ids = np.stack([frame, rows, cols], axis=1)
    if ids.max() >= MAX_POSITION or ids.min() < -MAX_NEGATIVE:
        raise MlxdiffError(f"the prompt ({n_vlm} tokens) and images {list(grids)} reach past Qwen-Image 2.1's RoPE "
                           f"positions ({-MAX_NEGATIVE}..{MAX_POSITION - 1}); use a shorter prompt or smaller images")
    return Layout(gather, image_ids, int(target_start), ids)


def prefix_mask(layout: Layout) -> np.ndarray:
    """(prefix, prefix) bool: (q >= kv) or the same image block (build_qwenimage21_block_causal_mask)."""
    ids = layout.image_ids[:layout.prefix]
    n = layout.prefix
    causal = np.arange(n)[:, None] >= np.arange(n)[None, :]
    return causal | ((ids[:, None] == ids[None, :]) & (ids[:, None] >= 0))


class PrefixCache:
    """QwenImage21KVCache: each block's prefix keys and values (after RoPE) from the first call, for the prompt and
    condition images it was made with. Valid across steps only under causal_condition (the pipeline's
    use_kv_cache); one per prompt (the negative prompt has its own)."""

    def __init__(self):
        self.layers = []

    @property
    def filled(self) -> bool:
        return bool(self.layers)


# -- blocks ----------------------------------------------------------------------------------------------------------

class TextProjection(nn.Module):
    """QwenImage21TextProjection: zero-centred RMSNorm, Linear, GELU-tanh, Linear (no biases)."""

    def __init__(self, context_dim: int, dim: int, eps: float):
        super().__init__()
        self.text_norm = ZeroCenteredRMSNorm(context_dim, eps)
        self.in_layer = nn.Linear(context_dim, dim, bias=False)
        self.out_layer = nn.Linear(dim, dim, bias=False)

    def __call__(self, x):
        return self.out_layer(nn.gelu_approx(self.in_layer(self.text_norm(x))))


class TimestepProjEmbeddings(nn.Module):
    """QwenImage21TimestepProjEmbeddings: cos-first sinusoid_256 of 1000 t, then an MLP without biases."""

    def __init__(self, dim: int):
        super().__init__()
        self.timestep_embedder = TimestepEmbedding(256, dim, bias=False)

    def __call__(self, timestep, dtype):
        # QwenImage21TemporalTimesteps multiplies by 1000 before the frequencies (Qwen-Image's after): the
        # rounding differs by ~6e-5 rad at t ~ 1000
        t = timestep_embedding(timestep.astype(mx.float32) * 1000, 256, flip_sin_to_cos=True, downscale_freq_shift=0)
        return self.timestep_embedder(t.astype(dtype))


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.proj = nn.Linear(dim, hidden, bias=False)
        self.gate_layer = nn.Linear(dim, hidden, bias=False)
        self.out = nn.Linear(hidden, dim, bias=False)

    def __call__(self, x):
        return self.out(pace(nn.silu(self.gate_layer(x)) * self.proj(x)))


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, head_dim: int, eps: float):
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        inner = heads * head_dim
        self.to_q = nn.Linear(dim, inner, bias=False)
        self.to_k = nn.Linear(dim, inner, bias=False)
        self.to_v = nn.Linear(dim, inner, bias=False)
        self.to_out = [nn.Linear(inner, dim, bias=False)]
        self.norm_q = nn.RMSNorm(head_dim, eps=eps)
        self.norm_k = nn.RMSNorm(head_dim, eps=eps)

    def qkv(self, x, cos, sin):
        """(B, H, S, hd) q, k (normed, RoPE'd) and v."""
        b, s, _ = x.shape

        def heads(y):
            return y.reshape(b, s, self.heads, self.head_dim).transpose(0, 2, 1, 3)
        q = apply_rope(self.norm_q(heads(self.to_q(x))), cos, sin)
        k = apply_rope(self.norm_k(heads(self.to_k(x))), cos, sin)
        return q, k, heads(self.to_v(x))

    def out(self, o):
        b, _, s, _ = o.shape
        return self.to_out[0](o.transpose(0, 2, 1, 3).reshape(b, s, -1))


def _layer_norm(x, eps):
    return mx.fast.layer_norm(x, None, None, eps)


class TransformerBlock(nn.Module):
    """QwenImage21TransformerBlock for the target stream (__call__) and the prefix stream (`prefix`): both read
    their scales / gates from the shared modulation, (B|1, 4D) = [scale1, gate1, scale2, gate2]."""

    def __init__(self, dim: int, heads: int, head_dim: int, mlp_ratio: int, eps: float):
        super().__init__()
        self.eps = eps
        self.attn = Attention(dim, heads, head_dim, eps)
        self.img_mlp = SwiGLU(dim, dim * mlp_ratio)

    def _attn_in(self, h, mod):
        scale, gate = mx.split(mod, 4, axis=-1)[:2]
        return _layer_norm(h, self.eps) * (1 + scale[:, None]), gate

    def _finish(self, h, attn_out, gate1, mod):
        scale2, gate2 = mx.split(mod, 4, axis=-1)[2:]
        h = gated_residual(h, mx.tanh(gate1)[:, None], attn_out)
        ff = self.img_mlp(_layer_norm(h, self.eps) * (1 + scale2[:, None]))
        return clip_fp16(pace(gated_residual(h, mx.tanh(gate2)[:, None], ff)))

    def prefix(self, p, mod, cos, sin, mask):
        """The prefix stream: block-causal self-attention. -> (p, (k, v)) with the keys / values for the target."""
        x, gate1 = self._attn_in(p, mod)
        q, k, v = self.attn.qkv(x, cos, sin)
        o = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.attn.head_dim ** -0.5, mask=mask)
        return self._finish(p, self.attn.out(o), gate1, mod), (k, v)

    def __call__(self, h, mod, cos, sin, key_mask, prefix_kv):
        """The target stream: attends to [prefix; target] (all of it: the block-causal mask is full for its rows)."""
        x, gate1 = self._attn_in(h, mod)
        q, k, v = self.attn.qkv(x, cos, sin)
        if prefix_kv is not None:
            k = mx.concatenate([prefix_kv[0], k], axis=2)
            v = mx.concatenate([prefix_kv[1], v], axis=2)
        o = attention(q, k, v, self.attn.head_dim ** -0.5, key_mask)
        return self._finish(h, self.attn.out(o), gate1, mod)


class AdaLayerNormContinuous(nn.Module):
    """QwenImage21AdaLayerNormContinuous: LayerNorm(h) * (1 + Linear(silu(temb))), scale only."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.linear = nn.Linear(dim, dim, bias=False)

    def __call__(self, h, temb):
        scale = self.linear(nn.silu(temb))
        return _layer_norm(h, self.eps) * (1 + scale[:, None])


# embedders, the shared modulation and the output layers stay in full precision (loading/quantize.py)
FULL_PRECISION = re.compile(r"(img_in|txt_in\..*|time_text_embed\..*|modulation\.1|norm_out\.linear|proj_out)")


class Model(nn.Module):
    """QwenImage21Transformer2DModel.

    __call__(hidden_states (B, N, C) latents (condition images' then the target's, unpatched), encoder_hidden_states
    (B, L_vlm, context_in_dim) the Qwen3-VL states (condition images' slots included), timestep (B,) = sigma in
    [0, 1], img_shapes: the (frame, height, width) token grid of each image in order (target last; diffusers'
    per-row list of lists also taken), img_mask (B, L_vlm + N_target / 4): True at image slots (the pipeline's
    image_pad_mask with the target's slots appended), encoder_hidden_states_mask (B, L_vlm) bool / 0-1 or None)
    -> (B, N_target, patch^2 * C_out): the target image's tokens, the rows the pipeline reads of diffusers' output.

    kv_cache: a PrefixCache; empty, it is filled (diffusers' kv_cache_mode "extract"); filled, the prefix is not
    run again ("cached"). It needs causal_condition, as diffusers. `after_block(h)`: the caller's memory policy,
    after every block (h: the target stream); step_cache (a first-block cache, pipelines/step_cache.py) and
    stream_dtype as flux2.Model.
    """

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.compute_dtype = mx.float32
        dim, p = args.width, args.patch_size
        self.time_text_embed = TimestepProjEmbeddings(dim)
        self.txt_in = TextProjection(args.context_in_dim, dim, args.eps)
        self.img_in = nn.Linear(args.in_channels * p * p, dim, bias=False)
        self.modulation = [nn.SiLU(), nn.Linear(dim, 4 * dim, bias=False)]
        self.transformer_blocks = [TransformerBlock(dim, args.num_attention_heads, args.attention_head_dim,
                                                    args.mlp_ratio, args.eps) for _ in range(args.num_layers)]
        self.norm_out = AdaLayerNormContinuous(dim, args.eps)
        self.proj_out = nn.Linear(dim, p * p * (args.out_channels or args.in_channels), bias=False)

    def layout(self, img_mask, img_shapes, n_vlm, n_latents):
        """joint_layout and its RoPE tables, kept on the model for the same inputs (every step of a run)."""
        mask = np.asarray(img_mask).astype(bool)
        grids = image_grids(img_shapes)
        key = (mask[0].tobytes() if mask.ndim == 2 else mask.tobytes(), mask.shape[-1], grids, n_vlm, n_latents)
        cached = self.__dict__.get("_layout_cache")
        if cached is None or cached[0] != key:
            layout = joint_layout(mask, grids, n_vlm, n_latents)
            cos, sin = rope_tables(layout.positions, self.args.axes_dims_rope, ROPE_THETA)
            pmask = mx.array(prefix_mask(layout))
            cached = (key, (layout, cos, sin, pmask))
            self.__dict__["_layout_cache"] = cached
        return cached[1]

    def __call__(self, hidden_states, encoder_hidden_states, timestep, img_shapes, img_mask,
                 encoder_hidden_states_mask=None, kv_cache=None, after_block=None, step_cache=None, stream_dtype=None):
        args = self.args
        dtype = self.compute_dtype
        stream = stream_dtype or dtype
        b, n_latents = hidden_states.shape[:2]
        n_vlm = encoder_hidden_states.shape[1]
        if encoder_hidden_states.ndim != 3 or encoder_hidden_states.shape[-1] != args.context_in_dim:
            raise MlxdiffError(f"encoder_hidden_states has shape {tuple(encoder_hidden_states.shape)}; expected "
                               f"(batch, text tokens, {args.context_in_dim})")
        if kv_cache is not None and not args.causal_condition:
            raise MlxdiffError("kv_cache needs causal_condition=True in the transformer's config (the prefix is then "
                               "modulated from t=0 and the same at every step); run without the cache")
        layout, cos, sin, pmask = self.layout(img_mask, img_shapes, n_vlm, n_latents)
        n_pre = layout.prefix
        n_target = layout.total - n_pre

        key_valid = None
        if encoder_hidden_states_mask is not None:
            if tuple(encoder_hidden_states_mask.shape) != (b, n_vlm):
                raise MlxdiffError(f"encoder_hidden_states_mask has shape {tuple(encoder_hidden_states_mask.shape)}; "
                                   f"expected (batch, text tokens) = ({b}, {n_vlm})")
            key_valid = mx.concatenate([mx.array(encoder_hidden_states_mask).astype(mx.bool_),
                                        mx.ones((b, n_latents), mx.bool_)], axis=1)[:, mx.array(layout.gather)]

        timestep = timestep if isinstance(timestep, mx.array) else mx.array(np.asarray(timestep, np.float32))
        timestep = mx.broadcast_to(timestep.reshape(-1), (b,)).astype(dtype)
        if args.causal_condition:      # an extra t = 0 row: the prefix's modulation
            timestep = mx.concatenate([timestep, mx.zeros((1,), dtype)])
        temb = self.time_text_embed(timestep, dtype)
        modulation = self.modulation[1](nn.silu(temb))
        mod_target = modulation[:b]
        mod_prefix = modulation[b:] if args.causal_condition else modulation

        cached = kv_cache is not None and kv_cache.filled
        x = self.img_in(hidden_states.astype(dtype))
        if cached:
            h = x[:, n_latents - n_target:].astype(stream)
            prefix = None
        else:
            context = self.txt_in(encoder_hidden_states.astype(dtype))
            joint = mx.concatenate([context, x], axis=1)[:, mx.array(layout.gather)]
            prefix, h = joint[:, :n_pre].astype(stream), joint[:, n_pre:].astype(stream)
            mask_p = pmask[None, None]
            if key_valid is not None:
                mask_p = mask_p & key_valid[:, None, None, :n_pre]
        key_mask = None if key_valid is None else key_valid[:, None, None, :]
        cos_p, sin_p, cos_t, sin_t = cos[:n_pre], sin[:n_pre], cos[n_pre:], sin[n_pre:]
        if kv_cache is not None and not cached:
            kv_cache.layers = []
        head = None
        for i, block in enumerate(self.transformer_blocks):
            if cached:
                kv = kv_cache.layers[i]
            elif n_pre:
                # the class's method, not type(block)'s: a streamed block is a StreamedBlock wrapping one
                prefix, kv = through(block, TransformerBlock.prefix, prefix, mod_prefix, cos_p, sin_p, mask_p)
                if kv_cache is not None:
                    kv_cache.layers.append(kv)
            else:
                kv = None
            h_in = h
            h = compiled_block(block, h, mod_target, cos_t, sin_t, key_mask, kv)
            if after_block:
                after_block(h)
            # the first-block cache (pipelines/step_cache.py) never skips the first forward, which fills kv_cache
            if i == 0 and step_cache is not None:
                reused = step_cache.reuse(h - h_in)
                if reused is not None:
                    return self.proj_out(self.norm_out(h + reused, temb[:b]))
                head = h
        if step_cache is not None:
            step_cache.remember(h - head)
        return self.proj_out(self.norm_out(h, temb[:b]))

    def resident_blocks(self) -> tuple:
        """loading/streaming.plan: the shared modulation's linear ("modulation.1", indexed like a block) is one
        layer run before the blocks, never streamed (a LoRA on it wraps the layer itself)."""
        return ("modulation.1",)

    def quant_predicate(self, path, module) -> bool:
        """Which layers may be quantized: not the embedders, the shared modulation or the output layers."""
        return not FULL_PRECISION.fullmatch(path)

    def sanitize(self, weights: dict) -> dict:
        """diffusers' names and layouts are this module's own."""
        return dict(weights)


# -- single files: ComfyUI's names (diffusers' convert_qwen_image21_transformer_checkpoint_to_diffusers) ------------
# diffusers' names, bare or under `model.diffusion_model.`, except each block's SwiGLU gate and up projections fused
# into one `img_mlp.gate_up.weight` (gate rows first)

ORIGINAL_PREFIX = "model.diffusion_model."
_P = r"(?:model\.diffusion_model\.)?"
ORIGINAL_KEYMAP = [
    (_P + r"(transformer_blocks\.\d+\.img_mlp)\.gate_up\.weight", (r"\1.gate_layer.weight", r"\1.proj.weight")),
    (_P + r"(.+)", r"\1"),
]
_ORIGINAL_RULES = compile_rules(ORIGINAL_KEYMAP)
_MARK = re.compile(_P + r"txt_in\.text_norm\.weight")
FROM_BASE_CONFIG = ("axes_dims_rope", "eps", "causal_condition", "patch_size")


def is_original(names) -> bool:
    """Whether tensor names are a Qwen-Image 2.1 transformer file's (either naming): its zero-centred text norm."""
    return any(_MARK.fullmatch(n) for n in names)


def original_to_diffusers(weights: dict) -> dict:
    """A file's names -> diffusers' (lazy; the fused gate_up split by rows). Unchecked: the whole file was claimed
    by is_original before this key map is attached, and a streamed block's group (loading/streaming.py) holds its
    own names only."""
    return remap(weights, _ORIGINAL_RULES)


def config_from_original(weights: dict) -> dict:
    """The diffusers config of a Qwen-Image 2.1 file from its shapes (patch_size 1, axes_dims_rope split as
    (16, 56, 56) splits 128 when no folder gives them)."""
    if not is_original(weights):
        raise MlxdiffError("not a Qwen-Image 2.1 transformer checkpoint: no txt_in.text_norm.weight")
    w = {k[len(ORIGINAL_PREFIX):] if k.startswith(ORIGINAL_PREFIX) else k: v for k, v in weights.items()}
    what = "Qwen-Image 2.1 transformer"

    def shape(key, ndim=2):
        return required_shape(w, key, what, ndim)
    dim, in_channels = shape("img_in.weight")
    head_dim = shape("transformer_blocks.0.attn.norm_q.weight", 1)[0]
    layers = sorted({int(m.group(1)) for k in w if (m := re.match(r"transformer_blocks\.(\d+)\.", k))})
    if layers != list(range(len(layers))) or dim % head_dim:
        raise MlxdiffError(f"{what} checkpoint: blocks {layers[:8]} / width {dim} of heads {head_dim}: the file is "
                           "damaged or another model's")
    fused = "transformer_blocks.0.img_mlp.gate_up.weight"
    hidden = shape(fused)[0] // 2 if fused in w else shape("transformer_blocks.0.img_mlp.gate_layer.weight")[0]
    t = max(2, head_dim // 8 // 2 * 2)
    h = (head_dim - t) // 4 * 2
    return {"patch_size": 1, "in_channels": in_channels, "out_channels": shape("proj_out.weight")[0],
            "num_layers": len(layers), "attention_head_dim": head_dim, "num_attention_heads": dim // head_dim,
            "context_in_dim": shape("txt_in.in_layer.weight")[1], "mlp_ratio": hidden // dim,
            "axes_dims_rope": [t, h, head_dim - t - h]}


# LoRAs (lora/, the protocol's LoRADenoiser): diffusers / PEFT names are the model's own (ComfyUI's and musubi's
# `diffusion_model.` prefixes are lora/'s to strip); kohya's `lora_unet_<ComfyUI name, dots as underscores>` (what
# ComfyUI's model_lora_keys_unet maps for every diffusion_model weight) reach them through lora/'s folded names
LORA_NAME = "Qwen-Image 2.1 transformer"
LORA_ARCHITECTURE = "Qwen-Image 2.1"     # its label in lora.ARCHITECTURES
LORA_ORDER = 80     # before Qwen-Image's, whose img_mlp row its names also match
# the layer names that tell a LoRA is for it: (pattern, labels) rows of lora.ARCHITECTURES (lora/names.py tries
# them in the modules' LORA_ORDER, the first that a name matches saying which architectures it fits).
# In diffusers' names: its bias-free SwiGLU (img_mlp.proj / gate_layer / out, ComfyUI's gate_up) and text projection
# (Qwen-Image's MLP is img_mlp.net.*; tried before Qwen-Image's, whose img_mlp they also match)
LORA_ARCHITECTURE_PATTERNS = (
    (re.compile(r"(^|[._])(transformer_blocks[._]\d+[._]img_mlp[._](proj|gate_layer|gate_up|out)|"
                r"txt_in[._](in_layer|out_layer|text_norm))([._]|$)"), (LORA_ARCHITECTURE,)),)
# the released checkpoint's (and ComfyUI's) fused SwiGLU: a LoRA on it is one lora_down for both halves and a
# lora_up whose rows are the gate's then the up projection's, as ORIGINAL_KEYMAP splits the weight
_LORA_RULES = compile_rules([
    (r"transformer_blocks\.(\d+)\.img_mlp\.gate_up\.weight",
     (r"transformer_blocks.\1.img_mlp.gate_layer.weight", r"transformer_blocks.\1.img_mlp.proj.weight")),
])


def lora_original_rules(args) -> list:
    return _LORA_RULES
