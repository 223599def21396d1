"""FLUX.2 transformer: diffusers' Flux2Transformer2DModel (models/transformers/transformer_flux2.py) in MLX.

Attribute names mirror diffusers, so a diffusers checkpoint loads as it is (sanitize changes nothing: there are no
convolutions). Black Forest Labs' original names (the BFL / ComfyUI single files and the GGUF files made from them,
with or without `model.diffusion_model.`) go through ORIGINAL_KEYMAP; `config_from_original` reads the config of such
a file from its shapes (klein files come without a config).

Structure: 4-axis RoPE (T, H, W, L position ids; theta 2000; adjacent pairs rotated), one modulation linear per stream
shared by all blocks, SwiGLU feed-forwards, qk RMSNorm, no biases anywhere, text tokens first in the joint sequence.
"""

import re
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

import mlx.core as mx
import mlx.nn as nn

from ..config_checks import MAX_HEAD_DIM, MAX_HEADS, MAX_LAYERS, MAX_WIDTH, CheckedArgs, Rule, between, positive
from ..errors import MlxdiffError
from ..formats.keymaps import compile_rules, remap, required_shape, under_prefix_if_present
from ..formats.quantized import linear_rows
from ..pacing import pace
from ..policy import current
from .embeddings import TimestepEmbedding, timestep_embedding
from .fused import (attention as fused_attention, compiled_block, cuda_kernels, double_stream, fused, gated_residual,
                    norm_modulate, norm_rope)
from .sharding import GatheredLinear, check_divides, shard_layer


def block_limits(timestep_key: str) -> dict:
    """The LIMITS of the keys FLUX.2's transformer config shares with FLUX 3's (whose timestep embedding width is
    `timestep_channels`, FLUX.2's `timestep_guidance_channels`: `timestep_key`)."""
    return {
        "in_channels": between(1, MAX_WIDTH),
        "num_layers": between(0, MAX_LAYERS),
        "num_single_layers": between(0, MAX_LAYERS),
        "attention_head_dim": between(1, MAX_HEAD_DIM),
        "num_attention_heads": between(1, MAX_HEADS),
        "joint_attention_dim": between(1, MAX_WIDTH),
        timestep_key: between(2, MAX_WIDTH),
        "mlp_ratio": positive(16),
        "axes_dims_rope": between(2, MAX_HEAD_DIM, items=(4, 4)),   # the T, H, W, L position axes
        "rope_theta": positive(1e12),
        "eps": positive(1),
    }


def block_rules(timestep_key: str) -> tuple:
    """The RULES of FLUX.2's transformer config, which FLUX 3's shares (`timestep_key`: as block_limits)."""
    return (
        Rule("axes_dims_rope", lambda a: sum(a.axes_dims_rope) == a.attention_head_dim
             and not any(d % 2 for d in a.axes_dims_rope),
             lambda a: f"expected even numbers summing to attention_head_dim {a.attention_head_dim}"),
        Rule(timestep_key, lambda a: getattr(a, timestep_key) % 2 == 0,
             lambda a: "expected an even number (sin and cos halves)"),
        Rule("num_attention_heads", lambda a: a.num_attention_heads * a.attention_head_dim <= MAX_WIDTH,
             lambda a: f"num_attention_heads * attention_head_dim (the width) must be at most {MAX_WIDTH}"),
        Rule("mlp_ratio", lambda a: 1 <= int(a.num_attention_heads * a.attention_head_dim * a.mlp_ratio)
             <= 4 * MAX_WIDTH,
             lambda a: f"the MLP width int(width * mlp_ratio) must be 1 to {4 * MAX_WIDTH}"),
        Rule("num_single_layers", lambda a: a.num_layers + a.num_single_layers > 0,
             lambda a: "num_layers and num_single_layers are both 0; a transformer needs at least one block"),
    )


CLASS_NAMES = ("Flux2Transformer2DModel",)   # diffusers' class: its key in models/registry.ARCHITECTURES


@dataclass
class ModelArgs(CheckedArgs):
    # defaults: FLUX.2-dev (black-forest-labs/FLUX.2-dev transformer/config.json = diffusers' class defaults)
    patch_size: int = 1
    in_channels: int = 128
    out_channels: int | None = None          # None: same as in_channels
    num_layers: int = 8                      # double-stream blocks
    num_single_layers: int = 48
    attention_head_dim: int = 128
    num_attention_heads: int = 48
    joint_attention_dim: int = 15360
    timestep_guidance_channels: int = 256
    mlp_ratio: float = 3.0
    axes_dims_rope: tuple[int, ...] = (32, 32, 32, 32)
    rope_theta: float = 2000
    eps: float = 1e-6
    guidance_embeds: bool = True

    WHAT = "FLUX.2 transformer config"
    LIMITS = {"patch_size": between(1, 16), "out_channels": between(1, MAX_WIDTH),
              **block_limits("timestep_guidance_channels")}
    RULES = block_rules("timestep_guidance_channels")

    def __post_init__(self):
        self.axes_dims_rope = tuple(self.axes_dims_rope)


# -- position and time -------------------------------------------------------------------------------------------

