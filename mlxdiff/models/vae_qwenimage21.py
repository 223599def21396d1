"""AutoencoderKLQwenImage21 (diffusers/models/autoencoders/autoencoder_kl_qwenimage21.py), for images.

Qwen-Image 2.1's VAE is Wan 2.2's residual VAE made 2-D: every QwenImage21CausalConv3d is a Conv2d on the single
frame (it rejects more than one), 16x spatial compression (five levels), 64 latent channels, RGBA in and out
(in_channels = out_channels = 4), a wider decoder (decoder_base_dim). What it shares with the Qwen-Image VAE
(models/vae_qwenimage.py) is imported from there: the RMS norm, residual and attention blocks, the mid block, the
resample convolutions, the single-frame reasoning (the resamples' time_conv never runs on frame 0), encode / decode /
tiling and the latent normalisation. What is new here, at T = 1:

- ResidualDownBlock (is_residual): residual blocks, the downsampler, plus a parameter-free shortcut
  QwenImage21AvgDown3D: space-to-channel over 2x2 (and over time 2 where temperal_downsample is set: one zero
  frame is padded *before* the frame, so half of each group is zero), the channels averaged in groups down to the
  block's width.
- ResidualUpBlock: num_res_blocks + 1 residual blocks, an upsampler whose conv keeps the width (upsample_out_dim =
  out_dim), plus QwenImage21DupUp3D: channels repeated up to out * 2x2 (x 2 in time) then channel-to-space; on the
  first chunk (the only one for an image) only the last of the temporal copies is kept.

Latents are [B, 64, H/16, W/16] (diffusers' [B, 64, 1, H/16, W/16] also taken); images [B, 4, H, W] in [-1, 1].
"""

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from ..config_checks import MAX_LEVELS, MAX_WIDTH, CheckedArgs, Rule, between, one_of
from . import vae_qwenimage
from .vae import Conv2d, stage
from .vae_qwenimage import ResidualBlock

# AutoencoderKLQwenImage21's defaults (Qwen-Image 2.1's vae/config.json)
LATENTS_MEAN = (0.5126, 0.7721, -0.0631, 1.3506, -0.7855, -2.1025, -0.3458, 1.3722, 1.8873, -1.7177, -0.6510, 0.2732,
                0.7562, -0.6163, -1.0277, 3.8363, 2.0210, 0.0472, 0.9320, 2.0087, 2.4954, -0.1391, -1.4249, 1.8464,
                -0.5236, 1.2826, 3.7046, -1.3035, 2.7286, -1.4518, -1.9036, -1.9955, -0.0342, -1.0265, -0.7636,
                3.0555, 0.0746, -3.0751, -0.1076, 1.7376, -1.0914, -1.9435, -0.2784, -1.3680, 0.4809, -0.4433,
                0.3764, 0.5729, -2.0595, 1.0960, -1.3260, -2.0211, -5.0179, 0.5275, 4.0162, 1.8505, 0.3026, 1.9373,
                1.4937, 0.2632, 0.5547, -1.7121, -0.1562, 0.0304)
LATENTS_STD = (3.2001, 3.2936, 3.4321, 3.0091, 3.1061, 4.0379, 4.0705, 3.7910, 3.0785, 3.6500, 3.9308, 3.0904,
               2.8778, 3.7675, 3.7320, 5.0756, 3.2864, 4.0397, 3.1317, 4.0443, 2.9249, 3.9454, 3.0988, 4.2489,
               3.4896, 3.8513, 3.9323, 3.4719, 3.7498, 4.2830, 3.5694, 4.2467, 3.9037, 3.2947, 5.0770, 3.5075,
               3.2700, 3.4767, 2.8063, 5.1125, 3.5327, 4.7833, 3.1286, 4.1819, 3.8527, 3.8312, 3.5605, 4.3875,
               3.9624, 4.0168, 3.5643, 4.0550, 5.5614, 4.2963, 4.4080, 3.4959, 3.8747, 3.7608, 3.5735, 3.1490,
               3.7662, 3.6746, 3.4563, 3.8161)


CLASS_NAMES = ("AutoencoderKLQwenImage21",)   # diffusers' class: its key in models/registry.ARCHITECTURES


