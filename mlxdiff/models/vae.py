"""AutoencoderKL as SD3/SD3.5 uses it (diffusers/models/autoencoders/autoencoder_kl.py and vae.py, re-implemented).

The building blocks (ResnetBlock2D, the single-head mid-block attention, Encoder, Decoder and their down/up blocks)
are shared with vae_flux2.py. Everything runs channels-last (NHWC) inside; the public `encode` / `decode` take and
return NCHW arrays like diffusers.
"""

import functools
import re
from dataclasses import dataclass
from typing import Optional

import mlx.core as mx
import mlx.nn as nn

from ..config_checks import (MAX_IMAGE_SIZE, MAX_LEVELS, MAX_WIDTH, CheckedArgs, Limit, Rule, between, one_of,
                             positive)
from ..errors import MlxdiffError
from ..formats.keymaps import remap
from .fused import attention

ACTIVATIONS = {"silu": nn.silu, "swish": nn.silu, "mish": nn.mish, "gelu": nn.gelu, "relu": nn.relu}

# diffusers' vae/config.json of stabilityai/stable-diffusion-3.5-{medium,large}: the config for single files
SD3_CONFIG = {
    "in_channels": 3, "out_channels": 3,
    "down_block_types": ["DownEncoderBlock2D"] * 4, "up_block_types": ["UpDecoderBlock2D"] * 4,
    "block_out_channels": [128, 256, 512, 512], "layers_per_block": 2, "act_fn": "silu", "latent_channels": 16,
    "norm_num_groups": 32, "sample_size": 1024, "scaling_factor": 1.5305, "shift_factor": 0.0609,
    "force_upcast": True, "use_quant_conv": False, "use_post_quant_conv": False, "mid_block_add_attention": True,
}


def _levels(a) -> int:
    return len(a.block_out_channels)


def _smallest_side(a) -> int:
    return min(a.sample_size) if isinstance(a.sample_size, (list, tuple)) else a.sample_size


def _grouped(channels, groups) -> bool:
    return all(c % groups == 0 for c in channels or ())


CLASS_NAMES = ("AutoencoderKL",)   # diffusers' class: its key in models/registry.ARCHITECTURES


@dataclass
class ModelArgs(CheckedArgs):
    in_channels: int = 3
    out_channels: int = 3
    down_block_types: tuple[str, ...] = ("DownEncoderBlock2D",) * 4
    up_block_types: tuple[str, ...] = ("UpDecoderBlock2D",) * 4
    block_out_channels: tuple[int, ...] = (128, 256, 512, 512)
    layers_per_block: int = 2
    act_fn: str = "silu"
    latent_channels: int = 16
    norm_num_groups: int = 32
    sample_size: int | tuple[int, ...] = 1024
    scaling_factor: float = 1.5305
    shift_factor: Optional[float] = 0.0609
    latents_mean: Optional[tuple[float, ...]] = None
    latents_std: Optional[tuple[float, ...]] = None
    force_upcast: bool = True
    use_quant_conv: bool = False
    use_post_quant_conv: bool = False
    mid_block_add_attention: bool = True

    WHAT = "VAE config"
    LIMITS = {
        "in_channels": between(1, MAX_WIDTH),
        "out_channels": between(1, MAX_WIDTH),
        # diffusers' AutoencoderKL has only these block kinds
        "down_block_types": Limit(choices=("DownEncoderBlock2D",), items=(1, MAX_LEVELS)),
        "up_block_types": Limit(choices=("UpDecoderBlock2D",), items=(1, MAX_LEVELS)),
        "block_out_channels": between(1, MAX_WIDTH, items=(1, MAX_LEVELS)),
        "layers_per_block": between(1, 16),
        "act_fn": one_of(*ACTIVATIONS),
        "latent_channels": between(1, 1024),
        "norm_num_groups": between(1, MAX_WIDTH),
        "sample_size": between(1, MAX_IMAGE_SIZE, items=(1, 2)),
        "scaling_factor": positive(),
    }
    RULES = (
        Rule("block_out_channels", lambda a: _grouped(a.block_out_channels, a.norm_num_groups),
             lambda a: f"each must be a multiple of norm_num_groups {a.norm_num_groups} (group norms)"),
        Rule("down_block_types", lambda a: len(a.down_block_types) == _levels(a),
             lambda a: f"expected one per block_out_channels entry ({_levels(a)})"),
        Rule("up_block_types", lambda a: len(a.up_block_types) == _levels(a),
             lambda a: f"expected one per block_out_channels entry ({_levels(a)})"),
        Rule("sample_size", lambda a: _smallest_side(a) >= 2 ** (_levels(a) - 1),
             lambda a: f"the tile size must be at least the VAE's factor {2 ** (_levels(a) - 1)}"),
    )


