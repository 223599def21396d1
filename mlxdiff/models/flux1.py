"""FLUX.1 transformer: diffusers' FluxTransformer2DModel (models/transformers/transformer_flux.py) in MLX.

FLUX.1 dev, schnell, Krea, Kontext and Fill share it: 19 double-stream blocks (per-block adaLN-Zero modulation, as
SD3's MMDiT) and 38 single-stream blocks (attention and a GELU MLP side by side), a 3-axis RoPE (16, 56, 56; theta
10000; adjacent pairs rotated, as FLUX.2's), the pooled CLIP vector added to the timestep embedding, a guidance
embedding for the guidance-distilled models (dev) and none for schnell. Every linear layer has a bias. The joint
sequence is [text; image].

Attribute names mirror diffusers, so a diffusers checkpoint loads as it is (no convolutions: sanitize changes
nothing). Black Forest Labs' original names (BFL's and ComfyUI's single files and the GGUFs made from them, with or
without `model.diffusion_model.`) go through ORIGINAL_KEYMAP; `config_from_original` reads such a file's config off
its shapes.
"""

import re
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from ..config_checks import MAX_HEAD_DIM, MAX_HEADS, MAX_LAYERS, MAX_WIDTH, CheckedArgs, Rule, between
from ..errors import MlxdiffError
from ..formats.keymaps import compile_rules, remap, required_shape, under_prefix_if_present
from ..formats.quantized import concat_rows, split_rows
from ..pacing import pace
from .embeddings import TextProjection, TimestepEmbedding, timestep_embedding
from .flux2 import apply_rope, attention, cached_rope, check_fused_rows, clip_fp16, scaled_time
from .fused import compiled_block, double_stream, gated_residual, norm_modulate, norm_rope
from .mmdit import AdaLayerNormContinuous, AdaLayerNormZero, FeedForward
from .sharding import check_divides, shard_layer

ROPE_THETA = 10000       # FluxPosEmbed(theta=10000): fixed in diffusers, not a config key
EPS = 1e-6               # every norm of the model (qk RMSNorms and the affine-free LayerNorms)

CLASS_NAMES = ("FluxTransformer2DModel",)   # diffusers' class: its key in models/registry.ARCHITECTURES


@dataclass
class ModelArgs(CheckedArgs):
    # defaults: FLUX.1-dev (black-forest-labs/FLUX.1-dev transformer/config.json; diffusers' class defaults except
    # guidance_embeds, which dev sets and schnell leaves False)
    patch_size: int = 1
    in_channels: int = 64
    out_channels: int | None = None          # None: same as in_channels (Fill: 384 in, 64 out)
    num_layers: int = 19                     # double-stream blocks
    num_single_layers: int = 38
    attention_head_dim: int = 128
    num_attention_heads: int = 24
    joint_attention_dim: int = 4096
    pooled_projection_dim: int = 768
    guidance_embeds: bool = False
    axes_dims_rope: tuple[int, ...] = (16, 56, 56)

    WHAT = "FLUX.1 transformer config"
    LIMITS = {
        "patch_size": between(1, 16),
        "in_channels": between(1, MAX_WIDTH),
        "out_channels": between(1, MAX_WIDTH),
        "num_layers": between(0, MAX_LAYERS),
        "num_single_layers": between(0, MAX_LAYERS),
        "attention_head_dim": between(1, MAX_HEAD_DIM),
        "num_attention_heads": between(1, MAX_HEADS),
        "joint_attention_dim": between(1, MAX_WIDTH),
        "pooled_projection_dim": between(1, MAX_WIDTH),
        "axes_dims_rope": between(2, MAX_HEAD_DIM, items=(1, 8)),    # (index, height, width) position axes
    }
    RULES = (
        Rule("axes_dims_rope", lambda a: sum(a.axes_dims_rope) == a.attention_head_dim
             and not any(d % 2 for d in a.axes_dims_rope),
             lambda a: f"expected even numbers summing to attention_head_dim {a.attention_head_dim}"),
        Rule("num_attention_heads", lambda a: a.num_attention_heads * a.attention_head_dim <= MAX_WIDTH,
             lambda a: f"num_attention_heads * attention_head_dim (the width) must be at most {MAX_WIDTH}"),
        Rule("num_single_layers", lambda a: a.num_layers + a.num_single_layers > 0,
             lambda a: "num_layers and num_single_layers are both 0; a transformer needs at least one block"),
    )

    def __post_init__(self):
        self.axes_dims_rope = tuple(self.axes_dims_rope)

    @property
    def width(self) -> int:
        return self.num_attention_heads * self.attention_head_dim