@dataclass
class ModelArgs(CheckedArgs):
    """diffusers' AutoencoderKLQwenImage21 config."""
    base_dim: int = 96
    decoder_base_dim: int | None = 144       # None: base_dim
    z_dim: int = 64
    dim_mult: tuple[int, ...] = (1, 2, 4, 8, 8)
    num_res_blocks: int = 2
    attn_scales: tuple[float, ...] = ()
    temperal_downsample: tuple[bool, ...] = (False, True, True, True)
    dropout: float = 0.0
    latents_mean: tuple[float, ...] = LATENTS_MEAN
    latents_std: tuple[float, ...] = LATENTS_STD
    is_residual: bool = True
    in_channels: int = 4
    out_channels: int = 4
    patch_size: int | None = None
    scale_factor_temporal: int | None = 8
    scale_factor_spatial: int | None = 16

    WHAT = "Qwen-Image 2.1 VAE config"
    LIMITS = {
        "base_dim": between(1, MAX_WIDTH),
        "decoder_base_dim": between(1, MAX_WIDTH),
        "z_dim": between(1, 1024),
        "dim_mult": between(1, 64, items=(1, MAX_LEVELS)),
        "num_res_blocks": between(1, 16),
        "attn_scales": between(0, 1, items=(0, MAX_LEVELS)),
        "dropout": between(0, 1),
        # the non-residual variant is Wan 2.1's (vae_qwenimage) made 2-D; no Qwen-Image 2.1 checkpoint uses it
        "is_residual": one_of(True),
        "in_channels": between(1, MAX_WIDTH),
        "out_channels": between(1, MAX_WIDTH),
        "patch_size": one_of(None, 1),
    }
    RULES = (
        Rule("attn_scales", lambda a: not a.attn_scales,
             lambda a: "expected [] (diffusers' residual blocks build no attention at any scale)"),
        Rule("temperal_downsample", lambda a: len(a.temperal_downsample) == len(a.dim_mult) - 1,
             lambda a: f"expected one per level after the first ({len(a.dim_mult) - 1})"),
        Rule("dim_mult", lambda a: all(_shortcut_fits(a, i) for i in range(len(a.dim_mult))),
             lambda a: "each level's width times its down/upsampling factor must be a multiple of the next "
                       "level's width (QwenImage21AvgDown3D / DupUp3D group channels)"),
        Rule("latents_mean", lambda a: len(a.latents_mean) == a.z_dim, lambda a: f"expected z_dim ({a.z_dim}) values"),
        Rule("latents_std", lambda a: len(a.latents_std) == a.z_dim and all(s > 0 for s in a.latents_std),
             lambda a: f"expected z_dim ({a.z_dim}) positive values"),
    )

    def __post_init__(self):
        for name in ("dim_mult", "attn_scales", "temperal_downsample", "latents_mean", "latents_std"):
            setattr(self, name, tuple(getattr(self, name)))

    @property
    def decoder_dim(self) -> int:
        return self.decoder_base_dim or self.base_dim


def _levels(args, i):
    """Level i's (temporal, spatial) resampling factors."""
    last = i == len(args.dim_mult) - 1
    return (2 if not last and args.temperal_downsample[i] else 1), (1 if last else 2)


def _shortcut_fits(args, i) -> bool:
    ft, fs = _levels(args, i)
    enc = [args.base_dim * m for m in (1,) + tuple(args.dim_mult)]
    mult = tuple(args.dim_mult)
    dec = [args.decoder_dim * m for m in (mult[-1],) + mult[::-1]]
    up_ft = 2 if i != len(mult) - 1 and args.temperal_downsample[::-1][i] else 1
    return (enc[i] * ft * fs * fs) % enc[i + 1] == 0 and (i == len(mult) - 1 or (dec[i + 1] * up_ft * 4) % dec[i] == 0)


# -- the shortcuts (NHWC, one frame) -----------------------------------------------------------------------------

