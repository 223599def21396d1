"""UNet2DConditionModel (SD 1.5 / SDXL): diffusers/models/unets/unet_2d_condition.py, re-implemented in MLX.

Attribute names mirror diffusers, so a diffusers state dict loads 1:1 after `sanitize` (conv weights
OIHW -> OHWI). Inside everything runs channels-last (NHWC); `Model.__call__` takes and returns NCHW like diffusers
(one transpose at each end), so pipelines keep diffusers' latent layout.

Covered: CrossAttnDownBlock2D / DownBlock2D, CrossAttnUpBlock2D / UpBlock2D, UNetMidBlock2DCrossAttn, 1x1-conv or
linear projections in the transformers, and SDXL's "text_time" added conditioning. Anything else is refused.
"""

import re
from dataclasses import dataclass
from functools import lru_cache, partial
from typing import Optional

import mlx.core as mx
import mlx.nn as nn

from ..config_checks import CheckedArgs
from ..errors import MlxdiffError
from ..formats.keymaps import compile_rules, remap, required_shape, under_prefix_if_present
from .embeddings import TimestepEmbedding, timestep_embedding
from .fused import attention, compiled_block
from .vae import Conv2d

DOWN_TYPES = ("CrossAttnDownBlock2D", "DownBlock2D")
UP_TYPES = ("CrossAttnUpBlock2D", "UpBlock2D")
MID_TYPES = ("UNetMidBlock2DCrossAttn",)

CLASS_NAMES = ("UNet2DConditionModel",)   # diffusers' class: its key in models/registry.ARCHITECTURES