MLP_RATIO = 4            # FluxSingleTransformerBlock's mlp_ratio and FeedForward's mult: fixed in diffusers


# -- conditioning ----------------------------------------------------------------------------------------------------

class TimeTextEmbeddings(nn.Module):
    """CombinedTimestep(Guidance)TextProjEmbeddings: MLP(sinusoid_256(t)) [+ MLP(sinusoid_256(guidance))] +
    project(pooled CLIP). The sinusoids are float32, cast to the pooled vector's dtype before the MLPs (diffusers)."""

    def __init__(self, dim: int, pooled_dim: int, guidance_embeds: bool):
        super().__init__()
        self.timestep_embedder = TimestepEmbedding(256, dim)
        if guidance_embeds:
            self.guidance_embedder = TimestepEmbedding(256, dim)
        self.text_embedder = TextProjection(pooled_dim, dim, act_fn="silu")

    def _embed(self, embedder, t):
        # the sinusoid is float32, then cast to the (scaled) timestep's dtype before the MLP, as diffusers
        return embedder(timestep_embedding(t, 256, flip_sin_to_cos=True, downscale_freq_shift=0).astype(t.dtype))

    def __call__(self, timestep, guidance, pooled):
        """`timestep`, `guidance` (scaled_time) and `pooled` in the compute dtype."""
        temb = self._embed(self.timestep_embedder, timestep)
        if guidance is not None and "guidance_embedder" in self:
            temb = temb + self._embed(self.guidance_embedder, guidance)
        return temb + self.text_embedder(pooled)


class AdaLayerNormZeroSingle(nn.Module):
    """Linear(silu(temb)) -> (shift, scale, gate); x -> LayerNorm(x) * (1 + scale) + shift, and the gate."""

    def __init__(self, dim: int):
        super().__init__()
        self.linear = nn.Linear(dim, 3 * dim)

    def __call__(self, x, temb):
        shift, scale, gate = mx.split(self.linear(nn.silu(temb))[:, None], 3, axis=-1)
        return norm_modulate(x, scale, shift, EPS), gate


# -- blocks ----------------------------------------------------------------------------------------------------------

class Attention(nn.Module):
    """FluxAttention. Double-stream (`joint`): q/k/v of the image and the text stream apart, each part RMS-normed by
    its own norms, one SDPA over [text; image] with RoPE, an output projection per stream. Single-stream: q/k/v of
    the joint sequence, no output projection (the block's proj_out takes the attention beside the MLP)."""

    def __init__(self, dim: int, heads: int, head_dim: int, joint: bool):
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        inner = heads * head_dim
        self.to_q = nn.Linear(dim, inner)
        self.to_k = nn.Linear(dim, inner)
        self.to_v = nn.Linear(dim, inner)
        self.norm_q = nn.RMSNorm(head_dim, eps=EPS)
        self.norm_k = nn.RMSNorm(head_dim, eps=EPS)
        if joint:
            self.to_out = [nn.Linear(inner, dim)]
            self.add_q_proj = nn.Linear(dim, inner)
            self.add_k_proj = nn.Linear(dim, inner)
            self.add_v_proj = nn.Linear(dim, inner)
            self.norm_added_q = nn.RMSNorm(head_dim, eps=EPS)
            self.norm_added_k = nn.RMSNorm(head_dim, eps=EPS)
            self.to_add_out = nn.Linear(inner, dim)

    def _heads(self, x):
        return x.reshape(*x.shape[:2], self.heads, self.head_dim)

    def __call__(self, x, cos, sin, context=None, mask=None):
        """mask: a key mask over the joint sequence (models/chroma.py's text padding), None for FLUX.1."""
        q, k, v = (self._heads(f(x)) for f in (self.to_q, self.to_k, self.to_v))
        if context is None:
            out = attention(norm_rope([(q, self.norm_q)], cos, sin, apply_rope),
                            norm_rope([(k, self.norm_k)], cos, sin, apply_rope), v, mask)
            return pace(out)
        cq, ck, cv = (self._heads(f(context)) for f in (self.add_q_proj, self.add_k_proj, self.add_v_proj))
        joint = pace(norm_rope([(cq, self.norm_added_q), (q, self.norm_q)], cos, sin, apply_rope),
                     norm_rope([(ck, self.norm_added_k), (k, self.norm_k)], cos, sin, apply_rope),
                     mx.concatenate([cv, v], axis=1))
        out = pace(attention(*joint, mask))
        n_txt = context.shape[1]
        return self.to_out[0](out[:, n_txt:]), self.to_add_out(out[:, :n_txt])