def avg_down(x, out_channels, factor_t, factor_s):
    """QwenImage21AvgDown3D on one frame: (B, H, W, C) -> (B, H/fs, W/fs, out)."""
    b, h, w, c = x.shape
    x = x.reshape(b, h // factor_s, factor_s, w // factor_s, factor_s, c).transpose(0, 1, 3, 5, 2, 4)
    if factor_t == 2:       # the zero frame padded before the frame: (C, t, sh, sw) with t = 0 all zeros
        x = mx.stack([mx.zeros_like(x), x], axis=4)
    x = x.reshape(b, h // factor_s, w // factor_s, out_channels, -1)
    return mx.mean(x, axis=-1)


def dup_up(x, out_channels, factor_t, factor_s):
    """QwenImage21DupUp3D on the first (only) chunk: (B, H, W, C) -> (B, H*fs, W*fs, out)."""
    b, h, w, c = x.shape
    repeats = out_channels * factor_t * factor_s * factor_s // c
    x = mx.repeat(x, repeats, axis=-1).reshape(b, h, w, out_channels, factor_t, factor_s, factor_s)[..., -1, :, :]
    return x.transpose(0, 1, 4, 2, 5, 3).reshape(b, h * factor_s, w * factor_s, out_channels)


class Resample(vae_qwenimage.Resample):
    """QwenImage21Resample at T = 1: vae_qwenimage's, the upsampler's conv to `out_dim` channels."""

    def __init__(self, dim, up, out_dim=None):
        super().__init__(dim, up)
        if up:
            self.resample[1] = Conv2d(dim, out_dim or dim // 2, 3, padding=1)


class ResidualDownBlock(nn.Module):
    def __init__(self, in_dim, out_dim, num_res_blocks, factor_t, factor_s):
        super().__init__()
        self.factors = (out_dim, factor_t, factor_s)
        self.resnets = [ResidualBlock(in_dim if i == 0 else out_dim, out_dim) for i in range(num_res_blocks)]
        if factor_s > 1:
            self.downsampler = Resample(out_dim, up=False)

    def __call__(self, x, after_stage=None):
        shortcut = avg_down(x, *self.factors)
        for resnet in self.resnets:
            x = stage(after_stage, resnet(x, after_stage))
        if "downsampler" in self:
            x = stage(after_stage, self.downsampler(x))
        return x + shortcut


class ResidualUpBlock(nn.Module):
    def __init__(self, in_dim, out_dim, num_res_blocks, factor_t, up):
        super().__init__()
        self.factors = (out_dim, factor_t, 2)
        self.up = up
        self.resnets = [ResidualBlock(in_dim if i == 0 else out_dim, out_dim) for i in range(num_res_blocks + 1)]
        if up:
            self.upsampler = Resample(out_dim, up=True, out_dim=out_dim)

    def __call__(self, x, after_stage=None):
        shortcut = dup_up(x, *self.factors) if self.up else None
        for resnet in self.resnets:
            x = stage(after_stage, resnet(x, after_stage))
        if self.up:
            x = stage(after_stage, self.upsampler(x)) + shortcut
        return x


class Encoder(vae_qwenimage.Encoder):
    """QwenImage21Encoder3d (is_residual) on one frame: vae_qwenimage's, with residual down blocks."""

    @staticmethod
    def image_channels(args) -> int:
        return args.in_channels

    @staticmethod
    def make_down_blocks(args, dims) -> list:
        return [ResidualDownBlock(dims[i], dims[i + 1], args.num_res_blocks, *_levels(args, i))
                for i in range(len(args.dim_mult))]


class Decoder(vae_qwenimage.Decoder):
    """QwenImage21Decoder3d (is_residual) on one frame: vae_qwenimage's, decoder_base_dim wide, with residual up
    blocks."""

    @staticmethod
    def base_width(args) -> int:
        return args.decoder_dim

    @staticmethod
    def image_channels(args) -> int:
        return args.out_channels

    @staticmethod
    def make_up_blocks(args, dims) -> list:
        upsample_t = tuple(args.temperal_downsample)[::-1]
        blocks = []
        for i in range(len(args.dim_mult)):
            up = i != len(args.dim_mult) - 1
            blocks.append(ResidualUpBlock(dims[i], dims[i + 1], args.num_res_blocks,
                                          2 if up and upsample_t[i] else 1, up))
        return blocks


class Model(vae_qwenimage.Model):
    """AutoencoderKLQwenImage21 for images: vae_qwenimage.Model's encode / decode / tiling / latent normalisation
    (and sanitize: its 2-D kernels OIHW -> OHWI, the attention's 1x1 convs as Linear, RMS gammas flattened, the
    unused time_conv dropped) over this module's residual encoder and decoder. Images have out_channels (RGBA)."""

    ENCODER, DECODER = Encoder, Decoder

    def decode_bytes(self, shape, dtype) -> int:
        """About the activations of an untiled staged decode of latents `shape`: four copies of the widest
        full-resolution activation (the last up block's width)."""
        b, h, w = shape[0], shape[-2], shape[-1]
        widest = self.args.decoder_dim * max(tuple(self.args.dim_mult)[:2])
        return 4 * b * h * w * self.factor ** 2 * widest * mx.zeros((), dtype).itemsize