@dataclass
class ModelArgs(CheckedArgs):
    # defaults: SD 1.5 (unet/config.json)
    in_channels: int = 4
    out_channels: int = 4
    sample_size: int | tuple[int, ...] = 64
    center_input_sample: bool = False
    flip_sin_to_cos: bool = True
    freq_shift: int = 0
    down_block_types: tuple[str, ...] = ("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",)
    mid_block_type: Optional[str] = "UNetMidBlock2DCrossAttn"
    up_block_types: tuple[str, ...] = ("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3
    only_cross_attention: bool | tuple[bool, ...] = False
    block_out_channels: tuple[int, ...] = (320, 640, 1280, 1280)
    layers_per_block: int | tuple[int, ...] = 2
    downsample_padding: int = 1
    mid_block_scale_factor: float = 1.0
    act_fn: str = "silu"
    norm_num_groups: Optional[int] = 32
    norm_eps: float = 1e-5
    cross_attention_dim: int | tuple[int, ...] = 768
    transformer_layers_per_block: int | tuple[int, ...] = 1
    reverse_transformer_layers_per_block: Optional[tuple] = None
    encoder_hid_dim: Optional[int] = None
    encoder_hid_dim_type: Optional[str] = None
    attention_head_dim: int | tuple[int, ...] = 8
    num_attention_heads: Optional[int | tuple[int, ...]] = None
    dual_cross_attention: bool = False
    use_linear_projection: bool = False
    class_embed_type: Optional[str] = None
    addition_embed_type: Optional[str] = None
    addition_time_embed_dim: Optional[int] = None
    num_class_embeds: Optional[int] = None
    upcast_attention: Optional[bool] = False     # accepted and ignored (no upcast of the scores)
    resnet_time_scale_shift: str = "default"
    resnet_skip_time_act: bool = False
    resnet_out_scale_factor: float = 1.0
    time_embedding_type: str = "positional"
    time_embedding_dim: Optional[int] = None
    time_embedding_act_fn: Optional[str] = None
    timestep_post_act: Optional[str] = None
    time_cond_proj_dim: Optional[int] = None
    conv_in_kernel: int = 3
    conv_out_kernel: int = 3
    projection_class_embeddings_input_dim: Optional[int] = None
    attention_type: str = "default"
    class_embeddings_concat: bool = False
    mid_block_only_cross_attention: Optional[bool] = None
    cross_attention_norm: Optional[str] = None
    addition_embed_type_num_heads: int = 64

    WHAT = "UNet config"

    def __post_init__(self):
        def refuse(key, why):
            raise MlxdiffError(f"{self.WHAT}: {key} is {getattr(self, key)!r}; {why}")

        n = len(self.block_out_channels)
        if n < 1:
            refuse("block_out_channels", "expected at least one level")
        for key, types, allowed in (("down_block_types", self.down_block_types, DOWN_TYPES),
                                    ("up_block_types", self.up_block_types, UP_TYPES)):
            bad = [t for t in types if t not in allowed]
            if bad:
                refuse(key, f"block types {bad} are not supported; supported: {', '.join(allowed)}")
            if len(types) != n:
                refuse(key, f"expected one per block_out_channels entry ({n})")
        if self.mid_block_type not in MID_TYPES:
            refuse("mid_block_type", f"not supported; supported: {', '.join(MID_TYPES)}")
        unsupported = {
            "class_embed_type": None, "encoder_hid_dim_type": None, "time_cond_proj_dim": None,
            "time_embedding_dim": None, "time_embedding_act_fn": None, "timestep_post_act": None,
            "num_class_embeds": None, "dual_cross_attention": False, "center_input_sample": False,
            "resnet_time_scale_shift": "default", "resnet_skip_time_act": False, "time_embedding_type": "positional",
            "attention_type": "default", "class_embeddings_concat": False, "cross_attention_norm": None,
            "act_fn": "silu", "conv_in_kernel": 3, "conv_out_kernel": 3, "resnet_out_scale_factor": 1.0,
            "mid_block_scale_factor": 1.0, "downsample_padding": 1, "reverse_transformer_layers_per_block": None,
        }
        for key, want in unsupported.items():
            if getattr(self, key) != want:
                refuse(key, f"not supported; only {want!r} is implemented")
        if any(self._per_level(self.only_cross_attention, "only_cross_attention")) or \
                self.mid_block_only_cross_attention:
            refuse("only_cross_attention", "not supported; only false is implemented")
        if self.addition_embed_type not in (None, "text_time"):
            refuse("addition_embed_type", "not supported; only null or \"text_time\" is implemented")
        if self.addition_embed_type == "text_time" and (
                not self.addition_time_embed_dim or not self.projection_class_embeddings_input_dim):
            refuse("addition_embed_type", "\"text_time\" needs addition_time_embed_dim and "
                                          "projection_class_embeddings_input_dim")
        if not self.norm_num_groups:
            refuse("norm_num_groups", "expected a positive number of groups")
        for c in self.block_out_channels:
            if c % self.norm_num_groups:
                refuse("block_out_channels", f"each must be a multiple of norm_num_groups {self.norm_num_groups}")
        for i, (c, heads) in enumerate(zip(self.block_out_channels, self.heads)):
            if heads < 1 or c % heads:
                refuse("attention_head_dim", f"level {i}: {c} channels do not split into {heads} heads")
        self.layers = self._per_level(self.layers_per_block, "layers_per_block")
        self.transformer_layers = self._per_level(self.transformer_layers_per_block, "transformer_layers_per_block")
        self.cross_dims = self._per_level(self.cross_attention_dim, "cross_attention_dim")

    def _per_level(self, value, key):
        n = len(self.block_out_channels)
        if isinstance(value, (list, tuple)):
            if len(value) != n:
                raise MlxdiffError(f"{self.WHAT}: {key} is {list(value)!r}; expected one per block_out_channels "
                                   f"entry ({n})")
            if any(isinstance(v, (list, tuple)) for v in value):
                raise MlxdiffError(f"{self.WHAT}: {key} is {list(value)!r}; nested lists are not supported")
            return tuple(value)
        return (value,) * n

    @property
    def heads(self):
        # diffusers' naming quirk: num_attention_heads defaults to attention_head_dim (which then counts heads)
        value = self.num_attention_heads if self.num_attention_heads is not None else self.attention_head_dim
        return self._per_level(value, "num_attention_heads")


def group_norm(groups, channels, eps):
    return nn.GroupNorm(groups, channels, eps=eps, pytorch_compatible=True)


class ResnetBlock2D(nn.Module):
    """GN -> silu -> conv3x3 -> + time_emb_proj(silu(temb)) -> GN -> silu -> conv3x3, plus the (1x1-conv) input."""

    def __init__(self, in_channels, out_channels, temb_channels, groups, eps):
        super().__init__()
        self.norm1 = group_norm(groups, in_channels, eps)
        self.conv1 = Conv2d(in_channels, out_channels, 3, padding=1)
        self.time_emb_proj = nn.Linear(temb_channels, out_channels)
        self.norm2 = group_norm(groups, out_channels, eps)
        self.conv2 = Conv2d(out_channels, out_channels, 3, padding=1)
        if in_channels != out_channels:
            self.conv_shortcut = nn.Conv2d(in_channels, out_channels, 1)

    def __call__(self, x, temb):
        h = self.conv1(nn.silu(self.norm1(x)))
        h = h + self.time_emb_proj(nn.silu(temb))[:, None, None, :]
        h = self.conv2(nn.silu(self.norm2(h)))
        if "conv_shortcut" in self:
            x = self.conv_shortcut(x)
        return x + h


class Attention(nn.Module):
    def __init__(self, dim, heads, head_dim, context_dim=None):
        super().__init__()
        inner = heads * head_dim
        context_dim = context_dim or dim
        self.heads, self.scale = heads, head_dim ** -0.5
        self.to_q = nn.Linear(dim, inner, bias=False)
        self.to_k = nn.Linear(context_dim, inner, bias=False)
        self.to_v = nn.Linear(context_dim, inner, bias=False)
        self.to_out = [nn.Linear(inner, dim)]

    def _split(self, x):
        b, s, _ = x.shape
        return x.reshape(b, s, self.heads, -1).transpose(0, 2, 1, 3)

    def __call__(self, x, context=None):
        context = x if context is None else context
        q, k, v = self._split(self.to_q(x)), self._split(self.to_k(context)), self._split(self.to_v(context))
        out = attention(q, k, v, self.scale)
        b, _, s, _ = out.shape
        return self.to_out[0](out.transpose(0, 2, 1, 3).reshape(b, s, -1))


class GEGLU(nn.Module):
    def __init__(self, dim_in, dim_out):
        super().__init__()
        self.proj = nn.Linear(dim_in, dim_out * 2)

    def __call__(self, x):
        hidden, gate = mx.split(self.proj(x), 2, axis=-1)
        return hidden * nn.gelu(gate)


class FeedForward(nn.Module):
    def __init__(self, dim, mult=4):
        super().__init__()
        self.net = [GEGLU(dim, dim * mult), nn.Identity(), nn.Linear(dim * mult, dim)]   # net.1: dropout

    def __call__(self, x):
        return self.net[2](self.net[0](x))


class BasicTransformerBlock(nn.Module):
    def __init__(self, dim, heads, head_dim, context_dim):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-5)
        self.attn1 = Attention(dim, heads, head_dim)
        self.norm2 = nn.LayerNorm(dim, eps=1e-5)
        self.attn2 = Attention(dim, heads, head_dim, context_dim)
        self.norm3 = nn.LayerNorm(dim, eps=1e-5)
        self.ff = FeedForward(dim)

    def __call__(self, x, context):
        x = x + self.attn1(self.norm1(x))
        x = x + self.attn2(self.norm2(x), context)
        return x + self.ff(self.norm3(x))