def modulate(x, mod):
    """LayerNorm(x) * (1 + scale) + shift for an mmdit.Modulation of (B, D) chunks."""
    return norm_modulate(x, mod.scale[:, None], mod.shift[:, None], EPS)


class TransformerBlock(nn.Module):
    """FluxTransformerBlock (double stream): adaLN-Zero per stream, joint attention, a GELU feed-forward per stream."""

    def __init__(self, dim: int, heads: int, head_dim: int):
        super().__init__()
        self.norm1 = AdaLayerNormZero(dim)
        self.norm1_context = AdaLayerNormZero(dim)
        self.attn = Attention(dim, heads, head_dim, joint=True)
        self.ff = FeedForward(dim, MLP_RATIO)
        self.ff_context = FeedForward(dim, MLP_RATIO)

    def __call__(self, x, context, temb, cos, sin):
        img, txt = self.norm1(x, temb), self.norm1_context(context, temb)
        attn_out, context_attn_out = self.attn(img.x_mod, cos, sin, context=txt.x_mod)
        x = gated_residual(x, img.msa.gate[:, None], attn_out)
        x = pace(gated_residual(x, img.mlp.gate[:, None], self.ff(modulate(x, img.mlp))))
        context = gated_residual(context, txt.msa.gate[:, None], context_attn_out)
        context = pace(gated_residual(context, txt.mlp.gate[:, None], self.ff_context(modulate(context, txt.mlp))))
        return clip_fp16(context), x


class SingleTransformerBlock(nn.Module):
    """FluxSingleTransformerBlock over the joint stream h = [text; image]: h + gate * proj_out([attention(n); gelu(
    proj_mlp(n))]) with n = adaLN(h)."""

    def __init__(self, dim: int, heads: int, head_dim: int):
        super().__init__()
        self.norm = AdaLayerNormZeroSingle(dim)
        self.proj_mlp = nn.Linear(dim, MLP_RATIO * dim)
        self.proj_out = nn.Linear(dim + MLP_RATIO * dim, dim)
        self.attn = Attention(dim, heads, head_dim, joint=False)

    def __call__(self, h, temb, cos, sin):
        normed, gate = self.norm(h, temb)
        attn = self.attn(normed, cos, sin)
        mlp = pace(nn.gelu_approx(self.proj_mlp(normed)))
        return clip_fp16(gated_residual(h, gate, self.proj_out(mx.concatenate([attn, mlp], axis=-1))))


def controlnet_index(index_block, blocks, samples, repeat=False) -> int:
    """The ControlNet residual block `index_block` (of `blocks`) adds: diffusers' index // ceil(blocks / samples),
    or index % samples for XLabs' repeated residuals."""
    return index_block % samples if repeat else index_block // -(-blocks // samples)


# embedders, the modulations and the output layers stay in full precision (loading/quantize.py)
FULL_PRECISION = re.compile(r"(x_embedder|context_embedder|time_text_embed\..*|.*norm1(_context)?\.linear|"
                            r"single_transformer_blocks\.\d+\.norm\.linear|norm_out\.linear|proj_out)")


def check_shardable(args: ModelArgs, n: int) -> None:
    """Whether Model.shard can split this config over n ranks (the heads and the MLP width), else one line; checked
    when a tensor-parallel pipeline is loaded, before anything is read."""
    check_divides("FLUX.1 transformer: num_attention_heads", args.num_attention_heads, n, " heads")
    check_divides("FLUX.1 transformer: the MLP width", MLP_RATIO * args.width, n)