def rope_tables(ids, axes_dims, theta) -> tuple:
    """(L, n_axes>=len(axes_dims)) position ids -> (cos, sin), each (L, sum(axes_dims)) float32.

    As diffusers' Flux2PosEmbed: per axis i, frequencies 1 / theta^(2j / d_i), angles pos * freq in float64,
    every cos/sin value repeated twice (the rotated pairs are adjacent channels), axes concatenated.
    Computed with numpy in float64 (like diffusers) because positions reach ~512 and float32 angles would be ~3e-5 off.
    """
    pos = np.asarray(ids).astype(np.float32).astype(np.float64)
    cos, sin = [], []
    for i, dim in enumerate(axes_dims):
        freqs = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
        angles = np.outer(pos[:, i], freqs)
        cos.append(np.repeat(np.cos(angles), 2, axis=1))
        sin.append(np.repeat(np.sin(angles), 2, axis=1))
    return (mx.array(np.concatenate(cos, axis=1).astype(np.float32)),
            mx.array(np.concatenate(sin, axis=1).astype(np.float32)))


def cached_rope(model, img_ids, txt_ids, axes_dims, theta, at_least=False):
    """rope_tables of [txt_ids; img_ids] ((tokens, axes) each; a batch axis is allowed and element 0 used, as
    diffusers), computed once per set of ids and kept on `model` (the same ids at every step of a run: float64
    numpy, ~5 ms at 4608 tokens). `at_least`: the ids may carry more axes than the table uses (FLUX.2's)."""
    ids = []
    for name, x in (("txt_ids", txt_ids), ("img_ids", img_ids)):
        x = np.asarray(x)
        x = x[0] if x.ndim == 3 else x
        if x.ndim != 2 or (x.shape[-1] < len(axes_dims) if at_least else x.shape[-1] != len(axes_dims)):
            raise MlxdiffError(f"{name} must be (batch, tokens, {len(axes_dims)}) position ids, got shape "
                               f"{np.asarray(x).shape}")
        ids.append(x)
    ids = np.ascontiguousarray(np.concatenate(ids, axis=0))
    key = (ids.shape, ids.dtype.str, ids.tobytes())
    cached = model.__dict__.get("_rope_cache")
    if cached is None or cached[0] != key:
        cached = (key, rope_tables(ids, axes_dims, theta))
        model.__dict__["_rope_cache"] = cached
    return cached[1]


@fused
def apply_rope(x, cos, sin):
    """x (B, H, S, hd); pairs (x0, x1), (x2, x3), ... rotate: (x0, x1) -> (x0 cos - x1 sin, x1 cos + x0 sin).
    The arithmetic is float32 whatever x's dtype (diffusers' apply_rotary_emb), then cast back."""
    pairs = x.reshape(*x.shape[:-1], -1, 2)
    rotated = mx.stack([-pairs[..., 1], pairs[..., 0]], axis=-1).reshape(x.shape)
    return (x.astype(mx.float32) * cos + rotated.astype(mx.float32) * sin).astype(x.dtype)


def scaled_time(values, dtype) -> mx.array:
    """diffusers' `timestep.to(hidden_states.dtype) * 1000` (the same for guidance): in bfloat16 both the cast and
    the product round, so sigma 0.99731 embeds as t=996 and guidance 2.5 as 2496 (flux2.md section 7)."""
    values = values if isinstance(values, mx.array) else mx.array(np.asarray(values, dtype=np.float32))
    return values.reshape(-1).astype(dtype) * 1000


class TimestepGuidanceEmbeddings(nn.Module):
    """Flux2TimestepGuidanceEmbeddings: sinusoid(256) -> MLP for the timestep, plus the same for guidance (dev)."""

    def __init__(self, channels: int, dim: int, guidance_embeds: bool):
        super().__init__()
        self.channels = channels
        self.timestep_embedder = TimestepEmbedding(channels, dim, bias=False)
        self.guidance_embedder = TimestepEmbedding(channels, dim, bias=False) if guidance_embeds else None

    def _embed(self, embedder, t):
        # the sinusoid is float32, then cast to the (scaled) timestep's dtype before the MLP, as diffusers
        return embedder(timestep_embedding(t, self.channels, flip_sin_to_cos=True, downscale_freq_shift=0)
                        .astype(t.dtype))

    def __call__(self, timestep, guidance=None):
        temb = self._embed(self.timestep_embedder, timestep)
        if guidance is not None and self.guidance_embedder is not None:
            temb = temb + self._embed(self.guidance_embedder, guidance)
        return temb


class ModulationOut(NamedTuple):
    """One modulation triple, each (B, 1, D): x -> norm(x) * (1 + scale) + shift, and the residual's gate."""
    shift: mx.array
    scale: mx.array
    gate: mx.array


class Modulation(nn.Module):
    """Flux2Modulation: linear(silu(temb)) -> `sets` ModulationOut triples."""

    def __init__(self, dim: int, sets: int):
        super().__init__()
        self.sets = sets
        self.linear = nn.Linear(dim, 3 * sets * dim, bias=False)

    def __call__(self, temb):
        chunks = mx.split(self.linear(nn.silu(temb))[:, None], 3 * self.sets, axis=-1)
        return [ModulationOut(*chunks[3 * i:3 * i + 3]) for i in range(self.sets)]


# -- blocks --------------------------------------------------------------------------------------------------------

def layer_norm(x, eps):
    """LayerNorm without affine parameters (every norm outside attention in this model)."""
    return mx.fast.layer_norm(x, None, None, eps)


