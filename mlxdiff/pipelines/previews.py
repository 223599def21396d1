"""Cheap previews of a run's latents (generate(on_step=...), the CLI's --preview, the server's event stream): the
latent-to-RGB projections ComfyUI uses for its live previews (comfy/latent_formats.py, each latent format's
`latent_rgb_factors` and `latent_rgb_factors_bias`), applied to the latents in diffusers' layout, which are scaled
and shifted as ComfyUI's model-side latents are. A family names its projection in its Family record (`preview`).
With a tiny VAE (--preview-vae FILE: TAESD / TAESDXL / TAESD3 / TAEF1 / TAEF2, models/taesd.py) the same latents are
decoded by it instead.
"""

from dataclasses import dataclass

import numpy as np
from PIL import Image

from .. import backend  # noqa: F401  (OpenBLAS preload before mlx)
import mlx.core as mx

from ..errors import MlxdiffError
from ..formats import check_weight_file, open_weights
from ..loading.build import load_into
from ..models import taesd

PREVIEW_LONG_SIDE = 512     # a preview's longest side at most (ComfyUI's max_preview_resolution)


@dataclass(frozen=True)
class LatentRGB:
    """One latent format's projection: rgb = latents . factors + bias, then [-1, 1] -> [0, 1] as ComfyUI's
    preview_to_image."""
    factors: tuple          # one (r, g, b) row per VAE latent channel
    bias: tuple = (0.0, 0.0, 0.0)
    patch: int = 1          # the latents' channels are patch x patch groups of the VAE's (FLUX.2's 2x2), undone first