class Model(nn.Module):
    """FluxTransformer2DModel.

    __call__(hidden_states (B, N_img, C) packed 2x2 latents, encoder_hidden_states (B, L_txt, J) T5 features,
    pooled_projections (B, P) pooled CLIP, timestep (B,) = sigma in [0, 1] (scaled by 1000 here, as diffusers),
    img_ids (N_img, 3), txt_ids (L_txt, 3) (a batch axis is allowed and element 0 used, as diffusers), guidance (B,)
    or None: the guidance scale itself, ignored by a model without guidance_embeds) -> (B, N_img, patch^2 * C_out).
    `after_block(*outputs)`: the caller's memory policy, called after every block.
    """

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.compute_dtype = mx.float32
        dim, heads, head_dim = args.width, args.num_attention_heads, args.attention_head_dim
        self.time_text_embed = TimeTextEmbeddings(dim, args.pooled_projection_dim, args.guidance_embeds)
        self.context_embedder = nn.Linear(args.joint_attention_dim, dim)
        self.x_embedder = nn.Linear(args.in_channels, dim)
        self.transformer_blocks = [TransformerBlock(dim, heads, head_dim) for _ in range(args.num_layers)]
        self.single_transformer_blocks = [SingleTransformerBlock(dim, heads, head_dim)
                                          for _ in range(args.num_single_layers)]
        self.norm_out = AdaLayerNormContinuous(dim, dim)
        self.proj_out = nn.Linear(dim, args.patch_size * args.patch_size * (args.out_channels or args.in_channels))

    def rope(self, img_ids, txt_ids):
        """cos, sin (L_txt + N_img, head_dim) float32 for [text; image], computed once per set of ids."""
        return cached_rope(self, img_ids, txt_ids, self.args.axes_dims_rope, ROPE_THETA)

    def __call__(self, hidden_states, encoder_hidden_states, pooled_projections, timestep, img_ids, txt_ids,
                 guidance=None, after_block=None, step_cache=None, stream_dtype=None, controlnet_block_samples=None,
                 controlnet_single_block_samples=None, controlnet_blocks_repeat=False):
        """step_cache: a pipelines/step_cache.BlockResiduals that may skip the blocks after the first (it decides).
        stream_dtype: the residual streams' dtype when wider than the compute dtype (backend.stream_dtype).
        controlnet_block_samples / controlnet_single_block_samples: a FLUX.1 ControlNet's residuals
        (models/controlnet_flux1.py), added to the image stream after each block as diffusers spreads them
        (controlnet_blocks_repeat: XLabs' i % N over the double blocks)."""
        dtype = self.compute_dtype
        stream = stream_dtype or dtype
        n_img, n_txt = hidden_states.shape[1], encoder_hidden_states.shape[1]
        cos, sin = self.rope(img_ids, txt_ids)
        if cos.shape[0] != n_txt + n_img:
            raise MlxdiffError(f"position ids cover {cos.shape[0]} tokens but the inputs have {n_txt} text + {n_img} "
                               "image tokens; img_ids/txt_ids must match hidden_states/encoder_hidden_states")
        use_guidance = guidance is not None and self.args.guidance_embeds
        temb = self.time_text_embed(scaled_time(timestep, dtype),
                                    scaled_time(guidance, dtype) if use_guidance else None,
                                    pooled_projections.astype(dtype))
        x = self.x_embedder(hidden_states.astype(dtype)).astype(stream)
        context = self.context_embedder(encoder_hidden_states.astype(dtype)).astype(stream)
        double, single = controlnet_block_samples, controlnet_single_block_samples
        residual = None if not double else lambda i: double[controlnet_index(
            i, len(self.transformer_blocks), len(double), controlnet_blocks_repeat)]
        context, x, x_head, reused = double_stream(self.transformer_blocks, x, context, lambda i: (temb, cos, sin),
                                                   after_block, step_cache, residual)
        if reused is not None:
            return self.proj_out(self.norm_out(x + reused, temb))
        h = mx.concatenate([context, x], axis=1)
        for i, block in enumerate(self.single_transformer_blocks):
            h = compiled_block(block, h, temb, cos, sin)
            if single:
                r = single[controlnet_index(i, len(self.single_transformer_blocks), len(single))]
                h = mx.concatenate([h[:, :n_txt], h[:, n_txt:] + r.astype(h.dtype)], axis=1)
            if after_block:
                after_block(h)
        if step_cache is not None:
            step_cache.remember(h[:, n_txt:] - x_head)
        return self.proj_out(self.norm_out(h[:, n_txt:], temb))

    def shard(self, group):
        """Tensor-parallel over `group` (mlxdiff/distributed.py; the layers: models/sharding.py), as flux2.Model.shard:
        q/k/v, the feed-forward inputs and the single blocks' proj_mlp split by output rows, the attention and
        feed-forward outputs by input columns (one all_sum each; a single block's proj_out in its [attention | MLP]
        parts), the heads divided; modulations, embedders, norm_out and proj_out stay whole on every rank."""
        n = group.size()
        check_shardable(self.args, n)
        for i, block in enumerate(self.transformer_blocks):
            at, where = block.attn, f"transformer_blocks.{i}"
            for name in ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj"):
                setattr(at, name, shard_layer(getattr(at, name), "all-to-sharded", group, f"{where}.attn.{name}"))
            at.to_out[0] = shard_layer(at.to_out[0], "sharded-to-all", group, f"{where}.attn.to_out.0")
            at.to_add_out = shard_layer(at.to_add_out, "sharded-to-all", group, f"{where}.attn.to_add_out")
            at.heads //= n
            for name in ("ff", "ff_context"):
                net = getattr(block, name).net
                net[0].proj = shard_layer(net[0].proj, "all-to-sharded", group, f"{where}.{name}.net.0.proj")
                net[2] = shard_layer(net[2], "sharded-to-all", group, f"{where}.{name}.net.2")
        for i, block in enumerate(self.single_transformer_blocks):
            at, where = block.attn, f"single_transformer_blocks.{i}"
            for name in ("to_q", "to_k", "to_v"):
                setattr(at, name, shard_layer(getattr(at, name), "all-to-sharded", group, f"{where}.attn.{name}"))
            block.proj_mlp = shard_layer(block.proj_mlp, "all-to-sharded", group, f"{where}.proj_mlp")
            block.proj_out = shard_layer(block.proj_out, "sharded-to-all", group, f"{where}.proj_out",
                                         boundaries=(self.args.width,))
            at.heads //= n

    def quant_predicate(self, path, module) -> bool:
        """Which layers may be quantized: not the embedders, the modulations or the output layers."""
        return not FULL_PRECISION.fullmatch(path)

    def sanitize(self, weights: dict) -> dict:
        """diffusers names and layouts are this module's own (no convolutions): nothing to change."""
        return dict(weights)