def activation(name):
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise MlxdiffError(f"VAE config: unsupported act_fn {name!r}; supported: {', '.join(ACTIVATIONS)}") from None


def check_block_types(down_block_types, up_block_types):
    for kind, types, allowed in (("down", down_block_types, "DownEncoderBlock2D"),
                                 ("up", up_block_types, "UpDecoderBlock2D")):
        bad = [t for t in types if t != allowed]
        if bad:
            raise MlxdiffError(f"VAE config: {kind}_block_types {bad} are not supported; only {allowed}")


def group_norm(groups, channels):
    return nn.GroupNorm(groups, channels, eps=1e-6, pytorch_compatible=True)


STATS_CHUNK = 64 << 20   # bytes of float32 input that one pass of the group statistics converts at a time


def _group_stats(x, groups, eps):
    """Per (batch, group) mean and 1/std over H, W and the group's channels, in float32 and two passes (the mean,
    then the mean squared deviation). Each pass reduces over the positions first (a column sum of [H*W, C], which
    every backend reduces fast), then over the group's channels, a band of rows at a time, so that the float32
    copy of a bfloat16 input is never made whole."""
    b, h, w, c = x.shape
    rows = max(1, STATS_CHUNK // (b * w * c * 4))
    count = h * w * (c // groups)

    def total(fn):
        acc = None
        for r in range(0, h, rows):
            part = fn(x[:, r:r + rows].reshape(b, -1, c).astype(mx.float32)).sum(axis=1)     # [b, c]
            acc = part if acc is None else acc + part
            if rows < h:
                mx.eval(acc)
        return acc.reshape(b, 1, groups, c // groups).sum(axis=-1, keepdims=True)        # [b, 1, groups, 1]

    mean = total(lambda v: v) / count
    per_channel = mx.repeat(mean.reshape(b, 1, groups), c // groups, axis=-1)             # [b, 1, c]
    var = total(lambda v: mx.square(v - per_channel)) / count
    return mean, mx.rsqrt(var + eps)


def _normalize_act(x, mean, inv_std, weight, bias, act):
    b, h, w, c = x.shape
    g = (x.reshape(b, h * w, mean.shape[2], c // mean.shape[2]) - mean) * inv_std
    y = (g.reshape(x.shape) * weight + bias).astype(x.dtype)
    return act(y)


@functools.cache
def _compiled_normalize_act(act):
    """The compiled elementwise pass of norm_act, one per activation (made once, on first use)."""
    return mx.compile(lambda x, m, s, w, b: _normalize_act(x, m, s, w, b, act))


def norm_act(norm: nn.GroupNorm, act, x):
    """act(norm(x)) for a GroupNorm `norm` (its parameters and settings), as one compiled elementwise pass after the
    statistics: MLX's GroupNorm then the activation hold about five copies of x at once (1.3 GB for 256 channels
    at 512x512 in float32), this holds the output alone."""
    mean, inv_std = _group_stats(x, norm.num_groups, norm.eps)
    return _compiled_normalize_act(act)(x, mean, inv_std, norm.weight, norm.bias)


# -- blocks (NHWC) ---------------------------------------------------------------------------------------------

def stage(after_stage, x):
    """The caller's memory policy between stages (the pipelines evaluate there); returns x."""
    if after_stage is not None:
        after_stage(x)
    return x


class Conv2d(nn.Conv2d):
    """nn.Conv2d that can run in row bands: a convolution unfolds its input in a working buffer (mlx-cpu: kernel
    area x input, 2.4 GB for one 256-channel 3x3 conv at 512x512), so when that buffer would exceed `band_bytes`
    the output rows are computed a band at a time, each from its input rows plus the halo the kernel needs (zero
    padding added per band). Every output pixel sums the same products, so the result equals the unbanded one.
    `band_bytes` None (the default): never band; the caller's memory policy sets it (`Model.set_band_bytes`)."""
    band_bytes = None

    def kernel(self, x) -> mx.array:
        """The OHWI kernel this call convolves with: the weight itself; a quantized convolution
        (loading/quantize.QuantizedConv2d, PalettizedConv2d) decodes its compact one here, once per call, after `x`."""
        return self.weight

    def __call__(self, x):
        weight = self.kernel(x)
        kh, kw = weight.shape[1:3]
        (sh, sw), (ph, pw) = self.stride, self.padding
        b, h, w, c = x.shape
        if self.band_bytes is None or b * h * w * c * kh * kw * x.itemsize <= self.band_bytes:
            y = mx.conv2d(x, weight, self.stride, self.padding, self.dilation, self.groups)
            return y + self.bias if "bias" in self else y
        rows_out = (h + 2 * ph - kh) // sh + 1
        per_row = b * ((w + 2 * pw - kw) // sw + 1) * c * kh * kw * x.itemsize
        step = max(1, self.band_bytes // per_row)
        bands = []
        for r in range(0, rows_out, step):
            n = min(step, rows_out - r)
            top, bottom = r * sh - ph, (r + n - 1) * sh + kh - ph        # input rows, in unpadded coordinates
            xb = x[:, max(top, 0):min(bottom, h)]
            xb = mx.pad(xb, [(0, 0), (max(-top, 0), max(bottom - h, 0)), (pw, pw), (0, 0)])
            y = mx.conv2d(xb, weight, stride=self.stride, padding=0, dilation=self.dilation, groups=self.groups)
            bands.append(y + self.bias if "bias" in self else y)
            mx.eval(bands[-1])   # one band's working buffer at a time (lazily, MLX would hold them all)
        return mx.concatenate(bands, axis=1)


class ResnetBlock2D(nn.Module):
    """GN -> act -> conv3x3 -> GN -> act -> conv3x3, plus the input (through a 1x1 conv when channels change)."""

    def __init__(self, in_channels, out_channels, groups, act=nn.silu):
        super().__init__()
        self.act = act
        self.norm1 = group_norm(groups, in_channels)
        self.conv1 = Conv2d(in_channels, out_channels, 3, padding=1)
        self.norm2 = group_norm(groups, out_channels)
        self.conv2 = Conv2d(out_channels, out_channels, 3, padding=1)
        if in_channels != out_channels:
            self.conv_shortcut = nn.Conv2d(in_channels, out_channels, 1)

    def __call__(self, x, after_stage=None):
        h = self.conv1(norm_act(self.norm1, self.act, x))
        stage(after_stage, h)
        h = self.conv2(norm_act(self.norm2, self.act, h))
        if "conv_shortcut" in self:
            x = self.conv_shortcut(x)
        return x + h


class Attention(nn.Module):
    """The mid block's single-head self-attention over all H*W positions, with a residual connection."""

    def __init__(self, channels, groups):
        super().__init__()
        self.group_norm = group_norm(groups, channels)
        self.to_q = nn.Linear(channels, channels)
        self.to_k = nn.Linear(channels, channels)
        self.to_v = nn.Linear(channels, channels)
        self.to_out = [nn.Linear(channels, channels)]

    def __call__(self, x):
        b, h, w, c = x.shape
        t = self.group_norm(x).reshape(b, 1, h * w, c)
        out = attention(self.to_q(t), self.to_k(t), self.to_v(t), c ** -0.5)
        return x + self.to_out[0](out).reshape(b, h, w, c)


class Downsample2D(nn.Module):
    """Pad right and bottom by one, then a stride-2 3x3 conv (diffusers' padding=0 variant)."""

    def __init__(self, channels):
        super().__init__()
        self.conv = Conv2d(channels, channels, 3, stride=2)

    def __call__(self, x):
        return self.conv(mx.pad(x, [(0, 0), (0, 1), (0, 1), (0, 0)]))


class Upsample2D(nn.Module):
    """Nearest-neighbour 2x, then a 3x3 conv."""

    def __init__(self, channels):
        super().__init__()
        self.conv = Conv2d(channels, channels, 3, padding=1)

    def __call__(self, x):
        b, h, w, c = x.shape
        x = mx.broadcast_to(x[:, :, None, :, None, :], (b, h, 2, w, 2, c)).reshape(b, 2 * h, 2 * w, c)
        return self.conv(x)


class DownEncoderBlock2D(nn.Module):
    def __init__(self, in_channels, out_channels, num_layers, groups, act, add_downsample):
        super().__init__()
        self.resnets = [ResnetBlock2D(in_channels if i == 0 else out_channels, out_channels, groups, act)
                        for i in range(num_layers)]
        if add_downsample:
            self.downsamplers = [Downsample2D(out_channels)]

    def __call__(self, x, after_stage=None):
        for resnet in self.resnets:
            x = stage(after_stage, resnet(x, after_stage))
        for down in self.get("downsamplers", []):
            x = stage(after_stage, down(x))
        return x


class UpDecoderBlock2D(nn.Module):
    def __init__(self, in_channels, out_channels, num_layers, groups, act, add_upsample):
        super().__init__()
        self.resnets = [ResnetBlock2D(in_channels if i == 0 else out_channels, out_channels, groups, act)
                        for i in range(num_layers)]
        if add_upsample:
            self.upsamplers = [Upsample2D(out_channels)]

    def __call__(self, x, after_stage=None):
        for resnet in self.resnets:
            x = stage(after_stage, resnet(x, after_stage))
        for up in self.get("upsamplers", []):
            x = stage(after_stage, up(x))
        return x


class UNetMidBlock2D(nn.Module):
    """resnet -> (attention) -> resnet at the lowest resolution."""

    def __init__(self, channels, groups, act, add_attention=True):
        super().__init__()
        self.resnets = [ResnetBlock2D(channels, channels, groups, act) for _ in range(2)]
        if add_attention:
            self.attentions = [Attention(channels, groups)]

    def __call__(self, x, after_stage=None):
        x = stage(after_stage, self.resnets[0](x, after_stage))
        for attn in self.get("attentions", []):
            x = stage(after_stage, attn(x))
        return stage(after_stage, self.resnets[1](x, after_stage))


class Encoder(nn.Module):
    """Image (NHWC) -> moments (2 * out_channels when double_z: mean, logvar), at 1 / 2^(blocks-1) resolution."""

    def __init__(self, in_channels, out_channels, block_out_channels, layers_per_block, norm_num_groups,
                 act_fn="silu", double_z=True, mid_block_add_attention=True):
        super().__init__()
        act = activation(act_fn)
        self.act = act
        self.conv_in = Conv2d(in_channels, block_out_channels[0], 3, padding=1)
        self.down_blocks = []
        prev = block_out_channels[0]
        for i, ch in enumerate(block_out_channels):
            self.down_blocks.append(DownEncoderBlock2D(prev, ch, layers_per_block, norm_num_groups, act,
                                                       add_downsample=i < len(block_out_channels) - 1))
            prev = ch
        self.mid_block = UNetMidBlock2D(prev, norm_num_groups, act, mid_block_add_attention)
        self.conv_norm_out = group_norm(norm_num_groups, prev)
        self.conv_out = Conv2d(prev, 2 * out_channels if double_z else out_channels, 3, padding=1)

    def __call__(self, x, after_stage=None):
        x = stage(after_stage, self.conv_in(x))
        for block in self.down_blocks:
            x = block(x, after_stage)
        x = self.mid_block(x, after_stage)
        return self.conv_out(norm_act(self.conv_norm_out, self.act, x))


class Decoder(nn.Module):
    """Latent (NHWC) -> image, with layers_per_block + 1 resnets per up block (deepest channels first)."""

    def __init__(self, in_channels, out_channels, block_out_channels, layers_per_block, norm_num_groups,
                 act_fn="silu", mid_block_add_attention=True):
        super().__init__()
        act = activation(act_fn)
        self.act = act
        reversed_channels = list(reversed(block_out_channels))
        self.conv_in = Conv2d(in_channels, reversed_channels[0], 3, padding=1)
        self.mid_block = UNetMidBlock2D(reversed_channels[0], norm_num_groups, act, mid_block_add_attention)
        self.up_blocks = []
        prev = reversed_channels[0]
        for i, ch in enumerate(reversed_channels):
            self.up_blocks.append(UpDecoderBlock2D(prev, ch, layers_per_block + 1, norm_num_groups, act,
                                                   add_upsample=i < len(reversed_channels) - 1))
            prev = ch
        self.conv_norm_out = group_norm(norm_num_groups, prev)
        self.conv_out = Conv2d(prev, out_channels, 3, padding=1)

    def __call__(self, z, after_stage=None):
        x = self.mid_block(stage(after_stage, self.conv_in(z)), after_stage)
        for block in self.up_blocks:
            x = block(x, after_stage)
        return self.conv_out(norm_act(self.conv_norm_out, self.act, x))


# -- the model -------------------------------------------------------------------------------------------------

def nchw_to_nhwc(x):
    return x.transpose(0, 2, 3, 1)


def nhwc_to_nchw(x):
    return x.transpose(0, 3, 1, 2)


def tile_stride(tile, overlap):
    if not 0 <= overlap < 1:
        raise MlxdiffError(f"VAE tiling: overlap must be in [0, 1), got {overlap}")
    stride = int(tile * (1 - overlap))
    if stride < 1:
        raise MlxdiffError(f"VAE tiling: a tile of {tile} with overlap {overlap} does not advance; "
                           "use a larger tile or a smaller overlap")
    return stride


def blend(a, b, extent, axis):
    """diffusers' blend_v (axis 1 here, NHWC) / blend_h (axis 2): the first `extent` rows of tile b fade in
    linearly from the last `extent` rows of its neighbour a."""
    extent = min(a.shape[axis], b.shape[axis], extent)
    if extent == 0:
        return b
    shape = [1] * b.ndim
    shape[axis] = extent
    # the weights as diffusers computes them (Python floats), rounded once to the tile's dtype
    fade_in = mx.array([y / extent for y in range(extent)]).reshape(shape).astype(b.dtype)
    fade_out = mx.array([1 - y / extent for y in range(extent)]).reshape(shape).astype(b.dtype)
    tail = [slice(None)] * a.ndim
    tail[axis] = slice(a.shape[axis] - extent, None)
    a_tail = a[tuple(tail)]
    b_head, b_rest = mx.split(b, [extent], axis=axis)
    return mx.concatenate([a_tail * fade_out + b_head * fade_in, b_rest], axis=axis)


def tiled_apply(x, fn, tile, stride, blend_extent, keep):
    """Apply `fn` (NHWC -> NHWC at another resolution) to `tile`-sized windows of x every `stride` pixels,
    blend each output with its upper and left neighbours over `blend_extent` output pixels and keep the first
    `keep` rows and columns of each: diffusers' tiling loop. diffusers blends in place, so a tile's neighbours
    are used already blended; here each blended tile replaces its raw output, which gives the same numbers.
    Each tile is evaluated before the next one is built, and only the previous row of outputs is kept."""
    above, rows = None, []
    for i in range(0, x.shape[1], stride):
        row = []
        for j in range(0, x.shape[2], stride):
            out = fn(x[:, i:i + tile, j:j + tile])
            if above is not None:
                out = blend(above[len(row)], out, blend_extent, axis=1)
            if row:
                out = blend(row[-1], out, blend_extent, axis=2)
            mx.eval(out)
            row.append(out)
        rows.append(mx.concatenate([t[:, :keep, :keep] for t in row], axis=2))
        mx.eval(rows[-1])
        above = row
    return mx.concatenate(rows, axis=1)


class Model(nn.Module):
    """diffusers AutoencoderKL. `decode(z)` / `encode(x)` take and return NCHW like diffusers.

    Latent scaling is the caller's: the SD3 pipeline denoises (mean - shift_factor) * scaling_factor and decodes
    z / scaling_factor + shift_factor (see `scale_latents` / `unscale_latents`).

    Inputs larger than a tile (by default diffusers' tile sizes, from config sample_size) are encoded / decoded
    tile by tile as diffusers does after `enable_tiling()`; `tiling=False` forces the plain path.
    """

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.compute_dtype = mx.float32
        check_block_types(args.down_block_types, args.up_block_types)
        # AutoencoderKLFlux2 may give the decoder its own (smaller) widths
        decoder_channels = getattr(args, "decoder_block_out_channels", None) or args.block_out_channels
        self.encoder = Encoder(args.in_channels, args.latent_channels, args.block_out_channels,
                               args.layers_per_block, args.norm_num_groups, args.act_fn, double_z=True,
                               mid_block_add_attention=args.mid_block_add_attention)
        self.decoder = Decoder(args.latent_channels, args.out_channels, decoder_channels, args.layers_per_block,
                               args.norm_num_groups, args.act_fn, args.mid_block_add_attention)
        if args.use_quant_conv:
            self.quant_conv = nn.Conv2d(2 * args.latent_channels, 2 * args.latent_channels, 1)
        if args.use_post_quant_conv:
            self.post_quant_conv = nn.Conv2d(args.latent_channels, args.latent_channels, 1)

    def set_memory_policy(self, after_stage=None, band_bytes=None):
        """The caller's memory policy: `after_stage(x)` runs between the encoder's and decoder's stages (the
        pipelines evaluate there, so that nothing outlives its use), and convolutions whose working buffer would
        exceed `band_bytes` run in exact row bands (Conv2d). Both None: one lazy graph, no bands."""
        self.after_stage = after_stage
        for _, module in self.named_modules():
            if isinstance(module, Conv2d):
                module.band_bytes = band_bytes

    def decode_bytes(self, shape, dtype) -> int:
        """About the activations of an untiled staged decode of latents `shape` (NCHW): at full resolution the
        input (the widest full-resolution block's channels), a normalised copy, the output and one conv band."""
        b, _, h, w = shape
        factor = 2 ** (len(self.args.block_out_channels) - 1)
        channels = list(getattr(self.args, "decoder_block_out_channels", None) or self.args.block_out_channels)
        widest = max(channels[:2])
        return 4 * b * h * w * factor * factor * widest * mx.zeros((), dtype).itemsize

    def _moments(self, x):
        h = self.encoder(x, getattr(self, "after_stage", None))
        return self.quant_conv(h) if "quant_conv" in self else h

    def _decoded(self, z):
        if "post_quant_conv" in self:
            z = self.post_quant_conv(z)
        return self.decoder(z, getattr(self, "after_stage", None))

    def encode_moments(self, x, tiling=None, tile_latent_size=None, overlap=0.25):
        """Image [B, C, H, W] in [-1, 1] -> (mean, logvar), each [B, latent_channels, H/f, W/f].

        tiling: None tiles when H or W exceeds the image tile (see `tile_sizes`), True / False force it.
        """
        _, sample_tile = self.tile_sizes(tile_latent_size)
        if tiling is None:
            tiling = max(x.shape[-2:]) > sample_tile
        x = nchw_to_nhwc(x.astype(self.compute_dtype))
        if tiling:
            h = self._tiled_moments(x, tile_latent_size, overlap)
        else:
            h = self._moments(x)
        mean, logvar = mx.split(nhwc_to_nchw(h), 2, axis=1)
        return mean, mx.clip(logvar, -30.0, 20.0)

    def encode(self, x, tiling=None, tile_latent_size=None, overlap=0.25):
        """Image [B, C, H, W] -> the latent mean (the posterior's mode, what the pipelines use)."""
        return self.encode_moments(x, tiling, tile_latent_size, overlap)[0]

    def decode(self, z, tiling=None, tile_latent_size=None, overlap=0.25):
        """Latent [B, latent_channels, h, w] -> image [B, out_channels, h*f, w*f] (about [-1, 1]).

        tiling: None tiles when h or w exceeds the latent tile (see `tile_sizes`), True / False force it.
        """
        latent_tile, _ = self.tile_sizes(tile_latent_size)
        if tiling is None:
            tiling = max(z.shape[-2:]) > latent_tile
        if tiling:
            return self.tiled_decode(z, tile_latent_size, overlap)
        return nhwc_to_nchw(self._decoded(nchw_to_nhwc(z.astype(self.compute_dtype))))

    # -- tiling: diffusers' AutoencoderKL.tiled_decode / _tiled_encode ------------------------------------------

    def tile_sizes(self, tile_latent_size=None):
        """(latent tile, image tile) edge lengths. By default diffusers' tile_latent_min_size and
        tile_sample_min_size: config sample_size / 2**(levels - 1) and sample_size (128 and 1024 for SD3.5 and
        FLUX.2); a given latent tile t pairs with the image tile t * 2**(levels - 1)."""
        factor = 2 ** (len(self.args.block_out_channels) - 1)
        if tile_latent_size is None:
            sample_size = self.args.sample_size
            if isinstance(sample_size, (list, tuple)):
                sample_size = sample_size[0]
            return int(sample_size / factor), sample_size
        if tile_latent_size < 1:
            raise MlxdiffError(f"VAE tiling: tile_latent_size must be a positive number of latent pixels, "
                               f"got {tile_latent_size}")
        return tile_latent_size, tile_latent_size * factor

    def tiled_decode(self, z, tile_latent_size=None, overlap=0.25):
        """`decode` tile by tile: latent tiles of `tile_latent_size` overlapping by `overlap`, decoded one at a
        time (each evaluated before the next, so peak memory follows the tile, not the image) and cross-faded
        over the overlap as diffusers does. Not equal to the untiled decode: every tile sees only its own
        context (convolutions, group norms, the mid-block attention), which the blend smooths over."""
        latent_tile, sample_tile = self.tile_sizes(tile_latent_size)
        z = nchw_to_nhwc(z.astype(self.compute_dtype))
        out = tiled_apply(z, self._decoded, latent_tile, tile_stride(latent_tile, overlap),
                          int(sample_tile * overlap), sample_tile - int(sample_tile * overlap))
        return nhwc_to_nchw(out)

    def _tiled_moments(self, x, tile_latent_size, overlap):
        latent_tile, sample_tile = self.tile_sizes(tile_latent_size)
        return tiled_apply(x, self._moments, sample_tile, tile_stride(sample_tile, overlap),
                           int(latent_tile * overlap), latent_tile - int(latent_tile * overlap))

    def tiled_encode_moments(self, x, tile_latent_size=None, overlap=0.25):
        """`encode_moments` tile by tile (image tiles of tile_latent_size * 2**(levels - 1), see `tiled_decode`)."""
        return self.encode_moments(x, True, tile_latent_size, overlap)

    def __call__(self, x):
        """Reconstruction, as diffusers' forward with sample_posterior=False: decode(encode(x).mode())."""
        return self.decode(self.encode(x))

    def scale_latents(self, mean):
        """VAE latent -> the space the transformer denoises in."""
        shift = self.args.shift_factor or 0.0
        return (mean - shift) * self.args.scaling_factor

    def unscale_latents(self, z):
        """The inverse of `scale_latents`: denoised latents -> what `decode` takes."""
        shift = self.args.shift_factor or 0.0
        return z / self.args.scaling_factor + shift

    def sanitize(self, weights):
        """diffusers names and PyTorch layouts -> this module's: conv OIHW -> OHWI (made contiguous lazily)."""
        weights = remap(weights, DEPRECATED_ATTENTION_KEYMAP)
        out = {}
        for key, value in weights.items():
            if value.ndim == 4:  # every 4-D tensor left here is a conv kernel
                value = mx.contiguous(value.transpose(0, 2, 3, 1))
            out[key] = value
        return out


# -- other namings ---------------------------------------------------------------------------------------------

# Old diffusers checkpoints name the mid-block attention query/key/value/proj_attn (diffusers renames them on load)
DEPRECATED_ATTENTION_KEYMAP = [
    (r"(.*\.attentions\.\d+)\.query\.(weight|bias)", r"\1.to_q.\2", "squeeze_1x1"),
    (r"(.*\.attentions\.\d+)\.key\.(weight|bias)", r"\1.to_k.\2", "squeeze_1x1"),
    (r"(.*\.attentions\.\d+)\.value\.(weight|bias)", r"\1.to_v.\2", "squeeze_1x1"),
    (r"(.*\.attentions\.\d+)\.proj_attn\.(weight|bias)", r"\1.to_out.0.\2", "squeeze_1x1"),
]

RESNET_PARAM = r"(norm1|conv1|norm2|conv2)\.(weight|bias)"


def ldm_keymap(num_blocks=4):
    """Rules for original ldm / BFL VAE names (the `first_stage_model.` prefix already stripped) -> diffusers.

    The ldm decoder numbers its levels from the highest resolution (`up.0` is the last to run); diffusers numbers
    them in execution order, so `decoder.up.{k}` becomes `decoder.up_blocks.{num_blocks - 1 - k}`: one rule per k.
    """
    rules = [
        (r"(encoder|decoder)\.norm_out\.(weight|bias)", r"\1.conv_norm_out.\2"),
        (rf"encoder\.down\.(\d+)\.block\.(\d+)\.{RESNET_PARAM}", r"encoder.down_blocks.\1.resnets.\2.\3.\4"),
        (r"encoder\.down\.(\d+)\.block\.(\d+)\.nin_shortcut\.(weight|bias)",
         r"encoder.down_blocks.\1.resnets.\2.conv_shortcut.\3"),
        (r"encoder\.down\.(\d+)\.downsample\.conv\.(weight|bias)", r"encoder.down_blocks.\1.downsamplers.0.conv.\2"),
        (rf"(encoder|decoder)\.mid\.block_1\.{RESNET_PARAM}", r"\1.mid_block.resnets.0.\2.\3"),
        (rf"(encoder|decoder)\.mid\.block_2\.{RESNET_PARAM}", r"\1.mid_block.resnets.1.\2.\3"),
        (r"(encoder|decoder)\.mid\.attn_1\.norm\.(weight|bias)", r"\1.mid_block.attentions.0.group_norm.\2"),
        # 1x1 convs in ldm, Linear layers in diffusers
        (r"(encoder|decoder)\.mid\.attn_1\.(q|k|v)\.(weight|bias)", r"\1.mid_block.attentions.0.to_\2.\3",
         "squeeze_1x1"),
        (r"(encoder|decoder)\.mid\.attn_1\.proj_out\.(weight|bias)", r"\1.mid_block.attentions.0.to_out.0.\2",
         "squeeze_1x1"),
    ]
    for k in range(num_blocks):
        i = num_blocks - 1 - k
        rules += [
            (rf"decoder\.up\.{k}\.block\.(\d+)\.{RESNET_PARAM}", rf"decoder.up_blocks.{i}.resnets.\1.\2.\3"),
            (rf"decoder\.up\.{k}\.block\.(\d+)\.nin_shortcut\.(weight|bias)",
             rf"decoder.up_blocks.{i}.resnets.\1.conv_shortcut.\2"),
            (rf"decoder\.up\.{k}\.upsample\.conv\.(weight|bias)", rf"decoder.up_blocks.{i}.upsamplers.0.conv.\1"),
        ]
    return rules


# The SD3/SD3.5 VAE (4 levels). conv_in/conv_out/quant_conv/post_quant_conv keep their names.
LDM_KEYMAP = ldm_keymap(4)


def ldm_num_blocks(weights) -> int:
    """Number of resolution levels in ldm-named VAE weights (counting encoder.down.{i})."""
    levels = {int(m.group(1)) for k in weights if (m := re.match(r"encoder\.down\.(\d+)\.", k))}
    return len(levels)


def config_from_ldm(weights: dict, defaults: dict = None) -> dict:
    """A diffusers AutoencoderKL config read off ldm-named weight shapes (prefix stripped).

    Shapes give the channel widths, block count, layers per block, latent channels and the quant convs; the
    group count and latent scaling cannot be read from shapes and come from `defaults` (SD3_CONFIG by default).
    """
    config = dict(SD3_CONFIG if defaults is None else defaults)
    levels = ldm_num_blocks(weights)

    def shape(key):
        if key not in weights:
            raise MlxdiffError(f"VAE weights: {key!r} is missing; this is not an ldm-named VAE (expected "
                               "encoder.down.*, decoder.up.*, mid.attn_1.*)")
        found = tuple(weights[key].shape)
        if len(found) != 4 or not all(found):   # every tensor read here is a convolution kernel
            raise MlxdiffError(f"VAE weights: tensor {key!r} has shape {list(found)}; expected 4 non-zero "
                               "dimensions")
        return found

    if levels == 0:
        shape("encoder.down.0.block.0.conv1.weight")  # raises with the message above
    encoder_channels = [shape(f"encoder.down.{i}.block.0.conv1.weight")[0] for i in range(levels)]
    decoder_channels = [shape(f"decoder.up.{i}.block.0.conv1.weight")[0] for i in range(levels)]
    layers = {int(m.group(1)) for k in weights if (m := re.match(r"encoder\.down\.0\.block\.(\d+)\.", k))}
    config.update(
        in_channels=shape("encoder.conv_in.weight")[1],
        out_channels=shape("decoder.conv_out.weight")[0],
        block_out_channels=encoder_channels,
        layers_per_block=len(layers),
        latent_channels=shape("decoder.conv_in.weight")[1],
        down_block_types=["DownEncoderBlock2D"] * levels,
        up_block_types=["UpDecoderBlock2D"] * levels,
        use_quant_conv="quant_conv.weight" in weights or "encoder.quant_conv.weight" in weights,
        use_post_quant_conv="post_quant_conv.weight" in weights or "decoder.post_quant_conv.weight" in weights,
        mid_block_add_attention="encoder.mid.attn_1.q.weight" in weights,
    )
    if decoder_channels != encoder_channels:
        config["decoder_block_out_channels"] = decoder_channels
    return config