def modulate(x, mod: ModulationOut, eps):
    """norm(x) * (1 + scale) + shift, in the modulation's dtype (the compute dtype; x may be a wider stream)."""
    return norm_modulate(x, mod.scale, mod.shift, eps)


@fused
def silu_gate(gate, value):
    return nn.silu(gate) * value


@fused
def swiglu(x):
    """Flux2SwiGLU: the gate is the FIRST half."""
    return silu_gate(*mx.split(x, 2, axis=-1))


def swiglu_rows(layer, x, start: int, hidden: int) -> list:
    """SwiGLU of `layer`'s output rows start : start + 2 * hidden (gate rows, then value rows), as a list of pieces
    along the hidden axis. At the memory floor (one piece of work in flight, mlxdiff/pacing.py) in two ranges of
    the hidden, each paced: one range's gate and value rows are decoded and multiplied before the next, so the
    whole SwiGLU input and the whole decoded weight never exist at once (at FLUX.2-dev's sizes both are hundreds of
    MB). With room to spare, or with no policy installed, one wider matmul (faster); the numbers are the same."""
    policy = current()
    if policy is None or not policy.split_swiglu:
        return [swiglu((layer if start == 0 else linear_rows(layer, start, start + 2 * hidden))(x))]
    half = hidden // 2
    return [pace(silu_gate(linear_rows(layer, start + a, start + b)(x),
                           linear_rows(layer, start + hidden + a, start + hidden + b)(x)))
            for a, b in ((0, half), (half, hidden))]


def clip_fp16(x):
    """diffusers clips the streams to the float16 range when running in float16."""
    return mx.clip(x, -65504, 65504) if x.dtype == mx.float16 else x


def attention(q, k, v, mask=None):
    """q, k (B, H, S, hd), normalised and RoPE'd (norm_rope), v (B, S, H, hd) -> SDPA -> (B, S, H*hd); mask: a key
    mask (fused.attention), None for FLUX.2 and FLUX.1."""
    out = fused_attention(q, k, v.transpose(0, 2, 1, 3), q.shape[-1] ** -0.5, mask)
    b, _, s, _ = out.shape
    return out.transpose(0, 2, 1, 3).reshape(b, s, -1)


class FeedForward(nn.Module):
    """Flux2FeedForward: linear_in (D -> 2M) -> SwiGLU -> linear_out (M -> D)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.linear_in = nn.Linear(dim, 2 * hidden, bias=False)
        self.linear_out = nn.Linear(hidden, dim, bias=False)
        self.hidden = hidden

    def __call__(self, x):
        pieces = swiglu_rows(self.linear_in, x, 0, self.hidden)
        return self.linear_out(pieces[0] if len(pieces) == 1 else mx.concatenate(pieces, axis=-1))


class StreamAttention(nn.Module):
    """One stream's attention layers, no biases: q, k, v, their RMSNorms, to_out. FLUX.2's image stream; FLUX 3's
    whole Flux3Attention."""

    def __init__(self, dim: int, heads: int, head_dim: int, eps: float):
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        inner = heads * head_dim
        self.to_q = nn.Linear(dim, inner, bias=False)
        self.to_k = nn.Linear(dim, inner, bias=False)
        self.to_v = nn.Linear(dim, inner, bias=False)
        self.norm_q = nn.RMSNorm(head_dim, eps=eps)
        self.norm_k = nn.RMSNorm(head_dim, eps=eps)
        self.to_out = [nn.Linear(inner, dim, bias=False)]


class Attention(StreamAttention):
    """Flux2Attention (double-stream blocks): separate q/k/v for the image and the text stream, one joint SDPA over
    [text; image]."""

    def __init__(self, dim: int, heads: int, head_dim: int, eps: float):
        super().__init__(dim, heads, head_dim, eps)
        inner = heads * head_dim
        self.add_q_proj = nn.Linear(dim, inner, bias=False)
        self.add_k_proj = nn.Linear(dim, inner, bias=False)
        self.add_v_proj = nn.Linear(dim, inner, bias=False)
        self.norm_added_q = nn.RMSNorm(head_dim, eps=eps)
        self.norm_added_k = nn.RMSNorm(head_dim, eps=eps)
        self.to_add_out = nn.Linear(inner, dim, bias=False)

    def _heads(self, x):
        return x.reshape(*x.shape[:2], self.heads, self.head_dim)

    def __call__(self, x, context, cos, sin):
        q, k, v = (self._heads(f(x)) for f in (self.to_q, self.to_k, self.to_v))
        cq, ck, cv = (self._heads(f(context)) for f in (self.add_q_proj, self.add_k_proj, self.add_v_proj))
        # the joint sequence is [text; image]: each part normed by its own norm, then RoPE over the whole
        joint = pace(norm_rope([(cq, self.norm_added_q), (q, self.norm_q)], cos, sin, apply_rope),
                     norm_rope([(ck, self.norm_added_k), (k, self.norm_k)], cos, sin, apply_rope),
                     mx.concatenate([cv, v], axis=1))
        out = pace(attention(*joint))
        n_txt = context.shape[1]
        return self.to_out[0](out[:, n_txt:]), self.to_add_out(out[:, :n_txt])


class TransformerBlock(nn.Module):
    """Flux2TransformerBlock (double stream). The modulation comes from the model's shared modulation layers."""

    def __init__(self, dim: int, heads: int, head_dim: int, mlp_hidden: int, eps: float):
        super().__init__()
        self.eps = eps
        self.attn = Attention(dim, heads, head_dim, eps)
        self.ff = FeedForward(dim, mlp_hidden)
        self.ff_context = FeedForward(dim, mlp_hidden)

    def __call__(self, x, context, mod_img, mod_txt, cos, sin):
        """mod_img, mod_txt: [attention, feed-forward] ModulationOut of each stream."""
        (msa, mlp), (c_msa, c_mlp) = mod_img, mod_txt
        eps = self.eps
        attn_out, context_attn_out = self.attn(modulate(x, msa, eps), modulate(context, c_msa, eps), cos, sin)
        x = gated_residual(x, msa.gate, attn_out)
        x = pace(gated_residual(x, mlp.gate, self.ff(modulate(x, mlp, eps))))
        context = gated_residual(context, c_msa.gate, context_attn_out)
        context = pace(gated_residual(context, c_mlp.gate, self.ff_context(modulate(context, c_mlp, eps))))
        return clip_fp16(context), x