# -- original (Black Forest Labs) names: BFL's and ComfyUI's single files and GGUFs ----------------------------------

ORIGINAL_PREFIX = "model.diffusion_model."
_P = r"(?:model\.diffusion_model\.)?"      # accepted with or without the prefix (ComfyUI files have it)
_D, _TD = _P + r"double_blocks\.(\d+)\.", r"transformer_blocks.\1."
_S, _TS = _P + r"single_blocks\.(\d+)\.", r"single_transformer_blocks.\1."
_WB = r"\.(weight|bias)"

# BFL name -> diffusers name (diffusers' convert_flux_transformer_checkpoint_to_diffusers). A tuple target splits a
# fused qkv into q, k, v along axis 0; final_layer's modulation is stored (shift, scale) and read (scale, shift).
# RMSNorm weights are `scale` in BFL's code. The single blocks' linear1 ([q; k; v; mlp]) is split by
# original_to_diffusers (its parts are not equal: the MLP is 4 x the width).
ORIGINAL_KEYMAP = [
    (_P + r"img_in" + _WB, r"x_embedder.\1"),
    (_P + r"txt_in" + _WB, r"context_embedder.\1"),
    (_P + r"time_in\.in_layer" + _WB, r"time_text_embed.timestep_embedder.linear_1.\1"),
    (_P + r"time_in\.out_layer" + _WB, r"time_text_embed.timestep_embedder.linear_2.\1"),
    (_P + r"guidance_in\.in_layer" + _WB, r"time_text_embed.guidance_embedder.linear_1.\1"),
    (_P + r"guidance_in\.out_layer" + _WB, r"time_text_embed.guidance_embedder.linear_2.\1"),
    (_P + r"vector_in\.in_layer" + _WB, r"time_text_embed.text_embedder.linear_1.\1"),
    (_P + r"vector_in\.out_layer" + _WB, r"time_text_embed.text_embedder.linear_2.\1"),
    (_P + r"final_layer\.linear" + _WB, r"proj_out.\1"),
    (_P + r"final_layer\.adaLN_modulation\.1" + _WB, r"norm_out.linear.\1", "swap_halves"),
    (_D + r"img_mod\.lin" + _WB, _TD + r"norm1.linear.\2"),
    (_D + r"txt_mod\.lin" + _WB, _TD + r"norm1_context.linear.\2"),
    (_D + r"img_attn\.qkv" + _WB, (_TD + r"attn.to_q.\2", _TD + r"attn.to_k.\2", _TD + r"attn.to_v.\2")),
    (_D + r"txt_attn\.qkv" + _WB,
     (_TD + r"attn.add_q_proj.\2", _TD + r"attn.add_k_proj.\2", _TD + r"attn.add_v_proj.\2")),
    (_D + r"img_attn\.norm\.query_norm\.scale", _TD + "attn.norm_q.weight"),
    (_D + r"img_attn\.norm\.key_norm\.scale", _TD + "attn.norm_k.weight"),
    (_D + r"txt_attn\.norm\.query_norm\.scale", _TD + "attn.norm_added_q.weight"),
    (_D + r"txt_attn\.norm\.key_norm\.scale", _TD + "attn.norm_added_k.weight"),
    (_D + r"img_attn\.proj" + _WB, _TD + r"attn.to_out.0.\2"),
    (_D + r"txt_attn\.proj" + _WB, _TD + r"attn.to_add_out.\2"),
    (_D + r"img_mlp\.0" + _WB, _TD + r"ff.net.0.proj.\2"),
    (_D + r"img_mlp\.2" + _WB, _TD + r"ff.net.2.\2"),
    (_D + r"txt_mlp\.0" + _WB, _TD + r"ff_context.net.0.proj.\2"),
    (_D + r"txt_mlp\.2" + _WB, _TD + r"ff_context.net.2.\2"),
    (_S + r"modulation\.lin" + _WB, _TS + r"norm.linear.\2"),
    (_S + r"linear1" + _WB, _TS + r"linear1.\2"),        # split below
    (_S + r"linear2" + _WB, _TS + r"proj_out.\2"),
    (_S + r"norm\.query_norm\.scale", _TS + "attn.norm_q.weight"),
    (_S + r"norm\.key_norm\.scale", _TS + "attn.norm_k.weight"),
]
_ORIGINAL_RULES = compile_rules(ORIGINAL_KEYMAP)
_LINEAR1 = re.compile(r"single_transformer_blocks\.(\d+)\.linear1\.(weight|bias)")
# the parts of linear1's rows, in width units: q, k, v, then the MLP (MLP_RATIO widths)
_LINEAR1_PARTS = (("attn.to_q", 1), ("attn.to_k", 1), ("attn.to_v", 1), ("proj_mlp", MLP_RATIO))

