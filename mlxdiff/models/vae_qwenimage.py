"""AutoencoderKLQwenImage (diffusers/models/autoencoders/autoencoder_kl_qwenimage.py), for one frame (images).

The Qwen-Image VAE is Wan's causal 3-D VAE. Run on a single frame (T = 1) it is a 2-D VAE, and this module is
that 2-D VAE, channels-last (NHWC) inside, NCHW ([B, C, H, W]) at `encode` / `decode` like vae.py:

- A causal conv3d (QwenImageCausalConv3d) pads time by (2 * p, 0): zeros *before* the frame. With one frame and a
  kernel of depth kt, the output frame sees kt - 1 zero frames then the frame itself, so only the kernel's last
  temporal slice multiplies anything: conv3d(x[T=1]) == conv2d(x, weight[:, :, -1]). `sanitize` keeps that slice
  (OIHW -> OHWI) and every convolution here is 2-D.
- The time convs of the resample layers never run on the first chunk: diffusers' encoder encodes frame 0 alone
  (`_encode`: the first chunk is x[:, :, :1]) and `downsample3d` only caches it (feat_cache[idx] is None), the
  decoder's `upsample3d` marks its cache "Rep" and skips time_conv. So downsample3d == downsample2d and
  upsample3d == upsample2d at T = 1; their `time_conv` weights are dropped by `sanitize`.
- The feature cache (feat_cache) holds nothing a single frame reads.
- QwenImageRMS_norm is F.normalize over channels (x / max(||x||_2, 1e-12)) * sqrt(dim) * gamma, normalised in
  float32 for half inputs. The mid-block attention is single-head over one frame's H*W positions.
- `_decode` clamps the image to [-1, 1] (the tiled path does not): matched.

Latents are [B, z_dim, H/8, W/8] (diffusers: [B, z_dim, 1, H/8, W/8]; `encode` / `decode` also take the 5-D form
with T = 1). The pipelines normalise them with latents_mean / latents_std (QwenImage*Pipeline._encode_vae_image and
the decode tail): `scale_latents` / `unscale_latents`. The img2img pipeline samples the posterior
(retrieve_latents' default "sample"; `sample_latents`), the edit pipelines take its mode (`encode`).

Original (Wan / ComfyUI `qwen_image_vae.safetensors`) names: `original_keymap` (diffusers'
convert_wan_vae_to_diffusers, for any level count and num_res_blocks), `has_original_names`, `config_from_original`.
"""

import re
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from ..config_checks import MAX_LEVELS, MAX_WIDTH, CheckedArgs, Rule, between
from ..errors import MlxdiffError
from ..formats.keymaps import remap
from .fused import attention
from .vae import Conv2d, nchw_to_nhwc, nhwc_to_nchw, stage, tile_stride, tiled_apply

LATENTS_MEAN = (-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
                0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921)
LATENTS_STD = (2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
               3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160)


CLASS_NAMES = ("AutoencoderKLQwenImage",)   # diffusers' class: its key in models/registry.ARCHITECTURES


@dataclass
class ModelArgs(CheckedArgs):
    """diffusers' AutoencoderKLQwenImage config; the defaults are Qwen/Qwen-Image's vae/config.json."""
    base_dim: int = 96
    z_dim: int = 16
    dim_mult: tuple[int, ...] = (1, 2, 4, 4)
    num_res_blocks: int = 2
    attn_scales: tuple[float, ...] = ()
    temperal_downsample: tuple[bool, ...] = (False, True, True)
    dropout: float = 0.0
    input_channels: int = 3
    latents_mean: tuple[float, ...] = LATENTS_MEAN
    latents_std: tuple[float, ...] = LATENTS_STD

    WHAT = "Qwen-Image VAE config"
    LIMITS = {
        "base_dim": between(1, MAX_WIDTH),
        "z_dim": between(1, 1024),
        "dim_mult": between(1, 64, items=(1, MAX_LEVELS)),
        "num_res_blocks": between(1, 16),
        "attn_scales": between(0, 1, items=(0, MAX_LEVELS)),
        "dropout": between(0, 1),
        "input_channels": between(1, MAX_WIDTH),
    }
    RULES = (
        # diffusers 0.42.1's encoder calls its attention blocks with (x, feat_cache, feat_idx), which their forward
        # does not take: a config with attention scales does not run there, so none is taken here either
        Rule("attn_scales", lambda a: not a.attn_scales,
             lambda a: "expected [] (diffusers' AutoencoderKLQwenImage cannot run encoder attention blocks)"),
        Rule("temperal_downsample", lambda a: len(a.temperal_downsample) == len(a.dim_mult) - 1,
             lambda a: f"expected one per level after the first ({len(a.dim_mult) - 1})"),
        Rule("latents_mean", lambda a: len(a.latents_mean) == a.z_dim, lambda a: f"expected z_dim ({a.z_dim}) values"),
        Rule("latents_std", lambda a: len(a.latents_std) == a.z_dim and all(s > 0 for s in a.latents_std),
             lambda a: f"expected z_dim ({a.z_dim}) positive values"),
    )


