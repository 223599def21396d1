"""The tiny VAE's decoder (diffusers' AutoencoderTiny: madebyollin's TAESD / TAESDXL / TAESD3 / TAEF1 / TAEF2), for
previews while an image forms (--preview-vae FILE; pipelines/previews.py). Plain convolutions and ReLUs, a few MB,
fast enough to run after every step. It decodes the latents the denoiser sees (the scaled ones: ComfyUI's previewer
gives it the same), and its output is [-1, 1] as diffusers' DecoderTiny.forward returns it.

A file is diffusers' AutoencoderTiny (`decoder.layers.N.*`, the encoder's tensors ignored) or madebyollin's own
taesd*_decoder.safetensors (`N.*`: the same Sequential behind its Clamp at index 0); its config is read off its
tensors (latent channels, the width, the blocks of each level).
"""

from dataclasses import dataclass

from .. import backend  # noqa: F401  (OpenBLAS preload before mlx)
import mlx.core as mx
import mlx.nn as nn

from ..config_checks import CheckedArgs, between, one_of
from ..errors import MlxdiffError


@dataclass
class ModelArgs(CheckedArgs):
    """AutoencoderTiny's config (its decoder's fields; the encoder's are accepted and not used)."""
    out_channels: int = 3
    decoder_block_out_channels: tuple[int, ...] = (64, 64, 64, 64)
    num_decoder_blocks: tuple[int, ...] = (3, 3, 3, 1)
    latent_channels: int = 4
    upsampling_scaling_factor: int = 2
    act_fn: str = "relu"
    upsample_fn: str = "nearest"

    WHAT = "tiny VAE config"
    LIMITS = {"out_channels": between(1, 16), "decoder_block_out_channels": between(1, 4096, items=(1, 8)),
              "num_decoder_blocks": between(0, 64, items=(1, 8)), "latent_channels": between(1, 1024),
              "upsampling_scaling_factor": between(1, 8), "act_fn": one_of("relu"), "upsample_fn": one_of("nearest")}


class Block(nn.Module):
    """AutoencoderTinyBlock: relu(conv(relu(conv(relu(conv(x))))) + x) at one width (the decoder's are all one)."""

    def __init__(self, channels):
        super().__init__()
        self.conv = [nn.Conv2d(channels, channels, 3, padding=1), nn.ReLU(),
                     nn.Conv2d(channels, channels, 3, padding=1), nn.ReLU(),
                     nn.Conv2d(channels, channels, 3, padding=1)]

    def __call__(self, x):
        y = x
        for layer in self.conv:
            y = layer(y)
        return nn.relu(y + x)


class Model(nn.Module):
    """DecoderTiny: (B, C, h, w) latents (diffusers' layout) -> (B, 3, H, W) in [-1, 1]."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        widths, counts = args.decoder_block_out_channels, args.num_decoder_blocks
        if len(set(widths)) != 1 or len(widths) != len(counts):
            raise MlxdiffError(f"tiny VAE config: decoder_block_out_channels {list(widths)} must be one width per "
                               f"level of num_decoder_blocks {list(counts)} (DecoderTiny's blocks keep their width)")
        width = widths[0]
        layers = [nn.Conv2d(args.latent_channels, width, 3, padding=1), nn.ReLU()]
        for level, count in enumerate(counts):
            last = level == len(counts) - 1
            layers += [Block(width) for _ in range(count)]
            if not last:
                layers.append(nn.Upsample(args.upsampling_scaling_factor, mode="nearest"))
            layers.append(nn.Conv2d(width, args.out_channels if last else width, 3, padding=1, bias=last))
        self.layers = layers

    def __call__(self, latents):
        x = mx.tanh(latents.transpose(0, 2, 3, 1) / 3) * 3      # DecoderTiny's clamp
        for layer in self.layers:
            x = layer(x)
        return (x * 2 - 1).transpose(0, 3, 1, 2)

    @staticmethod
    def sanitize(weights):
        """diffusers' decoder.layers.N / madebyollin's N (behind the Clamp) -> layers.N; conv OIHW -> OHWI."""
        out = {}
        original = not any(k.startswith("decoder.") for k in weights)
        for key, value in weights.items():
            if original:
                index, _, rest = key.partition(".")
                key = f"layers.{int(index) - 1}.{rest}"
            elif key.startswith("decoder."):
                key = key[len("decoder."):]
            else:
                continue            # the encoder: previews only decode
            out[key] = value.transpose(0, 2, 3, 1) if value.ndim == 4 else value
        return out

    @staticmethod
    def quant_predicate(path, module):
        return False                # a few MB: kept whole


def config_from_weights(weights: dict) -> dict:
    """AutoencoderTiny's decoder config read off sanitized tensors: the first conv's input channels and width, the
    blocks between each upsampling (each level ends in a conv, the last one with a bias)."""
    first = weights.get("layers.0.weight")
    if first is None:
        raise MlxdiffError("no layers.0 convolution: not an AutoencoderTiny (TAESD) decoder")
    indices = sorted({int(k.split(".")[1]) for k in weights})
    blocks = {i for i in indices if f"layers.{i}.conv.0.weight" in weights}
    counts, count = [], 0
    for i in indices[1:]:
        if i in blocks:
            count += 1
        else:                       # a level's closing conv
            counts.append(count)
            count = 0
    last = weights[f"layers.{indices[-1]}.weight"]
    return {"latent_channels": int(first.shape[-1]), "decoder_block_out_channels": [int(first.shape[0])] * len(counts),
            "num_decoder_blocks": counts, "out_channels": int(last.shape[0])}