# LoRAs (lora/, the protocol's LoRADenoiser)
LORA_NAME = "FLUX.1 transformer"
LORA_ARCHITECTURE = "FLUX.1"     # its label in lora.ARCHITECTURES
LORA_ORDER = 30     # its own names before those it shares with FLUX.2 and SD3 (their rows)
# the layer names that tell a LoRA is for it: (pattern, labels) rows of lora.ARCHITECTURES (lora/names.py tries
# them in the modules' LORA_ORDER, the first that a name matches saying which architectures it fits).
# The names it shares with FLUX.2 and SD3 are in theirs (flux2.py, mmdit.py).
LORA_ARCHITECTURE_PATTERNS = (
    (re.compile(r"(^|[._])(double_blocks[._]\d+[._](img|txt)_mod|single_blocks[._]\d+[._]modulation|vector_in|"
                r"single_transformer_blocks[._]\d+[._](proj_mlp|proj_out|norm[._]linear|attn[._]to_[qkv]))([._]|$)"),
     (LORA_ARCHITECTURE,)),)


# for LoRAs, linear1's rows go to their layers by the table itself: 7 equal row pieces, the MLP's four together
_LORA_RULES = compile_rules([rule if "linear1" not in rule[0] else
                             (rule[0], tuple(_TS + rf"{name}.\2" for name, widths in _LINEAR1_PARTS
                                             for _ in range(widths))) for rule in ORIGINAL_KEYMAP])