def unpatchify(latents: np.ndarray, patch: int) -> np.ndarray:
    """(C * p * p, h, w) -> (C, h * p, w * p), channel c * p * p + py * p + px (ComfyUI's latent_rgb_factors_reshape,
    diffusers' Flux2 _unpatchify_latents)."""
    if patch == 1:
        return latents
    c, h, w = latents.shape
    return latents.reshape(c // (patch * patch), patch, patch, h, w).transpose(0, 3, 1, 4, 2).reshape(
        c // (patch * patch), h * patch, w * patch)


def first_channels(latents: np.ndarray) -> np.ndarray:
    """A model without known factors: its first three channels (repeated where it has fewer), each stretched to
    [0, 1] over its own range, so the preview shows structure instead of a flat grey."""
    rgb = latents[[min(k, latents.shape[0] - 1) for k in range(3)]]
    low, high = rgb.min(axis=(1, 2), keepdims=True), rgb.max(axis=(1, 2), keepdims=True)
    return (rgb - low) / np.maximum(high - low, 1e-6)


def preview_size(width: int, height: int) -> tuple:
    """The output's size, scaled down so that its longest side is at most PREVIEW_LONG_SIDE."""
    scale = min(1.0, PREVIEW_LONG_SIDE / max(width, height))
    return max(1, round(width * scale)), max(1, round(height * scale))


def load_tiny_vae(path, latent_channels=None) -> taesd.Model:
    """A TAESD-family decoder file (diffusers' AutoencoderTiny or madebyollin's *_decoder.safetensors), checked
    against the model's VAE latent channels where they are known, loaded whole (a few MB)."""
    path = check_weight_file(path, "tiny VAE (TAESD) file")
    stored = open_weights(path)    # (its own errors name the file)
    try:   # another model's file: names that are no decoder's (int() of a name, a missing level's conv)
        weights = taesd.Model.sanitize(stored)
        config = taesd.config_from_weights(weights)
    except (MlxdiffError, ValueError, KeyError, IndexError) as e:
        reason = str(e) if isinstance(e, MlxdiffError) else f"its tensor names ({e}) are no tiny VAE decoder's"
        raise MlxdiffError(f"{path}: {reason}; give a TAESD-family decoder file (TAESD, TAESDXL, "
                           "TAESD3, TAEF1, TAEF2: diffusers' AutoencoderTiny or madebyollin's *_decoder)") from None
    args = taesd.ModelArgs.from_dict(config, where=str(path))
    if latent_channels is not None and args.latent_channels != latent_channels:
        raise MlxdiffError(f"{path}: a tiny VAE for {args.latent_channels}-channel latents, but this model's VAE has "
                           f"{latent_channels}; give the TAESD of this model's family (TAESD, TAESDXL, TAESD3, TAEF1, "
                           "TAEF2)")
    model = taesd.Model(args)
    load_into(model, {k: v.astype(mx.float32) for k, v in weights.items()}, path)
    mx.eval(model.parameters())
    return model


def latent_preview(latents, rgb: LatentRGB | None, width: int, height: int, decoder=None) -> Image.Image:
    """The first image of a batch of latents (diffusers' layout: B, C, h, w) as a PIL RGB image of preview_size:
    `decoder`'s (a tiny VAE) where given, else the projection."""
    z = np.asarray(latents, dtype=np.float32)[0]
    z = unpatchify(z, rgb.patch if rgb is not None and z.shape[0] % (rgb.patch ** 2) == 0 else 1)
    if decoder is not None:
        decoded = decoder(mx.array(z[None]))[0]
        image = np.array(mx.clip(decoded / 2 + 0.5, 0, 1))
    elif rgb is not None and z.shape[0] == len(rgb.factors):
        image = np.einsum("chw,cr->rhw", z, np.asarray(rgb.factors, np.float32))
        image = np.clip((image + np.asarray(rgb.bias, np.float32)[:, None, None] + 1) / 2, 0, 1)
    else:
        image = first_channels(z)
    pil = Image.fromarray((image.transpose(1, 2, 0) * 255).round().astype(np.uint8))
    return pil.resize(preview_size(width, height), Image.BILINEAR)


# comfy/latent_formats.py: SD15, SDXL, SD3, Flux (FLUX.1, Chroma, Z-Image), Flux2, Wan21 (Qwen-Image)
SD15 = LatentRGB(((0.3512, 0.2297, 0.3227), (0.3250, 0.4974, 0.2350), (-0.2829, 0.1762, 0.2721),
                  (-0.2120, -0.2616, -0.7177)))
SDXL = LatentRGB(((0.3651, 0.4232, 0.4341), (-0.2533, -0.0042, 0.1068), (0.1076, 0.1111, -0.0362),
                  (-0.3165, -0.2492, -0.2188)), (0.1084, -0.0175, -0.0011))
SD3 = LatentRGB((
    (-0.0922, -0.0175, 0.0749), (0.0311, 0.0633, 0.0954), (0.1994, 0.0927, 0.0458), (0.0856, 0.0339, 0.0902),
    (0.0587, 0.0272, -0.0496), (-0.0006, 0.1104, 0.0309), (0.0978, 0.0306, 0.0427), (-0.0042, 0.1038, 0.1358),
    (-0.0194, 0.0020, 0.0669), (-0.0488, 0.0130, -0.0268), (0.0922, 0.0988, 0.0951), (-0.0278, 0.0524, -0.0542),
    (0.0332, 0.0456, 0.0895), (-0.0069, -0.0030, -0.0810), (-0.0596, -0.0465, -0.0293), (-0.1448, -0.1463, -0.1189)),
    (0.2394, 0.2135, 0.1925))
FLUX1 = LatentRGB((
    (-0.0346, 0.0244, 0.0681), (0.0034, 0.0210, 0.0687), (0.0275, -0.0668, -0.0433), (-0.0174, 0.0160, 0.0617),
    (0.0859, 0.0721, 0.0329), (0.0004, 0.0383, 0.0115), (0.0405, 0.0861, 0.0915), (-0.0236, -0.0185, -0.0259),
    (-0.0245, 0.0250, 0.1180), (0.1008, 0.0755, -0.0421), (-0.0515, 0.0201, 0.0011), (0.0428, -0.0012, -0.0036),
    (0.0817, 0.0765, 0.0749), (-0.1264, -0.0522, -0.1103), (-0.0280, -0.0881, -0.0499), (-0.1262, -0.0982, -0.0778)),
    (-0.0329, -0.0718, -0.0851))
FLUX2 = LatentRGB((
    (0.0058, 0.0113, 0.0073), (0.0495, 0.0443, 0.0836), (-0.0099, 0.0096, 0.0644), (0.2144, 0.3009, 0.3652),
    (0.0166, -0.0039, -0.0054), (0.0157, 0.0103, -0.0160), (-0.0398, 0.0902, -0.0235), (-0.0052, 0.0095, 0.0109),
    (-0.3527, -0.2712, -0.1666), (-0.0301, -0.0356, -0.0180), (-0.0107, 0.0078, 0.0013), (0.0746, 0.0090, -0.0941),
    (0.0156, 0.0169, 0.0070), (-0.0034, -0.0040, -0.0114), (0.0032, 0.0181, 0.0080), (-0.0939, -0.0008, 0.0186),
    (0.0018, 0.0043, 0.0104), (0.0284, 0.0056, -0.0127), (-0.0024, -0.0022, -0.0030), (0.1207, -0.0026, 0.0065),
    (0.0128, 0.0101, 0.0142), (0.0137, -0.0072, -0.0007), (0.0095, 0.0092, -0.0059), (0.0000, -0.0077, -0.0049),
    (-0.0465, -0.0204, -0.0312), (0.0095, 0.0012, -0.0066), (0.0290, -0.0034, 0.0025), (0.0220, 0.0169, -0.0048),
    (-0.0332, -0.0457, -0.0468), (-0.0085, 0.0389, 0.0609), (-0.0076, 0.0003, -0.0043), (-0.0111, -0.0460, -0.0614)),
    (-0.0329, -0.0718, -0.0851), patch=2)
WAN21 = LatentRGB((
    (-0.1299, -0.1692, 0.2932), (0.0671, 0.0406, 0.0442), (0.3568, 0.2548, 0.1747), (0.0372, 0.2344, 0.1420),
    (0.0313, 0.0189, -0.0328), (0.0296, -0.0956, -0.0665), (-0.3477, -0.4059, -0.2925), (0.0166, 0.1902, 0.1975),
    (-0.0412, 0.0267, -0.1364), (-0.1293, 0.0740, 0.1636), (0.0680, 0.3019, 0.1128), (0.0032, 0.0581, 0.0639),
    (-0.1251, 0.0927, 0.1699), (0.0060, -0.0633, 0.0005), (0.3477, 0.2275, 0.2950), (0.1984, 0.0913, 0.1861)),
    (-0.1835, -0.0868, -0.3360))