# -- blocks (NHWC) ---------------------------------------------------------------------------------------------

class RMSNorm(nn.Module):
    """QwenImageRMS_norm: F.normalize over channels (eps 1e-12 on the norm), times sqrt(dim) and gamma."""

    def __init__(self, dim):
        super().__init__()
        self.gamma = mx.ones((dim,))
        self.scale = dim ** 0.5

    def __call__(self, x):
        xf = x.astype(mx.float32) if x.dtype in (mx.float16, mx.bfloat16) else x
        norm = mx.sqrt(mx.sum(mx.square(xf), axis=-1, keepdims=True))
        normalized = (xf / mx.maximum(norm, 1e-12)).astype(x.dtype)
        return normalized * self.scale * self.gamma


class ResidualBlock(nn.Module):
    """QwenImageResidualBlock at T = 1: RMS -> silu -> conv3x3 -> RMS -> silu -> conv3x3, plus the (1x1) shortcut."""

    def __init__(self, in_dim, out_dim):
        super().__init__()
        self.norm1 = RMSNorm(in_dim)
        self.conv1 = Conv2d(in_dim, out_dim, 3, padding=1)
        self.norm2 = RMSNorm(out_dim)
        self.conv2 = Conv2d(out_dim, out_dim, 3, padding=1)
        if in_dim != out_dim:
            self.conv_shortcut = nn.Conv2d(in_dim, out_dim, 1)

    def __call__(self, x, after_stage=None):
        h = self.conv_shortcut(x) if "conv_shortcut" in self else x
        y = self.conv1(nn.silu(self.norm1(x)))
        stage(after_stage, y)
        return self.conv2(nn.silu(self.norm2(y))) + h


class AttentionBlock(nn.Module):
    """QwenImageAttentionBlock: single-head self-attention over one frame's positions, residual (1x1 convs as
    Linear layers)."""

    def __init__(self, dim):
        super().__init__()
        self.norm = RMSNorm(dim)
        self.to_qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def __call__(self, x, after_stage=None):
        b, h, w, c = x.shape
        qkv = self.to_qkv(self.norm(x)).reshape(b, 1, h * w, 3 * c)
        q, k, v = mx.split(qkv, 3, axis=-1)
        out = attention(q, k, v, c ** -0.5)
        return x + self.proj(out).reshape(b, h, w, c)