class Transformer2DModel(nn.Module):
    """GroupNorm -> proj_in (1x1 conv or Linear) -> transformer blocks -> proj_out, plus the input."""

    def __init__(self, channels, heads, context_dim, layers, groups, linear):
        super().__init__()
        self.linear = linear
        self.norm = group_norm(groups, channels, 1e-6)
        make = (lambda: nn.Linear(channels, channels)) if linear else (lambda: nn.Conv2d(channels, channels, 1))
        self.proj_in = make()
        self.transformer_blocks = [BasicTransformerBlock(channels, heads, channels // heads, context_dim)
                                   for _ in range(layers)]
        self.proj_out = make()

    def __call__(self, x, context):
        b, h, w, c = x.shape
        t = self.norm(x)
        t = self.proj_in(t.reshape(b, h * w, c)) if self.linear else self.proj_in(t).reshape(b, h * w, c)
        for block in self.transformer_blocks:
            t = block(t, context)
        t = self.proj_out(t).reshape(b, h, w, c) if self.linear else self.proj_out(t.reshape(b, h, w, c))
        return x + t


class Downsample2D(nn.Module):
    def __init__(self, channels):
        super().__init__()
        self.conv = Conv2d(channels, channels, 3, stride=2, padding=1)

    def __call__(self, x):
        return self.conv(x)


class Upsample2D(nn.Module):
    """Nearest-neighbour to `size` (default 2x), then a 3x3 conv."""

    def __init__(self, channels):
        super().__init__()
        self.conv = Conv2d(channels, channels, 3, padding=1)

    def __call__(self, x, size=None):
        b, h, w, c = x.shape
        if size is None or tuple(size) == (2 * h, 2 * w):
            x = mx.broadcast_to(x[:, :, None, :, None, :], (b, h, 2, w, 2, c)).reshape(b, 2 * h, 2 * w, c)
        else:   # torch's nearest: source index floor(i * in / out)
            rows = mx.array([i * h // size[0] for i in range(size[0])])
            cols = mx.array([j * w // size[1] for j in range(size[1])])
            x = x[:, rows][:, :, cols]
        return self.conv(x)


class DownBlock(nn.Module):
    """DownBlock2D, or CrossAttnDownBlock2D when `attn` (heads, context_dim, layers, linear) is given."""

    def __init__(self, in_channels, out_channels, temb, layers, groups, eps, add_downsample, attn=None):
        super().__init__()
        self.resnets = [ResnetBlock2D(in_channels if i == 0 else out_channels, out_channels, temb, groups, eps)
                        for i in range(layers)]
        if attn is not None:
            self.attentions = [Transformer2DModel(out_channels, *attn[:3], groups, attn[3]) for _ in range(layers)]
        if add_downsample:
            self.downsamplers = [Downsample2D(out_channels)]

    def __call__(self, x, temb, context):
        skips = []
        attentions = self.get("attentions", [None] * len(self.resnets))
        for resnet, attn in zip(self.resnets, attentions):
            x = compiled_block(resnet, x, temb)
            if attn is not None:
                x = compiled_block(attn, x, context)
            skips.append(x)
        for down in self.get("downsamplers", []):
            x = down(x)
            skips.append(x)
        return x, skips


class UpBlock(nn.Module):
    """UpBlock2D, or CrossAttnUpBlock2D when `attn` is given; concatenates the skips on channels."""

    def __init__(self, in_channels, prev_channels, out_channels, temb, layers, groups, eps, add_upsample,
                 attn=None):
        super().__init__()
        self.resnets = []
        for i in range(layers):
            skip = in_channels if i == layers - 1 else out_channels
            first = prev_channels if i == 0 else out_channels
            self.resnets.append(ResnetBlock2D(first + skip, out_channels, temb, groups, eps))
        if attn is not None:
            self.attentions = [Transformer2DModel(out_channels, *attn[:3], groups, attn[3]) for _ in range(layers)]
        if add_upsample:
            self.upsamplers = [Upsample2D(out_channels)]

    def __call__(self, x, skips, temb, context, size=None):
        attentions = self.get("attentions", [None] * len(self.resnets))
        for resnet, attn in zip(self.resnets, attentions):
            x = compiled_block(resnet, mx.concatenate([x, skips.pop()], axis=-1), temb)
            if attn is not None:
                x = compiled_block(attn, x, context)
        for up in self.get("upsamplers", []):
            x = up(x, size)
        return x


class UNetMidBlock2DCrossAttn(nn.Module):
    def __init__(self, channels, temb, groups, eps, attn):
        super().__init__()
        self.resnets = [ResnetBlock2D(channels, channels, temb, groups, eps) for _ in range(2)]
        self.attentions = [Transformer2DModel(channels, *attn[:3], groups, attn[3])]

    def __call__(self, x, temb, context):
        x = compiled_block(self.resnets[0], x, temb)
        for attn, resnet in zip(self.attentions, self.resnets[1:]):
            x = compiled_block(resnet, compiled_block(attn, x, context), temb)
        return x


def attention_of(a: ModelArgs, level: int):
    """A level's transformer settings (heads, cross-attention width, depth, linear projections) as the blocks take
    them."""
    return a.heads[level], a.cross_dims[level], a.transformer_layers[level], a.use_linear_projection


def down_blocks(a: ModelArgs) -> list:
    """The down path of a UNet2DConditionModel (and of a ControlNetModel, which copies it)."""
    boc, n, temb = a.block_out_channels, len(a.block_out_channels), a.block_out_channels[0] * 4
    blocks, out_ch = [], boc[0]
    for i, kind in enumerate(a.down_block_types):
        in_ch, out_ch = out_ch, boc[i]
        blocks.append(DownBlock(in_ch, out_ch, temb, a.layers[i], a.norm_num_groups, a.norm_eps, i < n - 1,
                                attention_of(a, i) if kind == "CrossAttnDownBlock2D" else None))
    return blocks


def add_embeddings(model, a: ModelArgs) -> None:
    """The timestep MLP and, for SDXL ("text_time"), the pooled-text-and-sizes MLP, onto `model` (a UNet or a
    ControlNet: the same names)."""
    temb = a.block_out_channels[0] * 4
    model.time_embedding = TimestepEmbedding(a.block_out_channels[0], temb)
    if a.addition_embed_type == "text_time":
        model.add_embedding = TimestepEmbedding(a.projection_class_embeddings_input_dim, temb)


def embed_time(model, a: ModelArgs, timestep, sample, added_cond_kwargs=None):
    """The time embedding a UNet (or ControlNet) adds in every resnet, for `sample`'s batch, in its dtype: the
    timestep's sinusoids through time_embedding, plus SDXL's add_embedding of the pooled text and the six size /
    crop ids."""
    batch, dtype = sample.shape[0], sample.dtype
    t = mx.broadcast_to(mx.array(timestep).reshape(-1), (batch,))
    emb = timestep_embedding(t, a.block_out_channels[0], a.flip_sin_to_cos, a.freq_shift).astype(dtype)
    emb = model.time_embedding(emb)
    if a.addition_embed_type == "text_time":
        if not added_cond_kwargs or "text_embeds" not in added_cond_kwargs or "time_ids" not in added_cond_kwargs:
            raise MlxdiffError(f"this {a.WHAT.split()[0]} (addition_embed_type \"text_time\") needs added_cond_kwargs "
                               "with \"text_embeds\" and \"time_ids\"")
        time_ids = added_cond_kwargs["time_ids"]
        time_embeds = timestep_embedding(time_ids.reshape(-1), a.addition_time_embed_dim, a.flip_sin_to_cos,
                                         a.freq_shift).reshape(time_ids.shape[0], -1)
        add = mx.concatenate([added_cond_kwargs["text_embeds"].astype(dtype), time_embeds.astype(dtype)], axis=-1)
        emb = emb + model.add_embedding(add)
    return emb


class Model(nn.Module):
    """UNet2DConditionModel. `sample` (B, C, H, W) and the returned noise prediction are NCHW like diffusers;
    `timestep` a scalar or (B,) array; `encoder_hidden_states` (B, S, cross_attention_dim); for SDXL
    `added_cond_kwargs={"text_embeds": (B, D), "time_ids": (B, 6)}`. Computes in the sample's dtype."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = a = args
        boc, groups, eps, n = a.block_out_channels, a.norm_num_groups, a.norm_eps, len(a.block_out_channels)
        temb = boc[0] * 4
        self.conv_in = Conv2d(a.in_channels, boc[0], 3, padding=1)
        add_embeddings(self, a)
        self.down_blocks = down_blocks(a)
        self.mid_block = UNetMidBlock2DCrossAttn(boc[-1], temb, groups, eps, attention_of(a, n - 1))
        attn = partial(attention_of, a)
        rev = list(reversed(boc))
        self.up_blocks = []
        out_ch = rev[0]
        for i, kind in enumerate(a.up_block_types):
            prev, out_ch, in_ch = out_ch, rev[i], rev[min(i + 1, n - 1)]
            j = n - 1 - i   # the matching down level (diffusers reverses the per-level lists)
            self.up_blocks.append(UpBlock(in_ch, prev, out_ch, temb, a.layers[j] + 1, groups, eps, i < n - 1,
                                          attn(j) if kind == "CrossAttnUpBlock2D" else None))
        self.conv_norm_out = group_norm(groups, boc[0], eps)
        self.conv_out = Conv2d(boc[0], a.out_channels, 3, padding=1)

    def __call__(self, sample, timestep, encoder_hidden_states, added_cond_kwargs=None, after_block=None,
                 down_block_additional_residuals=None, mid_block_additional_residual=None):
        """`after_block(x)`: the caller's memory policy, called with each block's output (pipelines/base.py).
        `down_block_additional_residuals` / `mid_block_additional_residual`: a ControlNet's outputs (models/
        controlnet.py; channels-last, as this model's skips are), added to the skips and the middle block's output as
        diffusers' UNet adds them."""
        a = self.args
        after_block = after_block or (lambda *outputs: None)
        dtype = sample.dtype
        emb = embed_time(self, a, timestep, sample, added_cond_kwargs)
        context = encoder_hidden_states.astype(dtype)

        x = self.conv_in(sample.transpose(0, 2, 3, 1))
        skips = [x]
        for block in self.down_blocks:
            x, out = block(x, emb, context)
            skips.extend(out)
            after_block(*out)
        x = self.mid_block(x, emb, context)
        if down_block_additional_residuals is not None:
            if len(down_block_additional_residuals) != len(skips):
                raise MlxdiffError(f"the ControlNet gives {len(down_block_additional_residuals)} down-block residuals "
                                   f"but the UNet has {len(skips)} skips; they do not belong together")
            skips = [s + r.astype(dtype) for s, r in zip(skips, down_block_additional_residuals)]
        if mid_block_additional_residual is not None:
            x = x + mid_block_additional_residual.astype(dtype)
        after_block(x)
        n = len(a.block_out_channels)
        for i, block in enumerate(self.up_blocks):
            # the skips it takes, one per resnet, from the config: a streamed block is not looked inside
            count = a.layers[n - 1 - i] + 1
            mine, skips = skips[-count:], skips[:-count]
            size = skips[-1].shape[1:3] if skips else None
            x = block(x, mine, emb, context, size)
            after_block(x)
        x = self.conv_out(nn.silu(self.conv_norm_out(x)))
        return x.transpose(0, 3, 1, 2)

    def quant_predicate(self, path, module) -> bool:
        """Every layer may be quantized (convolutions too) but conv_in and conv_out, which read and write the 4
        latent channels themselves: small, and their error lands on every latent value unaveraged (loading/quantize
        also keeps any convolution with fewer than 16 input or output channels)."""
        return path not in ("conv_in", "conv_out")

    def sanitize(self, weights: dict) -> dict:
        """diffusers names and PyTorch layouts -> this module: every 4-D (conv) weight OIHW -> OHWI (a palettized
        kernel of a Core ML package comes in OHWI already: formats/coreml.open_diffusers)."""
        return {k: (v.transpose(0, 2, 3, 1) if k.endswith(".weight") and len(v.shape) == 4
                    and isinstance(v, mx.array) else v)
                for k, v in weights.items()}


# -- original single files (ldm / SGM names: v1-5-pruned-emaonly, sd_xl_base_1.0, `model.diffusion_model.*`) --------
# Read as diffusers' convert_ldm_unet_checkpoint / create_unet_diffusers_config_from_ldm read them, written as tables.

ORIGINAL_PREFIX = "model.diffusion_model."
FROM_BASE_CONFIG = ("sample_size",)  # the default image size is not in the weights

# ldm ResBlock / SpatialTransformer parts -> diffusers' (pattern, target); the suffix is appended per use
RESNET_PARTS = [(r"in_layers\.0", "norm1"), (r"in_layers\.2", "conv1"), (r"emb_layers\.1", "time_emb_proj"),
                (r"out_layers\.0", "norm2"), (r"out_layers\.3", "conv2"), (r"skip_connection", "conv_shortcut")]
# (same names in both; spelled out, with no dot inside a group, so that kohya's underscore-folded LoRA names match
# the rules folded the same way: lora.names._original_rules)
ATTENTION_PARTS = [(r"norm", "norm"), (r"proj_(in|out)", r"proj_\1"),
                   (r"transformer_blocks\.(\d+)\.(norm[123])", r"transformer_blocks.\1.\2"),
                   (r"transformer_blocks\.(\d+)\.(attn[12])\.(to_q|to_k|to_v)", r"transformer_blocks.\1.\2.\3"),
                   (r"transformer_blocks\.(\d+)\.(attn[12])\.to_out\.0", r"transformer_blocks.\1.\2.to_out.0"),
                   (r"transformer_blocks\.(\d+)\.ff\.net\.0\.proj", r"transformer_blocks.\1.ff.net.0.proj"),
                   (r"transformer_blocks\.(\d+)\.ff\.net\.2", r"transformer_blocks.\1.ff.net.2")]
SUFFIX = r"\.(?P<p>weight|bias)"
TOP_LEVEL = [
    (r"time_embed\.0" + SUFFIX, r"time_embedding.linear_1.\g<p>"),
    (r"time_embed\.2" + SUFFIX, r"time_embedding.linear_2.\g<p>"),
    (r"label_emb\.0\.0" + SUFFIX, r"add_embedding.linear_1.\g<p>"),   # SDXL's text_time embedding
    (r"label_emb\.0\.2" + SUFFIX, r"add_embedding.linear_2.\g<p>"),
    (r"input_blocks\.0\.0" + SUFFIX, r"conv_in.\g<p>"),
    (r"out\.0" + SUFFIX, r"conv_norm_out.\g<p>"),
    (r"out\.2" + SUFFIX, r"conv_out.\g<p>"),
]


def _parts(old, new, parts):
    return [(rf"{old}\.{pattern}{SUFFIX}", rf"{new}.{target}.\g<p>") for pattern, target in parts]


def original_keymap(layers_per_block=2, levels=4) -> list:
    """The rule table for a UNet of `levels` resolution levels with `layers_per_block` resnets each (every released
    SD 1.x / 2.x / XL UNet: 2). ldm numbers its blocks flat: input_blocks.{n} (n >= 1) is down level
    (n - 1) // (L + 1), layer (n - 1) % (L + 1), the last of each level the downsampler (`0.op`); output_blocks.{n}
    is up level n // (L + 1), layer n % (L + 1), with the upsampler (`conv`) after the attention if there is one."""
    rules = list(TOP_LEVEL)
    rules += _parts(r"middle_block\.0", "mid_block.resnets.0", RESNET_PARTS)
    rules += _parts(r"middle_block\.1", "mid_block.attentions.0", ATTENTION_PARTS)
    rules += _parts(r"middle_block\.2", "mid_block.resnets.1", RESNET_PARTS)
    per = layers_per_block + 1
    for n in range(1, levels * per):
        level, layer = divmod(n - 1, per)
        if layer < layers_per_block:
            rules += _parts(rf"input_blocks\.{n}\.0", f"down_blocks.{level}.resnets.{layer}", RESNET_PARTS)
            rules += _parts(rf"input_blocks\.{n}\.1", f"down_blocks.{level}.attentions.{layer}", ATTENTION_PARTS)
        else:
            rules.append((rf"input_blocks\.{n}\.0\.op{SUFFIX}", rf"down_blocks.{level}.downsamplers.0.conv.\g<p>"))
    for n in range(levels * per):
        level, layer = divmod(n, per)
        rules += _parts(rf"output_blocks\.{n}\.0", f"up_blocks.{level}.resnets.{layer}", RESNET_PARTS)
        rules += _parts(rf"output_blocks\.{n}\.1", f"up_blocks.{level}.attentions.{layer}", ATTENTION_PARTS)
        if layer == layers_per_block:
            rules.append((rf"output_blocks\.{n}\.[12]\.conv{SUFFIX}", rf"up_blocks.{level}.upsamplers.0.conv.\g<p>"))
    return rules


@lru_cache(maxsize=8)
def original_rules(layers_per_block=2, levels=4) -> list:
    """original_keymap compiled (what formats/keymaps.remap and lora/names.py take)."""
    return compile_rules(original_keymap(layers_per_block, levels))


# what lora/names.py maps original-named (kohya `lora_unet_input_blocks_4_1_...`) LoRA layers through: every released
# UNet has 2 resnets per level and at most 4 levels
_ORIGINAL_RULES = original_rules(2, 4)

# LoRAs (lora/, the protocol's LoRADenoiser)
LORA_NAME = "SD 1.x / SDXL UNet"
LORA_ARCHITECTURE = "an SD 1.x / SDXL UNet"     # its label in lora.ARCHITECTURES
LORA_ORDER = 10     # its rows tried first: its transformer blocks' ff.net is in SD3's shared row too
# the layer names that tell a LoRA is for it: (pattern, labels) rows of lora.ARCHITECTURES (lora/names.py tries
# them in the modules' LORA_ORDER, the first that a name matches saying which architectures it fits).
LORA_ARCHITECTURE_PATTERNS = (
    (re.compile(r"(^|[._])(down_blocks|up_blocks|mid_block|input_blocks|output_blocks|middle_block)([._]|$)"),
     (LORA_ARCHITECTURE,)),)
# SGM's (SDXL's original) block names, which the original-name table maps for one depth per level only
LORA_UNMAPPED = (re.compile(r"(^|[._])(input_blocks|output_blocks|middle_block)([._]|$)"),
                 "names a UNet layer in SGM's original names (input_blocks, middle_block, output_blocks: kohya's SDXL "
                 "LoRAs), which mlxdiff maps for UNets with as many layers on every level only; re-save the LoRA in "
                 "diffusers' names")


def lora_original_rules(args) -> list:
    """The original-name table LoRA layers map through: ldm numbers the blocks flat, so the table of this layout
    (one depth per level; none otherwise)."""
    depths = set(args.layers)
    return original_rules(depths.pop(), len(args.block_out_channels)) if len(depths) == 1 else []
_INPUT = re.compile(r"input_blocks\.(\d+)\.")
_OUTPUT = re.compile(r"output_blocks\.(\d+)\.")
_DOWNSAMPLER = re.compile(r"input_blocks\.(\d+)\.0\.op\.weight")


def is_original(names) -> bool:
    """Whether tensor names are ldm's (with or without the prefix), not diffusers'."""
    return any(n.split(ORIGINAL_PREFIX)[-1].startswith(("input_blocks.", "middle_block.")) for n in names)


def _indices(weights, pattern) -> list:
    return sorted({int(m.group(1)) for k in weights if (m := pattern.match(k))})


def _layout(weights, up=True) -> tuple:
    """(levels, layers per block) of ldm names, from the downsamplers and the input block count; `up`: the output
    blocks must be there too (a ControlNet's copy of the encoder has none)."""
    inputs, downsamplers = _indices(weights, _INPUT), _indices(weights, _DOWNSAMPLER)
    if not inputs or inputs != list(range(len(inputs))):
        raise MlxdiffError(f"not a complete SD UNet original checkpoint: input_blocks indices {inputs[:4]}... are not "
                           "contiguous from 0; re-download the file")
    levels = len(downsamplers) + 1
    layers, extra = divmod(len(inputs) - 1 - (levels - 1), levels)
    outputs = _indices(weights, _OUTPUT) if up else list(range(levels * (layers + 1)))
    if extra or layers < 1 or outputs != list(range(levels * (layers + 1))):
        raise MlxdiffError(f"not a complete SD UNet original checkpoint: {len(inputs)} input_blocks, {len(outputs)} "
                           f"output_blocks and {len(downsamplers)} downsamplers do not make a UNet; re-download the "
                           "file")
    return levels, layers


def original_to_diffusers(weights: dict) -> dict:
    """ldm UNet names -> diffusers names (lazy; nothing is read)."""
    weights = under_prefix_if_present(weights, ORIGINAL_PREFIX)
    return remap(weights, original_rules(*reversed(_layout(weights))))


def _depth(weights, block) -> int:
    """Transformer blocks in the SpatialTransformer at `block` (ldm name), 0 where there is none."""
    pattern = re.compile(re.escape(block) + r"\.transformer_blocks\.(\d+)\.attn1\.to_q\.weight")
    return len(_indices(weights, pattern))


def config_from_original(weights: dict) -> dict:
    """The diffusers UNet2DConditionModel config of an ldm-named UNet, read off its names and shapes.

    - widths, levels, layers per block, in/out channels from the convs; a level has cross-attention when its first
      input block has a SpatialTransformer (`input_blocks.{n}.1`), and as many transformer blocks as that one has
      (1 for a level without: diffusers' SDXL config says [1, 2, 10]); the middle block's depth must be the last
      level's (the model gives it that one).
    - cross_attention_dim from attn2.to_k; proj_in a 1x1 conv (SD 1.x) or a Linear (SD 2.x, SDXL).
    - heads, which shapes cannot give: SD 1.x (conv projections) has 8 per level (attention_head_dim 8, diffusers'
      quirk for "heads"); SD 2.x and SDXL (linear projections) have 64-wide heads: attention_head_dim = width / 64
      per level ([5, 10, 20, 20], [5, 10, 20]).
    - `label_emb` (SDXL): addition_embed_type "text_time" with addition_time_embed_dim 256 (the 6 size/crop ids'
      sinusoidal width) and projection_class_embeddings_input_dim = label_emb.0.0's input width (2816 for the base).
    - sample_size, the default latent size: 128 for SDXL, 96 for SD 2.x (768-v), 64 for SD 1.x.
    """
    weights = under_prefix_if_present(weights, ORIGINAL_PREFIX)
    levels, layers = _layout(weights)

    def shape(key, ndim=None):
        return required_shape(weights, key, "SD UNet", ndim)

    first = [1 + level * (layers + 1) for level in range(levels)]       # each level's first input block
    widths = [shape(f"input_blocks.{n}.0.in_layers.2.weight", 4)[0] for n in first]
    conv_in = shape("input_blocks.0.0.weight", 4)
    depths = [_depth(weights, f"input_blocks.{n}.1") for n in first]
    attention = [d > 0 for d in depths]
    up_attention = [_depth(weights, f"output_blocks.{level * (layers + 1)}.1") > 0 for level in range(levels)]
    if not any(attention):
        raise MlxdiffError("not an SD UNet original checkpoint: no SpatialTransformer (input_blocks.N.1.*) found")
    depth_per_level = [d or 1 for d in depths]
    mid = _depth(weights, "middle_block.1")
    if mid != depth_per_level[-1]:
        raise MlxdiffError(f"SD UNet original checkpoint: the middle block has {mid} transformer blocks, the last "
                           f"level {depth_per_level[-1]}; mlxdiff's UNet gives the middle block the last level's depth")
    level = attention.index(True)
    block = f"input_blocks.{first[level]}.1"
    cross = shape(f"{block}.transformer_blocks.0.attn2.to_k.weight", 2)[1]
    linear = len(shape(f"{block}.proj_in.weight")) == 2
    # the levels whose blocks attend (down, up: output block 0 is the deepest level, the middle block the last);
    # only those split into 64-wide heads: a level without attention may have any width
    attended = {i for i in range(levels) if attention[i] or up_attention[levels - 1 - i]} | {levels - 1}
    if linear and any(widths[i] % 64 for i in attended):
        raise MlxdiffError(f"SD UNet original checkpoint: the widths {[widths[i] for i in sorted(attended)]} of its "
                           "levels with attention are not multiples of 64, the head size of SD 2.x / SDXL UNets "
                           "(linear projections)")
    config = {
        "sample_size": 64,
        "in_channels": conv_in[1],
        "out_channels": shape("out.2.weight", 4)[0],
        "block_out_channels": widths,
        "layers_per_block": layers,
        "down_block_types": ["CrossAttnDownBlock2D" if a else "DownBlock2D" for a in attention],
        "up_block_types": ["CrossAttnUpBlock2D" if a else "UpBlock2D" for a in up_attention],
        "cross_attention_dim": cross,
        "attention_head_dim": [max(1, w // 64) for w in widths] if linear else 8,
        "use_linear_projection": linear,
        "transformer_layers_per_block": depth_per_level if len(set(depth_per_level)) > 1 else depth_per_level[0],
        "norm_num_groups": 32,
    }
    if "label_emb.0.0.weight" in weights:
        config.update(sample_size=128, addition_embed_type="text_time", addition_time_embed_dim=256,
                      projection_class_embeddings_input_dim=shape("label_emb.0.0.weight", 2)[1])
    elif linear:
        config["sample_size"] = 96
    return config
