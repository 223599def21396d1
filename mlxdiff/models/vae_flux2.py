"""AutoencoderKLFlux2 (diffusers/models/autoencoders/autoencoder_kl_flux2.py), on the blocks of vae.py.

What differs from SD3's AutoencoderKL: 32 latent channels, quant_conv / post_quant_conv, an optional narrower
decoder (`decoder_block_out_channels`), and no scaling/shift factors: the pipeline patchifies latents 2x2
([B, 32, H, W] -> [B, 128, H/2, W/2]) and normalises them with the running statistics of a BatchNorm2d named
`bn` (affine=False), exactly as Flux2Pipeline does by hand.
"""

import math
from dataclasses import dataclass
from typing import Optional

import mlx.core as mx
import mlx.nn as nn

from ..config_checks import MAX_LEVELS, MAX_WIDTH, Rule, between, positive
from . import vae

CLASS_NAMES = ("AutoencoderKLFlux2",)   # diffusers' class: its key in models/registry.ARCHITECTURES


@dataclass
class ModelArgs(vae.ModelArgs):
    """vae.ModelArgs with AutoencoderKLFlux2's defaults and fields: no latent scaling (the `bn` statistics take its
    place), quant convs, an optional narrower decoder, the 2x2 latent patch."""
    latent_channels: int = 32
    scaling_factor: float = 1.0
    shift_factor: Optional[float] = None
    use_quant_conv: bool = True
    use_post_quant_conv: bool = True
    decoder_block_out_channels: Optional[tuple[int, ...]] = None
    batch_norm_eps: float = 1e-4
    batch_norm_momentum: float = 0.1
    patch_size: tuple[int, ...] = (2, 2)

    WHAT = "FLUX.2 VAE config"
    LIMITS = {
        **vae.ModelArgs.LIMITS,
        "decoder_block_out_channels": between(1, MAX_WIDTH, items=(1, MAX_LEVELS)),
        "batch_norm_eps": positive(1),
        "batch_norm_momentum": between(0, 1),
        "patch_size": between(1, 16, items=(2, 2)),
    }
    RULES = vae.ModelArgs.RULES + (
        Rule("decoder_block_out_channels", lambda a: a.decoder_block_out_channels is None
             or (len(a.decoder_block_out_channels) == len(a.block_out_channels)
                 and vae._grouped(a.decoder_block_out_channels, a.norm_num_groups)),
             lambda a: f"expected null or {len(a.block_out_channels)} multiples of norm_num_groups "
                       f"{a.norm_num_groups}, one per block_out_channels entry"),
    )


# the class defaults above are the FLUX.2-dev / klein vae/config.json; used for original single files
FLUX2_CONFIG = {k: list(v) if isinstance(v, tuple) else v for k, v in ModelArgs().__dict__.items()
                if k not in ("scaling_factor", "shift_factor", "latents_mean", "latents_std", "force_upcast")}


def patchify(latents, patch_size=(2, 2)):
    """[B, C, H, W] -> [B, C*p*q, H/p, W/q]; channel c*p*q + dy*q + dx (Flux2Pipeline._patchify_latents)."""
    p, q = patch_size
    b, c, h, w = latents.shape
    x = latents.reshape(b, c, h // p, p, w // q, q).transpose(0, 1, 3, 5, 2, 4)
    return x.reshape(b, c * p * q, h // p, w // q)


def unpatchify(latents, patch_size=(2, 2)):
    """The inverse of `patchify` (Flux2Pipeline._unpatchify_latents)."""
    p, q = patch_size
    b, c, h, w = latents.shape
    x = latents.reshape(b, c // (p * q), p, q, h, w).transpose(0, 1, 4, 2, 5, 3)
    return x.reshape(b, c // (p * q), h * p, w * q)


class LatentBatchNorm(nn.Module):
    """Only the running statistics of diffusers' `bn` (BatchNorm2d, affine=False); the pipeline applies them."""

    def __init__(self, num_features):
        super().__init__()
        self.running_mean = mx.zeros((num_features,))
        self.running_var = mx.ones((num_features,))


class Model(vae.Model):
    """AutoencoderKLFlux2: `decode` / `encode` as vae.Model (NCHW), plus the pipeline's latent normalisation."""

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.bn = LatentBatchNorm(math.prod(args.patch_size) * args.latent_channels)

    def _stats(self, latents):
        # diffusers: mean and sqrt(var + eps) in the stats' dtype, then cast to the latents' dtype
        mean = self.bn.running_mean.reshape(1, -1, 1, 1)
        std = mx.sqrt(self.bn.running_var.reshape(1, -1, 1, 1) + self.args.batch_norm_eps)
        return mean.astype(latents.dtype), std.astype(latents.dtype)

    def normalize_latents(self, latents):
        """Patchified VAE latents -> the transformer's latent space."""
        latents = latents.astype(self.compute_dtype)
        mean, std = self._stats(latents)
        return (latents - mean) / std

    def denormalize_latents(self, latents):
        latents = latents.astype(self.compute_dtype)
        mean, std = self._stats(latents)
        return latents * std + mean

    def patchify_and_normalize(self, latents):
        """`encode(image)` output [B, 32, H, W] -> [B, 128, H/2, W/2] as Flux2Pipeline._encode_vae_image."""
        return self.normalize_latents(patchify(latents, self.args.patch_size))

    def denormalize_and_unpatchify(self, latents):
        """Denoised [B, 128, h, w] -> [B, 32, 2h, 2w], ready for `decode` (the end of Flux2Pipeline.__call__)."""
        return unpatchify(self.denormalize_latents(latents), self.args.patch_size)

    unscale_latents = denormalize_and_unpatchify   # what the shared decode step asks every VAE for

    def sanitize(self, weights):
        # BatchNorm's step counter (int64) is not used by inference
        weights = {k: v for k, v in weights.items() if not k.endswith("num_batches_tracked")}
        return super().sanitize(weights)


def original_keymap(num_blocks=4):
    """BFL `ae.safetensors` names -> diffusers: the ldm names, with the quant convs inside encoder/decoder."""
    return [
        (r"encoder\.quant_conv\.(weight|bias)", r"quant_conv.\1"),
        (r"decoder\.post_quant_conv\.(weight|bias)", r"post_quant_conv.\1"),
        (r"bn\.num_batches_tracked", None),
    ] + vae.ldm_keymap(num_blocks)


ORIGINAL_KEYMAP = original_keymap(4)


def config_from_original(weights: dict) -> dict:
    """An AutoencoderKLFlux2 config read off BFL-named weight shapes (group count and bn eps: FLUX.2's)."""
    return vae.config_from_ldm(weights, defaults=FLUX2_CONFIG)