# XLabs' names (x-flux): processor.qkv_lora1 / proj_lora1 the image stream's attention, _lora2 the text stream's; a
# single block's qkv_lora its q, k, v (not the MLP rows of linear1), proj_lora its linear2
_XLABS_RULES = compile_rules([
    (_D + r"processor\.qkv_lora1\.weight", tuple(_TD + f"attn.to_{c}.weight" for c in "qkv")),
    (_D + r"processor\.proj_lora1\.weight", _TD + "attn.to_out.0.weight"),
    (_D + r"processor\.qkv_lora2\.weight", tuple(_TD + f"attn.add_{c}_proj.weight" for c in "qkv")),
    (_D + r"processor\.proj_lora2\.weight", _TD + "attn.to_add_out.weight"),
    (_S + r"processor\.qkv_lora\.weight", tuple(_TS + f"attn.to_{c}.weight" for c in "qkv")),
    (_S + r"processor\.proj_lora\.weight", _TS + "proj_out.weight"),
])


def lora_original_rules(args) -> list:
    return _LORA_RULES + _XLABS_RULES


# what marks FLUX.1's BFL names against FLUX.2's (which has neither vector_in nor per-block modulations)
_FLUX1_MARK = re.compile(_P + r"(vector_in\.|double_blocks\.\d+\.img_mod\.|single_blocks\.\d+\.modulation\.)")
_DOUBLE_KEY = re.compile(r"double_blocks\.(\d+)\.")
_SINGLE_KEY = re.compile(r"single_blocks\.(\d+)\.")


def is_original(names) -> bool:
    """Whether tensor names are BFL's FLUX.1 names (with or without the prefix)."""
    return any(_FLUX1_MARK.match(n) for n in names)


def split_linear1(value) -> list:
    """linear1's rows [q; k; v; mlp] -> the four parts, kept in the stored form (split into 3 + MLP_RATIO equal
    pieces of the hidden size's rows; the MLP's joined again)."""
    pieces = split_rows(value, 3 + MLP_RATIO)
    return [pieces[0], pieces[1], pieces[2], concat_rows(pieces[3:])]


def original_to_diffusers(weights: dict, check=True) -> dict:
    """BFL names -> diffusers names (lazy: nothing is read). check=False: for Chroma's blocks (models/chroma.py),
    which have these names but none of the modulation layers that mark a FLUX.1 file."""
    weights = under_prefix_if_present(weights, ORIGINAL_PREFIX)
    if check and not is_original(weights):
        raise MlxdiffError("not a FLUX.1 original checkpoint: no vector_in / double_blocks.N.img_mod / "
                           "single_blocks.N.modulation keys")
    out = {}
    for key, value in remap(weights, _ORIGINAL_RULES).items():
        m = _LINEAR1.fullmatch(key)
        if m is None:
            out[key] = value
            continue
        rows = value.shape[0]
        if rows % (3 + MLP_RATIO):
            raise MlxdiffError(f"FLUX.1 original checkpoint: single_blocks.{m.group(1)}.linear1.{m.group(2)} has "
                               f"{rows} rows; expected 7 x the hidden size (q, k, v and the 4x MLP)")
        for (name, _), part in zip(_LINEAR1_PARTS, split_linear1(value)):
            out[f"single_transformer_blocks.{m.group(1)}.{name}.{m.group(2)}"] = part
    return out


def _shape(weights, key, ndim=2):
    return required_shape(weights, key, "FLUX.1", ndim)