class ParallelSelfAttention(nn.Module):
    """Flux2ParallelSelfAttention: one projection gives q, k, v (3D) and the SwiGLU input (2M); one output projection
    takes [attention (D); mlp (M)]."""

    def __init__(self, dim: int, heads: int, head_dim: int, mlp_hidden: int, eps: float):
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        inner = heads * head_dim
        self.to_qkv_mlp_proj = nn.Linear(dim, 3 * inner + 2 * mlp_hidden, bias=False)
        self.mlp_hidden = mlp_hidden
        self.norm_q = nn.RMSNorm(head_dim, eps=eps)
        self.norm_k = nn.RMSNorm(head_dim, eps=eps)
        self.to_out = nn.Linear(inner + mlp_hidden, dim, bias=False)

    def __call__(self, x, cos, sin):
        # The fused projection in row ranges, each paced (mlxdiff/pacing.py): q, k, v and their attention first,
        # then the SwiGLU input (swiglu_rows), so the whole projection (0.5 GB at FLUX.2-dev's sizes) never exists.
        inner = self.heads * self.head_dim
        qkv = pace(linear_rows(self.to_qkv_mlp_proj, 0, 3 * inner)(x))
        q, k, v = (t.reshape(*x.shape[:2], self.heads, self.head_dim) for t in mx.split(qkv, 3, axis=-1))
        out = pace(attention(norm_rope([(q, self.norm_q)], cos, sin, apply_rope),
                             norm_rope([(k, self.norm_k)], cos, sin, apply_rope), v))
        mlp = swiglu_rows(self.to_qkv_mlp_proj, x, 3 * inner, self.mlp_hidden)   # paced when in pieces
        if len(mlp) == 1:
            mlp = [pace(mlp[0])]
        return self.to_out(mx.concatenate([out, *mlp], axis=-1))


class SingleTransformerBlock(nn.Module):
    def __init__(self, dim: int, heads: int, head_dim: int, mlp_hidden: int, eps: float):
        super().__init__()
        self.eps = eps
        self.attn = ParallelSelfAttention(dim, heads, head_dim, mlp_hidden, eps)

    def __call__(self, h, mod: ModulationOut, cos, sin):
        return clip_fp16(gated_residual(h, mod.gate, self.attn(modulate(h, mod, self.eps), cos, sin)))