class Resample(nn.Module):
    """QwenImageResample at T = 1. Down: pad right/bottom by one, stride-2 3x3 conv (dim -> dim). Up: nearest 2x,
    3x3 conv (dim -> dim // 2). The 3-D modes' time_conv never runs on a single frame (module doc)."""

    def __init__(self, dim, up):
        super().__init__()
        self.up = up
        self.resample = [None, Conv2d(dim, dim // 2, 3, padding=1) if up else Conv2d(dim, dim, 3, stride=2)]

    def __call__(self, x, after_stage=None):
        if self.up:
            b, h, w, c = x.shape
            x = mx.broadcast_to(x[:, :, None, :, None, :], (b, h, 2, w, 2, c)).reshape(b, 2 * h, 2 * w, c)
        else:
            x = mx.pad(x, [(0, 0), (0, 1), (0, 1), (0, 0)])
        return self.resample[1](x)


class MidBlock(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.resnets = [ResidualBlock(dim, dim), ResidualBlock(dim, dim)]
        self.attentions = [AttentionBlock(dim)]

    def __call__(self, x, after_stage=None):
        x = stage(after_stage, self.resnets[0](x, after_stage))
        x = stage(after_stage, self.attentions[0](x))
        return stage(after_stage, self.resnets[1](x, after_stage))


def _dims(args):
    return [args.base_dim * m for m in (1,) + tuple(args.dim_mult)]


class Encoder(nn.Module):
    """QwenImageEncoder3d on one frame: `down_blocks` is diffusers' flat list (residual blocks, attention blocks
    where the scale is in attn_scales, resamples). Qwen-Image 2.1's encoder overrides image_channels and
    make_down_blocks."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        dims = _dims(args)
        self.conv_in = Conv2d(self.image_channels(args), dims[0], 3, padding=1)
        self.down_blocks = self.make_down_blocks(args, dims)
        self.mid_block = MidBlock(dims[-1])
        self.norm_out = RMSNorm(dims[-1])
        self.conv_out = Conv2d(dims[-1], 2 * args.z_dim, 3, padding=1)

    @staticmethod
    def image_channels(args) -> int:
        return args.input_channels

    @staticmethod
    def make_down_blocks(args, dims) -> list:
        blocks, scale = [], 1.0
        for i, (in_dim, out_dim) in enumerate(zip(dims[:-1], dims[1:])):
            for _ in range(args.num_res_blocks):
                blocks.append(ResidualBlock(in_dim, out_dim))
                if scale in args.attn_scales:
                    blocks.append(AttentionBlock(out_dim))
                in_dim = out_dim
            if i != len(args.dim_mult) - 1:
                blocks.append(Resample(out_dim, up=False))
                scale /= 2.0
        return blocks

    def __call__(self, x, after_stage=None):
        x = stage(after_stage, self.conv_in(x))
        for layer in self.down_blocks:
            x = stage(after_stage, layer(x, after_stage))
        x = self.mid_block(x, after_stage)
        return self.conv_out(nn.silu(self.norm_out(x)))


class UpBlock(nn.Module):
    def __init__(self, in_dim, out_dim, num_res_blocks, upsample):
        super().__init__()
        self.resnets = [ResidualBlock(in_dim if i == 0 else out_dim, out_dim) for i in range(num_res_blocks + 1)]
        if upsample:
            self.upsamplers = [Resample(out_dim, up=True)]

    def __call__(self, x, after_stage=None):
        for resnet in self.resnets:
            x = stage(after_stage, resnet(x, after_stage))
        for up in self.get("upsamplers", []):
            x = stage(after_stage, up(x))
        return x


class Decoder(nn.Module):
    """QwenImageDecoder3d on one frame (attn_scales unused, as in diffusers' decoder). Qwen-Image 2.1's decoder
    overrides base_width, image_channels and make_up_blocks."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        mult = tuple(args.dim_mult)
        dims = [self.base_width(args) * m for m in (mult[-1],) + mult[::-1]]
        self.conv_in = Conv2d(args.z_dim, dims[0], 3, padding=1)
        self.mid_block = MidBlock(dims[0])
        self.up_blocks = self.make_up_blocks(args, dims)
        self.norm_out = RMSNorm(dims[-1])
        self.conv_out = Conv2d(dims[-1], self.image_channels(args), 3, padding=1)

    @staticmethod
    def base_width(args) -> int:
        return args.base_dim

    @staticmethod
    def image_channels(args) -> int:
        return args.input_channels

    @staticmethod
    def make_up_blocks(args, dims) -> list:
        return [UpBlock(in_dim // 2 if i > 0 else in_dim, out_dim, args.num_res_blocks,
                        upsample=i != len(args.dim_mult) - 1)
                for i, (in_dim, out_dim) in enumerate(zip(dims[:-1], dims[1:]))]

    def __call__(self, z, after_stage=None):
        x = self.mid_block(stage(after_stage, self.conv_in(z)), after_stage)
        for block in self.up_blocks:
            x = block(x, after_stage)
        return self.conv_out(nn.silu(self.norm_out(x)))


# -- the model -------------------------------------------------------------------------------------------------

def _frame(x, what):
    """[B, C, H, W], or diffusers' [B, C, 1, H, W] -> [B, C, H, W]."""
    if x.ndim == 5:
        if x.shape[2] != 1:
            raise MlxdiffError(f"Qwen-Image VAE: {what} has {x.shape[2]} frames; only one frame (images) is supported")
        return x[:, :, 0]
    if x.ndim != 4:
        raise MlxdiffError(f"Qwen-Image VAE: {what} must be [B, C, H, W] (or [B, C, 1, H, W]), got {list(x.shape)}")
    return x


class Model(nn.Module):
    """AutoencoderKLQwenImage for images: `encode(x)` / `decode(z)` take and return NCHW (4-D; the 5-D T = 1 form is
    also taken). Latent normalisation is the caller's (`scale_latents` / `unscale_latents`)."""

    # diffusers' tile_sample_min_height / width and stride: 256 and 192 pixels
    TILE_SAMPLE = 256
    TILE_OVERLAP = 0.25

    ENCODER, DECODER = Encoder, Decoder      # the classes built (Qwen-Image 2.1's model names its residual ones)

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.compute_dtype = mx.float32
        self.encoder = self.ENCODER(args)
        self.quant_conv = nn.Conv2d(2 * args.z_dim, 2 * args.z_dim, 1)
        self.post_quant_conv = nn.Conv2d(args.z_dim, args.z_dim, 1)
        self.decoder = self.DECODER(args)

    @property
    def factor(self) -> int:
        return 2 ** len(self.args.temperal_downsample)

    def set_memory_policy(self, after_stage=None, band_bytes=None):
        """As vae.Model.set_memory_policy: `after_stage(x)` between stages, 3x3 convs in exact row bands."""
        self.after_stage = after_stage
        for _, module in self.named_modules():
            if isinstance(module, Conv2d):
                module.band_bytes = band_bytes

    def decode_bytes(self, shape, dtype) -> int:
        """About the activations of an untiled staged decode of latents `shape` (NCHW): four copies of the widest
        full-resolution activation (the last upsampler's input channels)."""
        b, _, h, w = shape[0], shape[1], shape[-2], shape[-1]
        mult = tuple(self.args.dim_mult)
        widest = self.args.base_dim * max(mult[:2])
        return 4 * b * h * w * self.factor ** 2 * widest * mx.zeros((), dtype).itemsize

    def _moments(self, x):
        return self.quant_conv(self.encoder(x, getattr(self, "after_stage", None)))

    def _decoded(self, z):
        return self.decoder(self.post_quant_conv(z), getattr(self, "after_stage", None))

    def encode_moments(self, x, tiling=None, tile_latent_size=None, overlap=TILE_OVERLAP):
        """Image [B, C, H, W] in [-1, 1] -> (mean, logvar), each [B, z_dim, H/f, W/f] (logvar clipped to
        [-30, 20] as DiagonalGaussianDistribution). tiling None: tiles when H or W exceeds the image tile."""
        x = _frame(x, "the image")
        _, sample_tile = self.tile_sizes(tile_latent_size)
        if tiling is None:
            tiling = max(x.shape[-2:]) > sample_tile
        x = nchw_to_nhwc(x.astype(self.compute_dtype))
        if tiling:
            latent_tile, sample_tile = self.tile_sizes(tile_latent_size)
            h = tiled_apply(x, self._moments, sample_tile, tile_stride(sample_tile, overlap),
                            int(latent_tile * overlap), latent_tile - int(latent_tile * overlap))
        else:
            h = self._moments(x)
        mean, logvar = mx.split(nhwc_to_nchw(h), 2, axis=1)
        return mean, mx.clip(logvar, -30.0, 20.0)

    def encode(self, x, tiling=None, tile_latent_size=None, overlap=TILE_OVERLAP):
        """Image -> the posterior's mean (its mode: retrieve_latents(sample_mode="argmax"), the edit pipelines)."""
        return self.encode_moments(x, tiling, tile_latent_size, overlap)[0]

    @staticmethod
    def sample_latents(mean, logvar, noise):
        """DiagonalGaussianDistribution.sample with the given standard-normal `noise`: mean + exp(logvar / 2) *
        noise (retrieve_latents' default, the img2img pipeline)."""
        return mean + mx.exp(0.5 * logvar) * noise.astype(mean.dtype)

    def decode(self, z, tiling=None, tile_latent_size=None, overlap=TILE_OVERLAP):
        """Latent [B, z_dim, h, w] -> image [B, C, h*f, w*f], clamped to [-1, 1] as diffusers' `_decode`.
        tiling None: tiles when h or w exceeds the latent tile (`tile_sizes`)."""
        z = _frame(z, "the latents")
        latent_tile, _ = self.tile_sizes(tile_latent_size)
        if tiling is None:
            tiling = max(z.shape[-2:]) > latent_tile
        if tiling:
            return self.tiled_decode(z, tile_latent_size, overlap)
        out = self._decoded(nchw_to_nhwc(z.astype(self.compute_dtype)))
        return mx.clip(nhwc_to_nchw(out), -1.0, 1.0)

    def tile_sizes(self, tile_latent_size=None):
        """(latent tile, image tile): by default diffusers' 256-pixel tiles (32 latents at f = 8)."""
        if tile_latent_size is None:
            return self.TILE_SAMPLE // self.factor, self.TILE_SAMPLE
        if tile_latent_size < 1:
            raise MlxdiffError(f"VAE tiling: tile_latent_size must be a positive number of latent pixels, "
                               f"got {tile_latent_size}")
        return tile_latent_size, tile_latent_size * self.factor

    def tiled_decode(self, z, tile_latent_size=None, overlap=TILE_OVERLAP):
        """`decode` tile by tile, cross-faded over the overlap as diffusers' tiled_decode (which does not clamp)."""
        z = _frame(z, "the latents")
        latent_tile, sample_tile = self.tile_sizes(tile_latent_size)
        out = tiled_apply(nchw_to_nhwc(z.astype(self.compute_dtype)), self._decoded, latent_tile,
                          tile_stride(latent_tile, overlap), int(sample_tile * overlap),
                          sample_tile - int(sample_tile * overlap))
        return nhwc_to_nchw(out)

    def __call__(self, x):
        return self.decode(self.encode(x))

    def _stats(self, latents):
        """(latents_mean, 1 / latents_std) in the latents' dtype."""
        mean = mx.array(self.args.latents_mean).reshape(1, -1, 1, 1).astype(latents.dtype)
        inv_std = (1.0 / mx.array(self.args.latents_std)).reshape(1, -1, 1, 1).astype(latents.dtype)
        return mean, inv_std

    def scale_latents(self, latents):
        """VAE latents -> the transformer's space: (latents - latents_mean) * (1 / latents_std), as
        QwenImageImg2ImgPipeline._encode_vae_image."""
        mean, inv_std = self._stats(latents)
        return (latents - mean) * inv_std

    def unscale_latents(self, latents):
        """The inverse (the pipelines' decode tail): latents / (1 / latents_std) + latents_mean."""
        mean, inv_std = self._stats(latents)
        return latents / inv_std + mean

    def sanitize(self, weights):
        """diffusers names and PyTorch layouts -> this module's: causal conv3d kernels [O, I, kt, kh, kw] keep their
        last temporal slice (the only one a single frame meets), conv kernels OIHW -> OHWI, the attention's 1x1
        convs become Linear weights, RMS gammas flatten; the resamples' time_conv (unused at T = 1) is dropped."""
        out = {}
        for key, value in weights.items():
            if ".time_conv." in key:
                continue
            if key.endswith(".gamma"):
                value = value.reshape(-1)
            elif ".to_qkv." in key or ".proj." in key:
                value = value.reshape(value.shape[0], -1) if value.ndim == 4 else value
            elif value.ndim == 5:
                value = mx.contiguous(value[:, :, -1].transpose(0, 2, 3, 1))
            elif value.ndim == 4:
                value = mx.contiguous(value.transpose(0, 2, 3, 1))
            out[key] = value
        return out


# -- the original (Wan) naming ---------------------------------------------------------------------------------

# a residual block's Wan names -> diffusers' ({g}: the group number of the (weight|bias) match in the full rule)
_RESIDUAL = [(r"residual\.0\.gamma", "norm1.gamma"), (r"residual\.2\.(weight|bias)", r"conv1.\{g}"),
             (r"residual\.3\.gamma", "norm2.gamma"), (r"residual\.6\.(weight|bias)", r"conv2.\{g}"),
             (r"shortcut\.(weight|bias)", r"conv_shortcut.\{g}")]


def original_keymap(levels=4, num_res_blocks=2):
    """Wan / ComfyUI VAE names -> diffusers' (convert_wan_vae_to_diffusers, for `levels` resolution levels and
    `num_res_blocks`): the decoder's flat `upsamples` list holds, per level, num_res_blocks + 1 residual blocks
    then a resample (none after the last level)."""
    rules = [
        (r"conv1\.(weight|bias)", r"quant_conv.\1"),
        (r"conv2\.(weight|bias)", r"post_quant_conv.\1"),
        (r"(encoder|decoder)\.conv1\.(weight|bias)", r"\1.conv_in.\2"),
        (r"(encoder|decoder)\.head\.0\.gamma", r"\1.norm_out.gamma"),
        (r"(encoder|decoder)\.head\.2\.(weight|bias)", r"\1.conv_out.\2"),
        (r"(encoder|decoder)\.middle\.1\.(.+)", r"\1.mid_block.attentions.0.\2"),
    ]
    for i, r in ((0, 0), (2, 1)):
        rules += [(rf"(encoder|decoder)\.middle\.{i}\.{a}", rf"\1.mid_block.resnets.{r}." + b.format(g=2))
                  for a, b in _RESIDUAL]
    rules += [(rf"encoder\.downsamples\.(\d+)\.{a}", r"encoder.down_blocks.\1." + b.format(g=2))
              for a, b in _RESIDUAL]
    rules.append((r"encoder\.downsamples\.(\d+)\.(.+)", r"encoder.down_blocks.\1.\2"))
    per_level = num_res_blocks + 2
    for level in range(levels):
        for j in range(num_res_blocks + 1):
            n = level * per_level + j
            rules += [(rf"decoder\.upsamples\.{n}\.{a}", rf"decoder.up_blocks.{level}.resnets.{j}." + b.format(g=1))
                      for a, b in _RESIDUAL]
        if level != levels - 1:
            n = level * per_level + num_res_blocks + 1
            rules.append((rf"decoder\.upsamples\.{n}\.(.+)", rf"decoder.up_blocks.{level}.upsamplers.0.\1"))
    return rules


ORIGINAL_KEYMAP = original_keymap(4, 2)


def has_original_names(names) -> bool:
    """Whether VAE tensor names are Wan's (encoder.downsamples..., decoder.upsamples..., conv1 / conv2)."""
    return any(n.startswith(("encoder.downsamples.", "decoder.upsamples.", "encoder.middle.")) for n in names)


def config_from_original(weights: dict) -> dict:
    """An AutoencoderKLQwenImage config read off Wan-named weight shapes (attn_scales, temperal_downsample and the
    latent statistics: Qwen-Image's where the shapes cannot tell)."""
    def shape(key):
        if key not in weights:
            raise MlxdiffError(f"Qwen-Image VAE weights: {key!r} is missing; this is not a Wan-named VAE")
        return tuple(weights[key].shape)

    base_dim = shape("encoder.conv1.weight")[0]
    z_dim = shape("conv2.weight")[0]
    blocks = {int(m.group(1)): m.group(2) for k in weights
              if (m := re.match(r"encoder\.downsamples\.(\d+)\.(residual|resample|norm)", k))}
    resamples = sorted(i for i, kind in blocks.items() if kind == "resample")
    levels = len(resamples) + 1
    residual_idx = sorted(i for i, kind in blocks.items() if kind == "residual")
    num_res_blocks = sum(1 for i in residual_idx if not resamples or i < resamples[0])
    mult = []
    for i in residual_idx[num_res_blocks - 1::num_res_blocks]:
        mult.append(shape(f"encoder.downsamples.{i}.residual.2.weight")[0] // base_dim)
    temporal = [f"encoder.downsamples.{i}.time_conv.weight" in weights for i in resamples]
    config = {k: list(v) if isinstance(v, tuple) else v for k, v in ModelArgs().__dict__.items()}
    config.update(base_dim=base_dim, z_dim=z_dim, dim_mult=mult, num_res_blocks=num_res_blocks,
                  temperal_downsample=temporal, input_channels=shape("encoder.conv1.weight")[1])
    if len(mult) != levels:
        raise MlxdiffError("Qwen-Image VAE weights: the encoder's levels could not be read from the names")
    if z_dim != len(LATENTS_MEAN):
        raise MlxdiffError(f"Qwen-Image VAE weights: z_dim {z_dim} has no known latent statistics (Qwen-Image's "
                           f"are for {len(LATENTS_MEAN)}); use a diffusers folder with its config.json")
    return config


def _original_layout(weights):
    """(levels, num_res_blocks) of Wan-named VAE weights, from the encoder's flat list."""
    blocks = {int(m.group(1)): m.group(2) for k in weights
              if (m := re.match(r"encoder\.downsamples\.(\d+)\.(residual|resample)", k))}
    resamples = sorted(i for i, kind in blocks.items() if kind == "resample")
    residual = sorted(i for i, kind in blocks.items() if kind == "residual")
    if not residual:
        raise MlxdiffError("Qwen-Image VAE weights: no encoder.downsamples.*.residual tensors; not a Wan-named VAE")
    return len(resamples) + 1, sum(1 for i in residual if not resamples or i < resamples[0])


def original_to_diffusers(weights: dict, levels=None, num_res_blocks=None) -> dict:
    """Wan-named weights -> diffusers' names (the level count and num_res_blocks read from the names by default)."""
    if levels is None or num_res_blocks is None:
        levels, num_res_blocks = _original_layout(weights)
    return remap(weights, original_keymap(levels, num_res_blocks))