def _block_count(weights, pattern, what):
    indices = sorted({int(m.group(1)) for k in weights if (m := pattern.match(k))})
    if indices != list(range(len(indices))):
        raise MlxdiffError(f"FLUX.1 original checkpoint: {what} indices are not 0..n-1 ({indices[:8]}...); the file "
                           "is incomplete")
    return len(indices)


NOT_IN_WEIGHTS = {"patch_size": 1}       # every released FLUX.1 has 1
FROM_BASE_CONFIG = ("axes_dims_rope",)   # taken from a pipeline folder's config when given


def fused_shapes(dim, double, single) -> dict:
    """{BFL key: (shape, how its rows are made)} of the tensors split at fixed offsets: the qkv of the double
    blocks, the single blocks' linear1 and linear2 and final_layer's modulation."""
    out = {"final_layer.adaLN_modulation.1.weight": ((2 * dim, dim), f"2 x {dim} rows (shift, scale)")}
    for i in range(double):
        for stream in ("img", "txt"):
            out[f"double_blocks.{i}.{stream}_attn.qkv.weight"] = ((3 * dim, dim), f"3 x {dim} rows (q, k, v)")
    for i in range(single):
        out[f"single_blocks.{i}.linear1.weight"] = (
            ((3 + MLP_RATIO) * dim, dim), f"3 x {dim} + {MLP_RATIO} x {dim} rows (q, k, v; the MLP)")
        out[f"single_blocks.{i}.linear2.weight"] = ((dim, (1 + MLP_RATIO) * dim),
                                                    f"{dim} + {MLP_RATIO * dim} columns (attention, MLP)")
    return out


def config_from_original(weights: dict, check=True) -> dict:
    """The diffusers config of a BFL-named FLUX.1 checkpoint (dev, schnell, Krea, Kontext, Fill), from its names and
    shapes: D and in_channels from img_in [D, C] (Fill: 384), joint_attention_dim from txt_in, the pooled size from
    vector_in, guidance_embeds = guidance_in present (dev: yes, schnell: no), the block counts from the indices,
    head_dim from the QK-norm length, out_channels from final_layer (patch_size 1). axes_dims_rope: only its sum
    (head_dim) is in the weights; BFL's split is (16, 56, 56) for 128, head_dim / 8 then the rest halved."""
    weights = under_prefix_if_present(weights, ORIGINAL_PREFIX)
    if check and not is_original(weights):     # check=False: Chroma's blocks (no vector_in: no pooled size)
        raise MlxdiffError("not a FLUX.1 original checkpoint: no vector_in / double_blocks.N.img_mod / "
                           "single_blocks.N.modulation keys")
    dim, in_channels = _shape(weights, "img_in.weight")
    num_layers = _block_count(weights, _DOUBLE_KEY, "double_blocks")
    num_single = _block_count(weights, _SINGLE_KEY, "single_blocks")
    if num_layers:
        head_dim = _shape(weights, "double_blocks.0.img_attn.norm.query_norm.scale", 1)[0]
    elif num_single:
        head_dim = _shape(weights, "single_blocks.0.norm.query_norm.scale", 1)[0]
    else:
        raise MlxdiffError("FLUX.1 original checkpoint has neither double_blocks nor single_blocks")
    if dim % head_dim:
        raise MlxdiffError(f"FLUX.1 original checkpoint: hidden size {dim} and QK-norm length {head_dim} do not give "
                           "a whole number of heads")
    check_fused_rows(weights, fused_shapes(dim, num_layers, num_single), "FLUX.1")
    out_channels = _shape(weights, "final_layer.linear.weight")[0]
    first = head_dim // 8
    return {
        "patch_size": NOT_IN_WEIGHTS["patch_size"],
        "in_channels": in_channels,
        "out_channels": None if out_channels == in_channels else out_channels,
        "num_layers": num_layers,
        "num_single_layers": num_single,
        "attention_head_dim": head_dim,
        "num_attention_heads": dim // head_dim,
        "joint_attention_dim": _shape(weights, "txt_in.weight")[1],
        "pooled_projection_dim": _shape(weights, "vector_in.in_layer.weight")[1] if check else None,
        "guidance_embeds": "guidance_in.in_layer.weight" in weights,
        "axes_dims_rope": [first, (head_dim - first) // 2, (head_dim - first) // 2],
    }
