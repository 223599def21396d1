"""SD3 / SD3.5 transformer (MMDiT, and MMDiT-X with dual attention): diffusers' SD3Transformer2DModel in MLX.

Attribute names mirror diffusers, so a diffusers checkpoint loads with one layout change (the patch conv,
OIHW -> OHWI). Original single-file checkpoints (Stability's `model.diffusion_model.*` names) go through
`original_to_diffusers` first; `config_from_original` infers the config from their shapes.
"""

import re
from dataclasses import dataclass
from typing import NamedTuple

import mlx.core as mx
import mlx.nn as nn

from ..config_checks import (MAX_HEAD_DIM, MAX_HEADS, MAX_IMAGE_SIZE, MAX_LAYERS, MAX_WIDTH, CheckedArgs, Rule,
                             between, one_of)
from ..errors import MlxdiffError
from ..formats.keymaps import compile_rules, remap, required_shape, under_prefix_if_present
from ..pacing import pace
from .embeddings import CombinedTimestepTextProjEmbeddings, sincos_2d
from .fused import attention, compiled_block, gated_residual, norm_modulate, norm_rope
from .sharding import GatheredLinear, check_divides, shard_layer

CLASS_NAMES = ("SD3Transformer2DModel",)   # diffusers' class: its key in models/registry.ARCHITECTURES


@dataclass
class ModelArgs(CheckedArgs):
    # defaults: SD3.5 Medium (stabilityai/stable-diffusion-3.5-medium transformer/config.json)
    sample_size: int = 128
    patch_size: int = 2
    in_channels: int = 16
    num_layers: int = 24
    attention_head_dim: int = 64
    num_attention_heads: int = 24
    joint_attention_dim: int = 4096
    caption_projection_dim: int = 1536
    pooled_projection_dim: int = 2048
    out_channels: int | None = 16
    pos_embed_max_size: int = 384
    dual_attention_layers: tuple[int, ...] | None = tuple(range(13))
    qk_norm: str | None = "rms_norm"

    WHAT = "SD3 transformer config"
    LIMITS = {
        "sample_size": between(1, MAX_IMAGE_SIZE),
        "patch_size": between(1, 16),
        "in_channels": between(1, MAX_WIDTH),
        "num_layers": between(1, MAX_LAYERS),
        "attention_head_dim": between(1, MAX_HEAD_DIM),
        "num_attention_heads": between(1, MAX_HEADS),
        "joint_attention_dim": between(1, MAX_WIDTH),
        "caption_projection_dim": between(1, MAX_WIDTH),
        "pooled_projection_dim": between(1, MAX_WIDTH),
        "out_channels": between(1, MAX_WIDTH),
        "pos_embed_max_size": between(1, 1024),     # a G x G position table (SD3.5: 384)
        "dual_attention_layers": between(0, MAX_LAYERS - 1),
        "qk_norm": one_of("rms_norm"),              # or null
    }
    RULES = (
        Rule("caption_projection_dim",
             lambda a: a.caption_projection_dim == a.num_attention_heads * a.attention_head_dim,
             lambda a: f"must equal num_attention_heads * attention_head_dim = "
                       f"{a.num_attention_heads * a.attention_head_dim}"),
        Rule("num_attention_heads", lambda a: a.num_attention_heads * a.attention_head_dim <= MAX_WIDTH,
             lambda a: f"num_attention_heads * attention_head_dim (the width) must be at most {MAX_WIDTH}"),
        Rule("attention_head_dim", lambda a: (a.num_attention_heads * a.attention_head_dim) % 4 == 0,
             lambda a: "num_attention_heads * attention_head_dim must be a multiple of 4 (the 2-D sin-cos table)"),
        Rule("sample_size", lambda a: a.sample_size >= a.patch_size,
             lambda a: f"must be at least patch_size {a.patch_size}"),
        Rule("dual_attention_layers", lambda a: all(i < a.num_layers for i in a.dual_attention_layers),
             lambda a: f"expected block indices below num_layers {a.num_layers}"),
    )

    def __post_init__(self):
        if self.out_channels is None:
            self.out_channels = self.in_channels
        self.dual_attention_layers = tuple(self.dual_attention_layers or ())