class AdaLayerNormContinuous(nn.Module):
    """norm_out: linear(silu(temb)) -> (scale, shift) — scale FIRST in diffusers (BFL stores shift first)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.linear = nn.Linear(dim, 2 * dim, bias=False)

    def __call__(self, x, temb):
        scale, shift = mx.split(self.linear(nn.silu(temb))[:, None], 2, axis=-1)
        return layer_norm(x, self.eps) * (1 + scale) + shift


# embedders, the shared modulations and the output layers stay in full precision (loading/quantize.py)
FULL_PRECISION = re.compile(r"(x_embedder|context_embedder|time_guidance_embed\..*|.*modulation.*|norm_out\.linear|"
                            r"proj_out)")


# -- the model -----------------------------------------------------------------------------------------------------

def check_shardable(args: ModelArgs, n: int) -> None:
    """Whether Model.shard can split this config over n ranks (heads, the MLP width and the model width), else one
    line; checked when a tensor-parallel pipeline is loaded, before anything is read."""
    check_divides("FLUX.2 transformer: num_attention_heads", args.num_attention_heads, n, " heads")
    check_divides("FLUX.2 transformer: the MLP width", int(args.num_attention_heads * args.attention_head_dim
                                                          * args.mlp_ratio), n)


class Model(nn.Module):
    """Flux2Transformer2DModel.

    __call__(hidden_states (B, N_img, C), encoder_hidden_states (B, L_txt, J), timestep (B,) = sigma in [0, 1]
    (the pipeline's t / 1000; scaled by 1000 here, as diffusers), img_ids (B?, N_img, 4), txt_ids (B?, L_txt, 4),
    guidance (B,) or None = the guidance scale itself, also scaled by 1000 here) -> (B, N_img, patch^2 * C_out).
    Like diffusers, 3-D ids use batch element 0 only, and guidance is ignored by a model without guidance_embeds.
    `after_block(*outputs)`, if given, is called after every block: the caller's memory policy (the pipelines
    evaluate there, so that one block's transients are freed before the next is built).
    """

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.compute_dtype = mx.float32
        dim = args.num_attention_heads * args.attention_head_dim
        mlp_hidden = int(dim * args.mlp_ratio)
        out_channels = args.out_channels or args.in_channels
        block = (dim, args.num_attention_heads, args.attention_head_dim, mlp_hidden, args.eps)
        self.time_guidance_embed = TimestepGuidanceEmbeddings(args.timestep_guidance_channels, dim,
                                                              args.guidance_embeds)
        self.double_stream_modulation_img = Modulation(dim, 2)
        self.double_stream_modulation_txt = Modulation(dim, 2)
        self.single_stream_modulation = Modulation(dim, 1)
        self.x_embedder = nn.Linear(args.in_channels, dim, bias=False)
        self.context_embedder = nn.Linear(args.joint_attention_dim, dim, bias=False)
        self.transformer_blocks = [TransformerBlock(*block) for _ in range(args.num_layers)]
        self.single_transformer_blocks = [SingleTransformerBlock(*block) for _ in range(args.num_single_layers)]
        self.norm_out = AdaLayerNormContinuous(dim, args.eps)
        self.proj_out = nn.Linear(dim, args.patch_size * args.patch_size * out_channels, bias=False)

    def rope(self, img_ids, txt_ids):
        """cos, sin (L_txt + N_img, head_dim) for the joint sequence [text; image]."""
        return cached_rope(self, img_ids, txt_ids, self.args.axes_dims_rope, self.args.rope_theta, at_least=True)

    def __call__(self, hidden_states, encoder_hidden_states, timestep, img_ids, txt_ids, guidance=None,
                 after_block=None, step_cache=None, stream_dtype=None):
        """after_block(*outputs): called after each block (the caller's memory policy). step_cache: a
        pipelines/step_cache.BlockResiduals that may skip the blocks after the first (it decides). stream_dtype:
        the residual streams' dtype when wider than the compute dtype (backend.stream_dtype): each block's
        attention and feed-forward still run in the compute dtype, their gated sums land in the streams."""
        dtype = self.compute_dtype
        stream = stream_dtype or dtype
        n_img, n_txt = hidden_states.shape[1], encoder_hidden_states.shape[1]
        cos, sin = self.rope(img_ids, txt_ids)
        if cos.shape[0] != n_txt + n_img:
            raise MlxdiffError(f"position ids cover {cos.shape[0]} tokens but the inputs have {n_txt} text + {n_img} "
                               "image tokens; img_ids/txt_ids must match hidden_states/encoder_hidden_states")

        temb = self.time_guidance_embed(scaled_time(timestep, dtype),
                                        None if guidance is None else scaled_time(guidance, dtype))
        mod_img = self.double_stream_modulation_img(temb)
        mod_txt = self.double_stream_modulation_txt(temb)
        (mod_single,) = self.single_stream_modulation(temb)

        x = self.x_embedder(hidden_states.astype(dtype)).astype(stream)
        context = self.context_embedder(encoder_hidden_states.astype(dtype)).astype(stream)
        context, x, x_head, reused = double_stream(self.transformer_blocks, x, context,
                                                   lambda i: (mod_img, mod_txt, cos, sin), after_block, step_cache)
        if reused is not None:
            return self.proj_out(self.norm_out(x + reused, temb))
        h = mx.concatenate([context, x], axis=1)
        for block in self.single_transformer_blocks:
            h = compiled_block(block, h, mod_single, cos, sin)
            if after_block:
                after_block(h)
        if step_cache is not None:
            step_cache.remember(h[:, n_txt:] - x_head)
        return self.proj_out(self.norm_out(h[:, n_txt:], temb))

    def shard(self, group):
        """Tensor-parallel over `group` (mlxdiff/distributed.py; the layers: models/sharding.py), as mlx-lm shards its LLMs: in every block the
        q/k/v projections and the feed-forward input (each SwiGLU half on its own) split by output rows, the
        attention and feed-forward outputs by input columns with one all_sum each, the heads and hidden widths
        divided; the shared modulations split by output rows and gathered. Embedders, norm_out and proj_out stay
        whole on every rank. Lazy: only the slices are evaluated when the model is materialized."""
        n = group.size()
        check_shardable(self.args, n)
        dim = self.args.num_attention_heads * self.args.attention_head_dim
        for i, block in enumerate(self.transformer_blocks):
            at, where = block.attn, f"transformer_blocks.{i}"
            for name in ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj"):
                setattr(at, name, shard_layer(getattr(at, name), "all-to-sharded", group, f"{where}.attn.{name}"))
            at.to_out[0] = shard_layer(at.to_out[0], "sharded-to-all", group, f"{where}.attn.to_out.0")
            at.to_add_out = shard_layer(at.to_add_out, "sharded-to-all", group, f"{where}.attn.to_add_out")
            at.heads //= n
            for name in ("ff", "ff_context"):
                ff = getattr(block, name)
                ff.linear_in = shard_layer(ff.linear_in, "all-to-sharded", group, f"{where}.{name}.linear_in",
                                           boundaries=(ff.hidden,))
                ff.linear_out = shard_layer(ff.linear_out, "sharded-to-all", group, f"{where}.{name}.linear_out")
                ff.hidden //= n
        for i, block in enumerate(self.single_transformer_blocks):
            at, where = block.attn, f"single_transformer_blocks.{i}.attn"
            m = at.mlp_hidden
            at.to_qkv_mlp_proj = shard_layer(at.to_qkv_mlp_proj, "all-to-sharded", group,
                                             f"{where}.to_qkv_mlp_proj", boundaries=(dim, 2 * dim, 3 * dim,
                                                                                     3 * dim + m))
            at.to_out = shard_layer(at.to_out, "sharded-to-all", group, f"{where}.to_out", boundaries=(dim,))
            at.heads //= n
            at.mlp_hidden //= n
        for name in ("double_stream_modulation_img", "double_stream_modulation_txt", "single_stream_modulation"):
            modulation = getattr(self, name)
            modulation.linear = GatheredLinear(modulation.linear, group, f"{name}.linear")

    def eager_is_faster(self) -> bool:
        """memory.compile_blocks_for: with the fused CUDA norm+RoPE kernel (fused.norm_rope) eager blocks, two
        pieces in flight, beat whole compiled blocks, in time and in memory (klein-4B on the H200: bench/RESULTS.md,
        "Speed")."""
        return cuda_kernels()

    def quant_predicate(self, path, module) -> bool:
        """Which layers may be quantized: not the embedders, the shared modulations or the output layers."""
        return not FULL_PRECISION.fullmatch(path)

    def sanitize(self, weights: dict) -> dict:
        """diffusers names and layouts are this module's own (no convolutions): nothing to change."""
        return dict(weights)


# -- original (Black Forest Labs) names: flux2 reference code, ComfyUI and GGUF single files ------------------------

ORIGINAL_PREFIX = "model.diffusion_model."
_P = r"(?:model\.diffusion_model\.)?"      # accepted with or without the prefix (ComfyUI files have it)
_DOUBLE, _TO_DOUBLE = _P + r"double_blocks\.(\d+)\.", r"transformer_blocks.\1."
_SINGLE, _TO_SINGLE = _P + r"single_blocks\.(\d+)\.", r"single_transformer_blocks.\1."

# BFL name -> diffusers name (diffusers' convert_flux2_transformer_checkpoint_to_diffusers). A tuple target splits a
# fused qkv into q, k, v along axis 0 (rows are [q; k; v]); final_layer's modulation is stored (shift, scale) and read
# (scale, shift). RMSNorm weights are called `scale` in BFL's code. The single blocks' fused linear1 stays fused.
ORIGINAL_KEYMAP = [
    (_P + r"img_in\.weight", "x_embedder.weight"),
    (_P + r"txt_in\.weight", "context_embedder.weight"),
    (_P + r"time_in\.in_layer\.weight", "time_guidance_embed.timestep_embedder.linear_1.weight"),
    (_P + r"time_in\.out_layer\.weight", "time_guidance_embed.timestep_embedder.linear_2.weight"),
    (_P + r"guidance_in\.in_layer\.weight", "time_guidance_embed.guidance_embedder.linear_1.weight"),
    (_P + r"guidance_in\.out_layer\.weight", "time_guidance_embed.guidance_embedder.linear_2.weight"),
    (_P + r"(double_stream_modulation_img|double_stream_modulation_txt|single_stream_modulation)\.lin\.weight",
     r"\1.linear.weight"),
    (_P + r"final_layer\.linear\.weight", "proj_out.weight"),
    (_P + r"final_layer\.adaLN_modulation\.1\.weight", "norm_out.linear.weight", "swap_halves"),
    (_DOUBLE + r"img_attn\.qkv\.weight",
     (_TO_DOUBLE + "attn.to_q.weight", _TO_DOUBLE + "attn.to_k.weight", _TO_DOUBLE + "attn.to_v.weight")),
    (_DOUBLE + r"txt_attn\.qkv\.weight",
     (_TO_DOUBLE + "attn.add_q_proj.weight", _TO_DOUBLE + "attn.add_k_proj.weight",
      _TO_DOUBLE + "attn.add_v_proj.weight")),
    (_DOUBLE + r"img_attn\.norm\.query_norm\.scale", _TO_DOUBLE + "attn.norm_q.weight"),
    (_DOUBLE + r"img_attn\.norm\.key_norm\.scale", _TO_DOUBLE + "attn.norm_k.weight"),
    (_DOUBLE + r"txt_attn\.norm\.query_norm\.scale", _TO_DOUBLE + "attn.norm_added_q.weight"),
    (_DOUBLE + r"txt_attn\.norm\.key_norm\.scale", _TO_DOUBLE + "attn.norm_added_k.weight"),
    (_DOUBLE + r"img_attn\.proj\.weight", _TO_DOUBLE + "attn.to_out.0.weight"),
    (_DOUBLE + r"txt_attn\.proj\.weight", _TO_DOUBLE + "attn.to_add_out.weight"),
    (_DOUBLE + r"img_mlp\.0\.weight", _TO_DOUBLE + "ff.linear_in.weight"),
    (_DOUBLE + r"img_mlp\.2\.weight", _TO_DOUBLE + "ff.linear_out.weight"),
    (_DOUBLE + r"txt_mlp\.0\.weight", _TO_DOUBLE + "ff_context.linear_in.weight"),
    (_DOUBLE + r"txt_mlp\.2\.weight", _TO_DOUBLE + "ff_context.linear_out.weight"),
    (_SINGLE + r"linear1\.weight", _TO_SINGLE + "attn.to_qkv_mlp_proj.weight"),
    (_SINGLE + r"linear2\.weight", _TO_SINGLE + "attn.to_out.weight"),
    (_SINGLE + r"norm\.query_norm\.scale", _TO_SINGLE + "attn.norm_q.weight"),
    (_SINGLE + r"norm\.key_norm\.scale", _TO_SINGLE + "attn.norm_k.weight"),
]
_ORIGINAL_RULES = compile_rules(ORIGINAL_KEYMAP)
# LoRAs (lora/, the protocol's LoRADenoiser)
LORA_NAME = "FLUX.2 transformer"
LORA_ARCHITECTURE = "FLUX.2"     # its label in lora.ARCHITECTURES
LORA_ORDER = 50     # its own row, then the BFL names both FLUX generations have
# the layer names that tell a LoRA is for it: (pattern, labels) rows of lora.ARCHITECTURES (lora/names.py tries
# them in the modules' LORA_ORDER, the first that a name matches saying which architectures it fits).
LORA_ARCHITECTURE_PATTERNS = (
    (re.compile(r"(^|[._])(double_stream_modulation_(img|txt)|single_stream_modulation|to_qkv_mlp_proj|linear_in|"
                r"linear_out)([._]|$)"), (LORA_ARCHITECTURE,)),
    # BFL's block names, which both FLUX generations have (tried after each one's own)
    (re.compile(r"(^|[._])(double_blocks|single_blocks|single_transformer_blocks|img_attn|txt_attn)([._]|$)"),
     (LORA_ARCHITECTURE, "FLUX.1")),
)


def lora_original_rules(args) -> list:
    return _ORIGINAL_RULES

_DOUBLE_KEY = re.compile(r"double_blocks\.(\d+)\.")
_SINGLE_KEY = re.compile(r"single_blocks\.(\d+)\.")
# FLUX.1's BFL names, which FLUX.2 does not have: the pooled-CLIP vector_in and per-block modulations
_FLUX1_KEY = re.compile(r"vector_in\.|double_blocks\.\d+\.(img|txt)_mod\.|single_blocks\.\d+\.modulation\.")


def is_original(names) -> bool:
    """Whether tensor names are BFL's (with or without the prefix), as opposed to diffusers'; a Chroma file's
    (FLUX.1 blocks under the same names, and a distilled_guidance_layer, which FLUX.2 does not have) are not. By the
    blocks' names: `img_in.weight` alone is also diffusers' name in Qwen-Image's transformer."""
    return (any(re.match(_P + r"(double_blocks\.|single_blocks\.)", n) for n in names)
            and not any(re.match(_P + r"distilled_guidance_layer\.", n) for n in names))


def is_previous_generation(names) -> bool:
    """Whether BFL names are FLUX.1's (vector_in, per-block modulations), which this model does not read."""
    return any(_FLUX1_KEY.match(n[len(ORIGINAL_PREFIX):] if n.startswith(ORIGINAL_PREFIX) else n) for n in names)


def original_to_diffusers(weights: dict) -> dict:
    """BFL names -> diffusers names (lazy; nothing is read)."""
    weights = under_prefix_if_present(weights, ORIGINAL_PREFIX)
    if not is_original(weights):
        raise MlxdiffError("not a FLUX.2 original checkpoint: no img_in / double_blocks.* / single_blocks.* keys")
    return remap(weights, _ORIGINAL_RULES)


def _shape(weights, key, ndim=2):
    return required_shape(weights, key, "FLUX.2", ndim)


def _block_count(weights, pattern, what):
    indices = sorted({int(m.group(1)) for k in weights if (m := pattern.match(k))})
    if indices != list(range(len(indices))):
        raise MlxdiffError(f"FLUX.2 original checkpoint: {what} indices are not 0..n-1 ({indices[:8]}...); "
                           "the file is incomplete")
    return len(indices)


# What the weights cannot say; every released FLUX.2 (dev, klein 4B/9B) has these values.
NOT_IN_WEIGHTS = {"patch_size": 1, "rope_theta": 2000, "eps": 1e-6}
FROM_BASE_CONFIG = ("axes_dims_rope", "rope_theta", "eps")  # taken from a pipeline folder's config when given


def fused_shapes(dim, mlp_hidden, double, single) -> dict:
    """{BFL key: (shape, how its rows are made)} of the tensors whose rows the key map or the blocks split at fixed
    offsets, as the config gives them: the double blocks' qkv (split in three by ORIGINAL_KEYMAP), the single blocks'
    linear1 ([q; k; v; gate; up], split by linear_rows / swiglu_rows) and linear2 (it takes [attention | MLP]), and
    final_layer's modulation (its halves swapped)."""
    qkv = ((3 * dim, dim), f"3 x {dim} rows (q, k, v of hidden size {dim})")
    out = {"final_layer.adaLN_modulation.1.weight": ((2 * dim, dim), f"2 x {dim} rows (shift, scale)")}
    for i in range(double):
        out[f"double_blocks.{i}.img_attn.qkv.weight"] = qkv
        out[f"double_blocks.{i}.txt_attn.qkv.weight"] = qkv
    for i in range(single):
        out[f"single_blocks.{i}.linear1.weight"] = (
            (3 * dim + 2 * mlp_hidden, dim), f"3 x {dim} + 2 x {mlp_hidden} rows (q, k, v; the MLP's gate and up)")
        out[f"single_blocks.{i}.linear2.weight"] = (
            (dim, dim + mlp_hidden), f"{dim} + {mlp_hidden} columns (attention, MLP)")
    return out


def check_fused_rows(weights: dict, expected: dict, what="FLUX.2") -> None:
    """Each present tensor of `expected` ({key: (shape, how)}) has exactly that shape, before anything splits it
    (a wrong row count would otherwise fail deep in the split, or split at the wrong offsets)."""
    for key, (shape, how) in expected.items():
        if key in weights and tuple(weights[key].shape) != tuple(shape):
            raise MlxdiffError(f"{what} original checkpoint: tensor {key!r} has shape {list(weights[key].shape)}; "
                               f"expected {list(shape)}: {how}, as the file's other tensors give them")


def config_from_original(weights: dict) -> dict:
    """The diffusers config of a BFL-named checkpoint (dev or klein), read from its key names and shapes.

    Rules:
    - D (hidden) and in_channels from img_in [D, C]; joint_attention_dim from txt_in [D, J];
      timestep_guidance_channels from time_in.in_layer [D, T]; guidance_embeds = guidance_in.* present (dev: yes,
      klein: no).
    - num_layers / num_single_layers = the number of double_blocks.N / single_blocks.N indices.
    - attention_head_dim = the length of the QK-norm scale (one weight per head channel); heads = D / head_dim.
      (BFL's own configs give hidden_size and num_heads; the norm length is their quotient, so this is exact.)
    - mlp hidden M = img_mlp.0 rows / 2 (SwiGLU: gate and value), or (single linear1 rows - 3D) / 2 without double
      blocks; mlp_ratio = M / D, checked to give back M through diffusers' int(D * mlp_ratio).
    - out_channels = final_layer.linear rows (patch_size 1; diffusers' config then says null when it equals
      in_channels, as the released configs do).
    - axes_dims_rope: only their sum (= head_dim) is fixed by the weights; BFL's FLUX.2 splits the head into 4 equal
      axes (T, H, W, L) = (32, 32, 32, 32) for 128, so head_dim / 4 each.
    - patch_size, rope_theta and eps are not in the weights either: NOT_IN_WEIGHTS (the released values).
    - the fused projections, which are split at offsets the config sets, must have the shapes it gives them
      (fused_shapes); every other tensor's shape is checked against the built model when it is loaded.
    """
    weights = under_prefix_if_present(weights, ORIGINAL_PREFIX)
    if not is_original(weights):
        raise MlxdiffError("not a FLUX.2 original checkpoint: no img_in / double_blocks.* / single_blocks.* keys")
    if any(_FLUX1_KEY.match(k) for k in weights):
        raise MlxdiffError("a FLUX.1 transformer (it has vector_in / per-block img_mod weights), not FLUX.2; "
                           "mlxdiff runs FLUX.2 (dev, klein) transformers")
    dim, in_channels = _shape(weights, "img_in.weight")
    joint_dim = _shape(weights, "txt_in.weight")[1]
    tg_channels = _shape(weights, "time_in.in_layer.weight")[1]
    num_layers = _block_count(weights, _DOUBLE_KEY, "double_blocks")
    num_single = _block_count(weights, _SINGLE_KEY, "single_blocks")
    if num_layers:
        head_dim = _shape(weights, "double_blocks.0.img_attn.norm.query_norm.scale", 1)[0]
        mlp_hidden = _shape(weights, "double_blocks.0.img_mlp.0.weight")[0] // 2
    elif num_single:
        head_dim = _shape(weights, "single_blocks.0.norm.query_norm.scale", 1)[0]
        mlp_hidden = (_shape(weights, "single_blocks.0.linear1.weight")[0] - 3 * dim) // 2
    else:
        raise MlxdiffError("FLUX.2 original checkpoint has neither double_blocks nor single_blocks")
    if dim % head_dim or head_dim % 8:
        raise MlxdiffError(f"FLUX.2 original checkpoint: hidden size {dim} and QK-norm length {head_dim} do not give "
                           "a whole number of heads with a 4-axis RoPE")
    mlp_ratio = mlp_hidden / dim
    if int(dim * mlp_ratio) != mlp_hidden:
        raise MlxdiffError(f"FLUX.2 original checkpoint: mlp hidden size {mlp_hidden} is not expressible as "
                           f"int({dim} * mlp_ratio); pass a config")
    out_channels = _shape(weights, "final_layer.linear.weight")[0]
    check_fused_rows(weights, fused_shapes(dim, mlp_hidden, num_layers, num_single))
    return {
        "patch_size": NOT_IN_WEIGHTS["patch_size"],
        "in_channels": in_channels,
        "out_channels": None if out_channels == in_channels else out_channels,
        "num_layers": num_layers,
        "num_single_layers": num_single,
        "attention_head_dim": head_dim,
        "num_attention_heads": dim // head_dim,
        "joint_attention_dim": joint_dim,
        "timestep_guidance_channels": tg_channels,
        "mlp_ratio": mlp_ratio,
        "axes_dims_rope": [head_dim // 4] * 4,
        "rope_theta": NOT_IN_WEIGHTS["rope_theta"],
        "eps": NOT_IN_WEIGHTS["eps"],
        "guidance_embeds": "guidance_in.in_layer.weight" in weights,
    }