def modulate(x, scale, shift):
    """LayerNorm(x) (no affine) * (1 + scale) + shift, scale and shift (B, D): one CUDA kernel where it applies."""
    return norm_modulate(x, scale[:, None], shift[:, None], 1e-6)


class Modulation(NamedTuple):
    """One (shift, scale, gate) triple, each (B, D)."""
    shift: mx.array
    scale: mx.array
    gate: mx.array


class ZeroOut(NamedTuple):
    """AdaLayerNormZero's output: the modulated input, the input itself (MMDiT-X norms it again for the second
    attention: one pass, cheaper than keeping the normed copy), and the modulations of attention, feed-forward and
    (MMDiT-X) the second attention."""
    x_mod: mx.array
    x: mx.array
    msa: Modulation
    mlp: Modulation
    msa2: Modulation | None


class AdaLayerNormZero(nn.Module):
    """Linear(silu(temb)) -> 6 chunks (shift, scale, gate)_msa, (shift, scale, gate)_mlp; with `dual`, 9 chunks:
    the extra three (shift, scale, gate)_msa2 modulate the same normalised x for attn2 (SD35AdaLayerNormZeroX)."""

    def __init__(self, dim: int, dual: bool = False):
        super().__init__()
        self.linear = nn.Linear(dim, (9 if dual else 6) * dim)

    def __call__(self, x, temb) -> ZeroOut:
        out = self.linear(nn.silu(temb))
        chunks = mx.split(out, out.shape[-1] // x.shape[-1], axis=-1)
        mods = [Modulation(*chunks[i:i + 3]) for i in range(0, len(chunks), 3)]
        msa = mods[0]
        return ZeroOut(modulate(x, msa.scale, msa.shift), x, msa, mods[1], mods[2] if len(mods) > 2 else None)


class AdaLayerNormContinuous(nn.Module):
    """Linear(silu(cond)) -> (scale, shift): note diffusers' order here is scale first."""

    def __init__(self, dim: int, conditioning_dim: int):
        super().__init__()
        self.linear = nn.Linear(conditioning_dim, 2 * dim)

    def __call__(self, x, cond):
        scale, shift = mx.split(self.linear(nn.silu(cond)), 2, axis=-1)
        return modulate(x, scale, shift)


class FeedForward(nn.Module):
    """diffusers' FeedForward, activation "gelu-approximate": net.0.proj -> gelu(tanh) -> (net.1 dropout) -> net.2."""

    def __init__(self, dim: int, mult: int = 4):
        super().__init__()
        self.net = [GELUProjection(dim, dim * mult), nn.Identity(), nn.Linear(dim * mult, dim)]

    def __call__(self, x):
        for layer in self.net:
            x = layer(x)
        return x


class GELUProjection(nn.Module):
    def __init__(self, dim_in: int, dim_out: int):
        super().__init__()
        self.proj = nn.Linear(dim_in, dim_out)

    def __call__(self, x):
        return nn.gelu_approx(self.proj(x))


class Attention(nn.Module):
    """Joint attention (JointAttnProcessor2_0). With `context` set (`added_kv`), the image and context tokens attend
    together as one sequence [image, context]; without, plain self-attention (attn2 of MMDiT-X)."""

    def __init__(self, dim: int, heads: int, head_dim: int, qk_norm: str | None, added_kv: bool = False,
                 context_pre_only: bool = False):
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        inner = heads * head_dim
        self.to_q = nn.Linear(dim, inner)
        self.to_k = nn.Linear(dim, inner)
        self.to_v = nn.Linear(dim, inner)
        self.to_out = [nn.Linear(inner, dim)]
        rms = qk_norm == "rms_norm"
        self.norm_q = nn.RMSNorm(head_dim, eps=1e-6) if rms else None
        self.norm_k = nn.RMSNorm(head_dim, eps=1e-6) if rms else None
        if added_kv:
            self.add_q_proj = nn.Linear(dim, inner)
            self.add_k_proj = nn.Linear(dim, inner)
            self.add_v_proj = nn.Linear(dim, inner)
            self.norm_added_q = nn.RMSNorm(head_dim, eps=1e-6) if rms else None
            self.norm_added_k = nn.RMSNorm(head_dim, eps=1e-6) if rms else None
            if not context_pre_only:
                self.to_add_out = nn.Linear(inner, dim)

    def _heads(self, x):
        b, n, _ = x.shape
        return x.reshape(b, n, self.heads, self.head_dim)

    @staticmethod
    def _joined(parts):
        """[(x (B, S_i, H, hd), norm or None), ...] -> each part normed, joined along the tokens, (B, H, S, hd); the
        qk norms in one CUDA kernel where it applies (fused.norm_rope without RoPE)."""
        if parts[0][1] is not None:
            return norm_rope(parts, None, None, None)
        xs = [x for x, _ in parts]
        return (xs[0] if len(xs) == 1 else mx.concatenate(xs, axis=1)).transpose(0, 2, 1, 3)

    def __call__(self, x, context=None):
        q, k, v = self._heads(self.to_q(x)), self._heads(self.to_k(x)), self._heads(self.to_v(x))
        qs, ks, vs = [(q, self.norm_q)], [(k, self.norm_k)], [(v, None)]
        n = x.shape[1]
        if context is not None:
            qs.append((self._heads(self.add_q_proj(context)), self.norm_added_q))
            ks.append((self._heads(self.add_k_proj(context)), self.norm_added_k))
            vs.append((self._heads(self.add_v_proj(context)), None))
        out = attention(self._joined(qs), self._joined(ks), self._joined(vs), self.head_dim ** -0.5)
        b, _, s, _ = out.shape
        out = out.transpose(0, 2, 1, 3).reshape(b, s, -1)
        x_out = self.to_out[0](out[:, :n])
        if context is None:
            return x_out
        context_out = self.to_add_out(out[:, n:]) if "to_add_out" in self else None
        return x_out, context_out


class JointTransformerBlock(nn.Module):
    def __init__(self, dim: int, heads: int, head_dim: int, context_pre_only: bool, qk_norm: str | None,
                 use_dual_attention: bool):
        super().__init__()
        self.context_pre_only = context_pre_only
        self.use_dual_attention = use_dual_attention
        self.norm1 = AdaLayerNormZero(dim, dual=use_dual_attention)
        # the last block only feeds the context into attention: its context norm is (scale, shift) only
        self.norm1_context = AdaLayerNormContinuous(dim, dim) if context_pre_only else AdaLayerNormZero(dim)
        self.attn = Attention(dim, heads, head_dim, qk_norm, added_kv=True, context_pre_only=context_pre_only)
        if use_dual_attention:
            self.attn2 = Attention(dim, heads, head_dim, qk_norm)
        self.ff = FeedForward(dim)
        if not context_pre_only:
            self.ff_context = FeedForward(dim)

    def __call__(self, x, context, temb):
        img = self.norm1(x, temb)
        if self.context_pre_only:
            c_mod, txt = self.norm1_context(context, temb), None
        else:
            txt = self.norm1_context(context, temb)
            c_mod = txt.x_mod

        # each attention and feed-forward result is paced (mlxdiff/pacing.py): its transients are freed before
        # the next one is built
        attn_out, context_attn_out = self.attn(img.x_mod, c_mod)
        x = pace(gated_residual(x, img.msa.gate[:, None], attn_out))
        if self.use_dual_attention:
            x = pace(gated_residual(x, img.msa2.gate[:, None],
                                    self.attn2(modulate(img.x, img.msa2.scale, img.msa2.shift))))
        x = pace(gated_residual(x, img.mlp.gate[:, None],
                                self.ff(modulate(x, img.mlp.scale, img.mlp.shift))))

        if self.context_pre_only:
            return None, x
        context = gated_residual(context, txt.msa.gate[:, None], context_attn_out)
        context = pace(gated_residual(context, txt.mlp.gate[:, None],
                                      self.ff_context(modulate(context, txt.mlp.scale, txt.mlp.shift))))
        return context, x


class PatchEmbed(nn.Module):
    """Conv patchify + the centre crop of a persistent (1, G*G, D) sin-cos table (G = pos_embed_max_size)."""

    def __init__(self, patch_size: int, in_channels: int, dim: int, pos_embed_max_size: int, base_size: int):
        super().__init__()
        self.patch_size = patch_size
        self.max_size = pos_embed_max_size
        self.proj = nn.Conv2d(in_channels, dim, kernel_size=patch_size, stride=patch_size)
        # replaced by the checkpoint's `pos_embed.pos_embed`; lazy, so computed only if nothing replaces it
        self.pos_embed = sincos_2d(dim, pos_embed_max_size, base_size=base_size)[None]

    def cropped_pos_embed(self, h: int, w: int):
        g = self.max_size
        if h > g or w > g:
            raise MlxdiffError(f"latent grid {h}x{w} patches is larger than this transformer's position table "
                               f"({g}x{g}, pos_embed_max_size); use a smaller image size (at most "
                               f"{g * self.patch_size} latent pixels per side)")
        top, left = (g - h) // 2, (g - w) // 2
        table = self.pos_embed.reshape(g, g, -1)[top:top + h, left:left + w]
        return table.reshape(1, h * w, -1)

    def __call__(self, x_nhwc):
        x = self.proj(x_nhwc)
        b, h, w, d = x.shape
        return x.reshape(b, h * w, d) + self.cropped_pos_embed(h, w).astype(x.dtype)


def check_shardable(args: ModelArgs, n: int) -> None:
    """Whether Model.shard can split this config over n ranks (the heads), else one line; checked when a
    tensor-parallel pipeline is loaded, before anything is read."""
    check_divides("SD3 transformer: num_attention_heads", args.num_attention_heads, n, " heads")


# embedders and the output layers stay in full precision (loading/quantize.py); the per-block adaLN is quantized
FULL_PRECISION = re.compile(r"(pos_embed|time_text_embed|context_embedder)(\..*)?|norm_out\.linear|proj_out")


class Model(nn.Module):
    """SD3Transformer2DModel. Inputs and output are NCHW like diffusers. `after_block(context, x)`, if given, is
    called after every block: the caller's memory policy (the pipelines evaluate there)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.compute_dtype = mx.float32
        dim = args.num_attention_heads * args.attention_head_dim
        self.pos_embed = PatchEmbed(args.patch_size, args.in_channels, dim, args.pos_embed_max_size,
                                    base_size=args.sample_size // args.patch_size)
        self.time_text_embed = CombinedTimestepTextProjEmbeddings(dim, args.pooled_projection_dim)
        self.context_embedder = nn.Linear(args.joint_attention_dim, args.caption_projection_dim)
        self.transformer_blocks = [
            JointTransformerBlock(dim, args.num_attention_heads, args.attention_head_dim,
                                  context_pre_only=i == args.num_layers - 1, qk_norm=args.qk_norm,
                                  use_dual_attention=i in args.dual_attention_layers)
            for i in range(args.num_layers)
        ]
        self.norm_out = AdaLayerNormContinuous(dim, dim)
        self.proj_out = nn.Linear(dim, args.patch_size * args.patch_size * args.out_channels)

    def __call__(self, hidden_states, encoder_hidden_states, pooled_projections, timestep, skip_layers=None,
                 after_block=None, step_cache=None, stream_dtype=None, block_controlnet_hidden_states=None):
        """skip_layers: blocks left out (skip-layer guidance). block_controlnet_hidden_states: an SD3 ControlNet's
        residuals (models/controlnet_sd3.py), one added to the image stream after each block but the last, as
        diffusers spreads them. after_block(*outputs): called after each block (the
        caller's memory policy). step_cache: a pipelines/step_cache.BlockResiduals that may skip the blocks after the
        first (it decides). stream_dtype: the residual streams' dtype when wider than the compute dtype
        (backend.stream_dtype); attention and feed-forward still run in the compute dtype."""
        dtype, p = self.compute_dtype, self.args.patch_size
        stream = stream_dtype or dtype
        b, _, height, width = hidden_states.shape
        if height % p or width % p:
            raise MlxdiffError(f"latent size {height}x{width} is not a multiple of the patch size {p}")
        x = self.pos_embed(hidden_states.astype(dtype).transpose(0, 2, 3, 1)).astype(stream)
        temb = self.time_text_embed(mx.array(timestep).astype(mx.float32).reshape(-1),
                                    pooled_projections.astype(dtype))
        context = self.context_embedder(encoder_hidden_states.astype(dtype)).astype(stream)
        skip = set(skip_layers or ())
        controls = block_controlnet_hidden_states
        for i, block in enumerate(self.transformer_blocks):
            x_in = x
            if i not in skip:  # a skipped block changes neither stream
                context, x = compiled_block(block, x, context, temb)
                if controls and i < len(self.transformer_blocks) - 1:    # the last block is context_pre_only
                    x = x + controls[int(i / (len(self.transformer_blocks) / len(controls)))].astype(x.dtype)
                if after_block:
                    after_block(context, x)
            if i == 0 and step_cache is not None:
                reused = step_cache.reuse(x - x_in)     # the last block returns no text stream: image only
                if reused is not None:
                    x = x + reused
                    break
                x_head = x
        else:
            if step_cache is not None:
                step_cache.remember(x - x_head)
        x = self.proj_out(self.norm_out(x, temb))
        h, w = height // p, width // p
        x = x.reshape(b, h, w, p, p, -1).transpose(0, 5, 1, 3, 2, 4)  # einsum nhwpqc -> nchpwq
        return x.reshape(b, -1, h * p, w * p)

    def quant_predicate(self, path, module) -> bool:
        return not FULL_PRECISION.fullmatch(path)

    def shard(self, group):
        """Tensor-parallel over `group` (mlxdiff/distributed.py; the layers: models/sharding.py), as mlx-lm shards its LLMs: in every block the
        q/k/v projections (both streams, and attn2's) and the feed-forward inputs split by output rows, the
        attention and feed-forward outputs by input columns with one all_sum each, the heads divided; the per-block
        adaLN linears (a third of the weights) split by output rows and gathered back. The embedders, norm_out and
        proj_out stay whole on every rank. Lazy: only the slices are evaluated when the model is materialized."""
        n = group.size()
        check_shardable(self.args, n)
        for i, block in enumerate(self.transformer_blocks):
            where = f"transformer_blocks.{i}"
            for name in ("attn", "attn2"):
                if name not in block:
                    continue
                at = block[name]
                for proj in ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj"):
                    if proj in at:
                        setattr(at, proj, shard_layer(at[proj], "all-to-sharded", group, f"{where}.{name}.{proj}"))
                at.to_out[0] = shard_layer(at.to_out[0], "sharded-to-all", group, f"{where}.{name}.to_out.0")
                if "to_add_out" in at:
                    at.to_add_out = shard_layer(at.to_add_out, "sharded-to-all", group, f"{where}.{name}.to_add_out")
                at.heads //= n
            for name in ("ff", "ff_context"):
                if name in block:
                    net = block[name].net
                    net[0].proj = shard_layer(net[0].proj, "all-to-sharded", group, f"{where}.{name}.net.0.proj")
                    net[2] = shard_layer(net[2], "sharded-to-all", group, f"{where}.{name}.net.2")
            for name in ("norm1", "norm1_context"):
                norm = block[name]
                norm.linear = GatheredLinear(norm.linear, group, f"{where}.{name}.linear")

    def sanitize(self, weights: dict) -> dict:
        """diffusers names and PyTorch layouts -> this module: only the patch conv changes (OIHW -> OHWI)."""
        out = dict(weights)
        w = out.get("pos_embed.proj.weight")
        if w is not None and w.ndim == 4:
            out["pos_embed.proj.weight"] = w.transpose(0, 2, 3, 1)
        return out


# -- original single-file checkpoints (Stability's sd3.5_*.safetensors, `model.diffusion_model.*`) ------------

ORIGINAL_PREFIX = "model.diffusion_model."
FROM_BASE_CONFIG = ("sample_size",)  # not in the weights; taken from a pipeline folder's config when there is one


def is_original(names) -> bool:
    """Whether tensor names are Stability's original ones (with or without the prefix), not diffusers'."""
    return any(n.split(ORIGINAL_PREFIX)[-1].startswith("joint_blocks.") for n in names)

# original name -> diffusers name (see convert_sd3_transformer_checkpoint_to_diffusers). A tuple target splits a fused
# qkv along axis 0. The 2-chunk modulations (final_layer, and the last block's context adaLN) are stored
# (shift, scale) but read (scale, shift) by AdaLayerNormContinuous: final_layer's swap is in the table; the last
# block's depends on the depth and is added by `original_to_diffusers`.
ORIG_BLOCK = r"joint_blocks\.(\d+)\."       # group 1: the block index
DIFF_BLOCK = r"transformer_blocks.\1."
ORIGINAL_KEYMAP = [
    (r"pos_embed", "pos_embed.pos_embed"),
    (r"x_embedder\.proj\.(weight|bias)", r"pos_embed.proj.\1"),
    (r"t_embedder\.mlp\.0\.(weight|bias)", r"time_text_embed.timestep_embedder.linear_1.\1"),
    (r"t_embedder\.mlp\.2\.(weight|bias)", r"time_text_embed.timestep_embedder.linear_2.\1"),
    (r"y_embedder\.mlp\.0\.(weight|bias)", r"time_text_embed.text_embedder.linear_1.\1"),
    (r"y_embedder\.mlp\.2\.(weight|bias)", r"time_text_embed.text_embedder.linear_2.\1"),
    (r"context_embedder\.(weight|bias)", r"context_embedder.\1"),
    (r"final_layer\.linear\.(weight|bias)", r"proj_out.\1"),
    (r"final_layer\.adaLN_modulation\.1\.(weight|bias)", r"norm_out.linear.\1", "swap_halves"),
    (ORIG_BLOCK + r"x_block\.attn\.qkv\.(weight|bias)",
     (DIFF_BLOCK + r"attn.to_q.\2", DIFF_BLOCK + r"attn.to_k.\2", DIFF_BLOCK + r"attn.to_v.\2")),
    (ORIG_BLOCK + r"x_block\.attn\.ln_(q|k)\.weight", DIFF_BLOCK + r"attn.norm_\2.weight"),
    (ORIG_BLOCK + r"x_block\.attn\.proj\.(weight|bias)", DIFF_BLOCK + r"attn.to_out.0.\2"),
    (ORIG_BLOCK + r"x_block\.attn2\.qkv\.(weight|bias)",
     (DIFF_BLOCK + r"attn2.to_q.\2", DIFF_BLOCK + r"attn2.to_k.\2", DIFF_BLOCK + r"attn2.to_v.\2")),
    (ORIG_BLOCK + r"x_block\.attn2\.ln_(q|k)\.weight", DIFF_BLOCK + r"attn2.norm_\2.weight"),
    (ORIG_BLOCK + r"x_block\.attn2\.proj\.(weight|bias)", DIFF_BLOCK + r"attn2.to_out.0.\2"),
    (ORIG_BLOCK + r"x_block\.adaLN_modulation\.1\.(weight|bias)", DIFF_BLOCK + r"norm1.linear.\2"),
    (ORIG_BLOCK + r"x_block\.mlp\.fc1\.(weight|bias)", DIFF_BLOCK + r"ff.net.0.proj.\2"),
    (ORIG_BLOCK + r"x_block\.mlp\.fc2\.(weight|bias)", DIFF_BLOCK + r"ff.net.2.\2"),
    (ORIG_BLOCK + r"context_block\.attn\.qkv\.(weight|bias)",
     (DIFF_BLOCK + r"attn.add_q_proj.\2", DIFF_BLOCK + r"attn.add_k_proj.\2", DIFF_BLOCK + r"attn.add_v_proj.\2")),
    (ORIG_BLOCK + r"context_block\.attn\.ln_(q|k)\.weight", DIFF_BLOCK + r"attn.norm_added_\2.weight"),
    (ORIG_BLOCK + r"context_block\.attn\.proj\.(weight|bias)", DIFF_BLOCK + r"attn.to_add_out.\2"),
    (ORIG_BLOCK + r"context_block\.adaLN_modulation\.1\.(weight|bias)", DIFF_BLOCK + r"norm1_context.linear.\2"),
    (ORIG_BLOCK + r"context_block\.mlp\.fc1\.(weight|bias)", DIFF_BLOCK + r"ff_context.net.0.proj.\2"),
    (ORIG_BLOCK + r"context_block\.mlp\.fc2\.(weight|bias)", DIFF_BLOCK + r"ff_context.net.2.\2"),
]
_ORIGINAL_RULES = compile_rules(ORIGINAL_KEYMAP)
_BLOCK_KEY = re.compile(r"joint_blocks\.(\d+)\.")
_ATTN2_KEY = re.compile(r"joint_blocks\.(\d+)\.x_block\.attn2\.")


def _block_indices(weights: dict) -> list:
    return sorted({int(m.group(1)) for k in weights if (m := _BLOCK_KEY.match(k))})


def original_to_diffusers(weights: dict) -> dict:
    """Original MMDiT names -> diffusers names (lazy; nothing is read).

    ORIGINAL_KEYMAP, plus one rule made here: the last joint block (highest index; diffusers' context_pre_only
    block, whose context adaLN has 2 chunks instead of 6) gets its (shift, scale) halves swapped. The rule is
    prepended so it wins over the table's plain `norm1_context` rule.
    """
    weights = under_prefix_if_present(weights, ORIGINAL_PREFIX)
    blocks = _block_indices(weights)
    if not blocks:
        raise MlxdiffError("not an SD3 original checkpoint: no joint_blocks.* keys; pass the diffusers folder instead")
    return remap(weights, original_rules(blocks[-1]))


# LoRAs (lora/, the protocol's LoRADenoiser)
LORA_NAME = "SD3.5 transformer"
LORA_ARCHITECTURE = "SD3"     # its label in lora.ARCHITECTURES
LORA_ORDER = 60     # its own row, then the joint-attention names FLUX.1 has too
# the layer names that tell a LoRA is for it: (pattern, labels) rows of lora.ARCHITECTURES (lora/names.py tries
# them in the modules' LORA_ORDER, the first that a name matches saying which architectures it fits).
LORA_ARCHITECTURE_PATTERNS = (
    (re.compile(r"(^|[._])(joint_blocks|x_block|context_block|time_text_embed|pos_embed)([._]|$)"),
     (LORA_ARCHITECTURE,)),
    # diffusers' joint-attention block names, which FLUX.1's blocks have too
    (re.compile(r"(^|[._])(norm1_context|ff_context[._]net|ff[._]net|norm1[._]linear)([._]|$)"),
     (LORA_ARCHITECTURE, "FLUX.1")),
)


def lora_original_rules(args) -> list:
    return original_rules(args.num_layers - 1)


def original_rules(last: int) -> list:
    """The compiled ORIGINAL_KEYMAP for a model whose last joint block is `last`, with that block's swap rule first
    (see original_to_diffusers; also what mlxdiff/lora/names.py maps original-named LoRA layers with)."""
    return compile_rules([(rf"joint_blocks\.({last})\.context_block\.adaLN_modulation\.1\.(weight|bias)",
                           DIFF_BLOCK + r"norm1_context.linear.\2", "swap_halves")]) + _ORIGINAL_RULES


def _shape(weights, key, ndim=2):
    return required_shape(weights, key, "SD3", ndim)


def fused_shapes(dim, blocks) -> dict:
    """{original key: (shape, how its rows are made)} of the tensors ORIGINAL_KEYMAP splits: every qkv (in three)
    and the 2-chunk modulations whose halves it swaps (final_layer's, the last block's context adaLN)."""
    qkv_w = ((3 * dim, dim), f"3 x {dim} rows (q, k, v of hidden size {dim})")
    qkv_b = ((3 * dim,), f"3 x {dim} values (q, k, v)")
    halves_w, halves_b = ((2 * dim, dim), f"2 x {dim} rows (shift, scale)"), ((2 * dim,), f"2 x {dim} values")
    out = {"final_layer.adaLN_modulation.1.weight": halves_w, "final_layer.adaLN_modulation.1.bias": halves_b,
           f"joint_blocks.{blocks[-1]}.context_block.adaLN_modulation.1.weight": halves_w,
           f"joint_blocks.{blocks[-1]}.context_block.adaLN_modulation.1.bias": halves_b}
    for b in blocks:
        for attn in ("x_block.attn", "x_block.attn2", "context_block.attn"):
            out[f"joint_blocks.{b}.{attn}.qkv.weight"] = qkv_w
            out[f"joint_blocks.{b}.{attn}.qkv.bias"] = qkv_b
    return out


def check_fused_rows(weights: dict, expected: dict) -> None:
    """Each present tensor of `expected` has exactly that shape, before the key map splits it."""
    for key, (shape, how) in expected.items():
        if key in weights and tuple(weights[key].shape) != tuple(shape):
            raise MlxdiffError(f"SD3 original checkpoint: tensor {key!r} has shape {list(weights[key].shape)}; "
                               f"expected {list(shape)}: {how}, as the file's other tensors give them")


def config_from_original(weights: dict) -> dict:
    """The diffusers config of an original-named checkpoint, read from its key names and shapes.

    Rules (what diffusers' convert script and the released configs do):
    - hidden D = x_embedder.proj rows; in_channels, patch_size from the same conv; out_channels = final_layer
      rows / patch^2; joint_attention_dim, caption_projection_dim from context_embedder; pooled_projection_dim
      from y_embedder.mlp.0; pos_embed_max_size = sqrt(pos_embed rows); num_layers = highest joint_blocks index + 1;
      dual_attention_layers = the blocks with x_block.attn2.*; qk_norm = "rms_norm" iff ln_q is present.
    - heads: the original MMDiT fixes the head size at 64 (num_heads = depth, hidden = 64 * depth). When ln_q is
      present its length IS the head size, so attention_head_dim = len(ln_q) else 64, and heads = D / head size.
      This is exact for SD3 Medium, SD3.5 Medium and SD3.5 Large (24, 24, 38 heads of 64).
    - sample_size (only the default image size; not stored in the weights) = 128, as in every released model.
    - the tensors the key map splits (qkv, the swapped modulations) must have the shapes hidden D gives them
      (fused_shapes); every other tensor's shape is checked against the built model when it is loaded.
    """
    weights = under_prefix_if_present(weights, ORIGINAL_PREFIX)
    blocks = _block_indices(weights)
    if not blocks:
        raise MlxdiffError("not an SD3 original checkpoint: no joint_blocks.* keys")
    dim, in_channels, patch, _ = _shape(weights, "x_embedder.proj.weight", 4)
    caption_dim, joint_dim = _shape(weights, "context_embedder.weight")
    ln_q = f"joint_blocks.{blocks[0]}.x_block.attn.ln_q.weight"
    head_dim = _shape(weights, ln_q, 1)[0] if ln_q in weights else 64
    if dim % head_dim:
        raise MlxdiffError(f"SD3 original checkpoint: hidden size {dim} is not a multiple of the head size {head_dim}")
    check_fused_rows(weights, fused_shapes(dim, blocks))
    rows = _shape(weights, "pos_embed", 3)[1]
    grid = round(rows ** 0.5)
    if grid * grid != rows:
        raise MlxdiffError(f"SD3 original checkpoint: pos_embed has {rows} rows, not a square grid")
    return {
        "sample_size": 128,
        "patch_size": patch,
        "in_channels": in_channels,
        "num_layers": blocks[-1] + 1,
        "attention_head_dim": head_dim,
        "num_attention_heads": dim // head_dim,
        "joint_attention_dim": joint_dim,
        "caption_projection_dim": caption_dim,
        "pooled_projection_dim": _shape(weights, "y_embedder.mlp.0.weight")[1],
        "out_channels": _shape(weights, "final_layer.linear.weight")[0] // (patch * patch),
        "pos_embed_max_size": grid,
        "dual_attention_layers": sorted({int(m.group(1)) for k in weights if (m := _ATTN2_KEY.match(k))}),
        "qk_norm": "rms_norm" if any(".ln_q." in k for k in weights) else None,
    }
