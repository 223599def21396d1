"""ControlNetModel (SD 1.x / SDXL): diffusers/models/controlnets/controlnet.py, re-implemented in MLX on
models/unet.py's blocks (the down path and the middle block are a UNet's, built by the same functions).

The control image goes through a small conv stack (controlnet_cond_embedding) onto conv_in's output; the copied down
path and middle block run on it, and a zero-initialised 1x1 conv per skip (controlnet_down_blocks) and one after the
middle block (controlnet_mid_block) give the residuals the UNet adds (unet.Model's down_block_additional_residuals /
mid_block_additional_residual), each times the conditioning scale. As in unet.py everything runs channels-last; the
residuals are returned channels-last (the UNet's own layout), the inputs are NCHW like diffusers'.

Covered: the down / mid block types unet.py covers, SDXL's "text_time" conditioning, rgb or bgr control images;
diffusers folders and the original single files (ldm names; see the end of this file). Refused:
global_pool_conditions (the shuffle ControlNets' guess mode), and what unet.py refuses.
"""

import math
import re
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from ..config_checks import between
from ..errors import MlxdiffError
from ..formats.keymaps import remap, required_shape, under_prefix_if_present
from . import unet
from .unet import (ModelArgs as UNetArgs, UNetMidBlock2DCrossAttn, add_embeddings, attention_of, down_blocks,
                   embed_time)
from .vae import Conv2d

CLASS_NAMES = ("ControlNetModel",)   # diffusers' class: its key in models/registry.ARCHITECTURES


@dataclass
class ModelArgs(UNetArgs):
    # defaults: diffusers' ControlNetModel (SD 1.5's ControlNets' config.json has these)
    cross_attention_dim: int | tuple[int, ...] = 1280
    conditioning_channels: int = 3
    controlnet_conditioning_channel_order: str = "rgb"
    conditioning_embedding_out_channels: tuple[int, ...] = (16, 32, 96, 256)
    global_pool_conditions: bool = False

    WHAT = "ControlNet config"
    LIMITS = {"conditioning_channels": between(1, 16),
              "conditioning_embedding_out_channels": between(1, 1 << 16, items=(1, 8))}

    def __post_init__(self):
        # a ControlNet has no up path: unet.ModelArgs checks one up block per level, so the mirror of the down path
        self.up_block_types = tuple("CrossAttnUpBlock2D" if kind == "CrossAttnDownBlock2D" else "UpBlock2D"
                                    for kind in reversed(self.down_block_types))
        super().__post_init__()
        if self.controlnet_conditioning_channel_order not in ("rgb", "bgr"):
            raise MlxdiffError(f"{self.WHAT}: controlnet_conditioning_channel_order is "
                               f"{self.controlnet_conditioning_channel_order!r}; expected \"rgb\" or \"bgr\"")
        if self.global_pool_conditions:
            raise MlxdiffError(f"{self.WHAT}: global_pool_conditions is true (a shuffle-style ControlNet, run in "
                               "diffusers' guess mode); not supported")


class ControlNetConditioningEmbedding(nn.Module):
    """conv_in -> (3x3 conv, 3x3 stride-2 conv) per width step, each followed by silu -> conv_out: the control
    image (B, H, W, C) at the latents' size (the VAE's factor is the number of stride-2 convs)."""

    def __init__(self, embedding_channels, conditioning_channels, widths):
        super().__init__()
        self.conv_in = Conv2d(conditioning_channels, widths[0], 3, padding=1)
        self.blocks = []
        for w_in, w_out in zip(widths[:-1], widths[1:]):
            self.blocks.append(Conv2d(w_in, w_in, 3, padding=1))
            self.blocks.append(Conv2d(w_in, w_out, 3, padding=1, stride=2))
        self.conv_out = Conv2d(widths[-1], embedding_channels, 3, padding=1)

    def __call__(self, x):
        x = nn.silu(self.conv_in(x))
        for block in self.blocks:
            x = nn.silu(block(x))
        return self.conv_out(x)


class Model(nn.Module):
    """ControlNetModel. `sample` (B, C, H, W) NCHW as the UNet's; `controlnet_cond` (B, 3, 8H, 8W) NCHW in [0, 1];
    returns ([down residuals], mid residual), channels-last, times `conditioning_scale`."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = a = args
        boc, n = a.block_out_channels, len(a.block_out_channels)
        self.conv_in = Conv2d(a.in_channels, boc[0], 3, padding=1)
        add_embeddings(self, a)
        self.controlnet_cond_embedding = ControlNetConditioningEmbedding(
            boc[0], a.conditioning_channels, a.conditioning_embedding_out_channels)
        self.down_blocks = down_blocks(a)
        # one 1x1 conv per skip the UNet keeps: conv_in's, each resnet's, each downsampler's
        widths = [boc[0]]
        for i in range(n):
            widths += [boc[i]] * a.layers[i] + ([boc[i]] if i < n - 1 else [])
        self.controlnet_down_blocks = [nn.Conv2d(w, w, 1) for w in widths]
        self.mid_block = UNetMidBlock2DCrossAttn(boc[-1], boc[0] * 4, a.norm_num_groups, a.norm_eps,
                                                 attention_of(a, n - 1))
        self.controlnet_mid_block = nn.Conv2d(boc[-1], boc[-1], 1)

    def __call__(self, sample, timestep, encoder_hidden_states, controlnet_cond, conditioning_scale=1.0,
                 added_cond_kwargs=None, after_block=None):
        a = self.args
        after_block = after_block or (lambda *outputs: None)
        dtype = sample.dtype
        emb = embed_time(self, a, timestep, sample, added_cond_kwargs)
        context = encoder_hidden_states.astype(dtype)
        cond = controlnet_cond.astype(dtype).transpose(0, 2, 3, 1)
        if a.controlnet_conditioning_channel_order == "bgr":
            cond = cond[..., ::-1]
        x = self.conv_in(sample.transpose(0, 2, 3, 1)) + self.controlnet_cond_embedding(cond)
        skips = [x]
        for block in self.down_blocks:
            x, out = block(x, emb, context)
            skips.extend(out)
            after_block(*out)
        x = self.mid_block(x, emb, context)
        after_block(x)
        down = [conv(s) * conditioning_scale for conv, s in zip(self.controlnet_down_blocks, skips)]
        return down, self.controlnet_mid_block(x) * conditioning_scale

    def quant_predicate(self, path, module) -> bool:
        """As the UNet's: conv_in and the control image's small conv stack stay in full precision."""
        return path != "conv_in" and not path.startswith("controlnet_cond_embedding")

    def sanitize(self, weights: dict) -> dict:
        """diffusers names and PyTorch layouts -> this module: every 4-D (conv) weight OIHW -> OHWI."""
        return {k: (v.transpose(0, 2, 3, 1) if k.endswith(".weight") and len(v.shape) == 4
                    and isinstance(v, mx.array) else v)
                for k, v in weights.items()}


# -- original single files (lllyasviel's control_v11p_sd15_canny.pth as the safetensors people share: the ldm
# ControlNet's names, `control_model.` or none) -------------------------------------------------------------------
# Read as diffusers' convert_controlnet_checkpoint reads them: the encoder copy under the UNet's ldm names
# (unet.original_keymap), zero_convs.N.0 -> controlnet_down_blocks.N, middle_block_out.0 -> controlnet_mid_block and
# the hint convs input_hint_block.{0, 2, ..., 2k} (each followed by a SiLU) -> the conditioning embedding.

ORIGINAL_PREFIX = "control_model."
# what shapes cannot give: the heads, which a ControlNet shares with the UNet it copies (the pipeline's UNet config)
FROM_BASE_CONFIG = ("attention_head_dim", "num_attention_heads", "norm_num_groups")
_HINT = re.compile(r"input_hint_block\.(\d+)\.weight")


def is_original(names) -> bool:
    """Whether tensor names are the ldm ControlNet's (with or without `control_model.`), not diffusers'."""
    return any(n.removeprefix(ORIGINAL_PREFIX).startswith(("input_hint_block.", "zero_convs.")) for n in names)


def _hints(weights) -> list:
    hints = sorted(int(m.group(1)) for k in weights if (m := _HINT.fullmatch(k)))
    if len(hints) < 2 or hints != list(range(0, 2 * len(hints), 2)):
        raise MlxdiffError(f"not a complete ControlNet original checkpoint: input_hint_block convs {hints[:4]}... are "
                           "not 0, 2, 4, ...; re-download the file")
    return hints


def original_to_diffusers(weights: dict) -> dict:
    """ldm ControlNet names -> diffusers names (lazy; nothing is read)."""
    weights = under_prefix_if_present(weights, ORIGINAL_PREFIX)
    levels, layers = unet._layout(weights, up=False)
    hints = _hints(weights)
    rules = unet.original_keymap(layers, levels) + [
        (rf"zero_convs\.(\d+)\.0{unet.SUFFIX}", r"controlnet_down_blocks.\1.\g<p>"),
        (rf"middle_block_out\.0{unet.SUFFIX}", r"controlnet_mid_block.\g<p>"),
        (rf"input_hint_block\.0{unet.SUFFIX}", r"controlnet_cond_embedding.conv_in.\g<p>"),
        (rf"input_hint_block\.{hints[-1]}{unet.SUFFIX}", r"controlnet_cond_embedding.conv_out.\g<p>")]
    rules += [(rf"input_hint_block\.{n}{unet.SUFFIX}", rf"controlnet_cond_embedding.blocks.{k}.\g<p>")
              for k, n in enumerate(hints[1:-1])]
    return remap(weights, rules)


def config_from_original(weights: dict) -> dict:
    """The diffusers ControlNetModel config of an ldm-named ControlNet, read off its names and shapes as
    unet.config_from_original reads a UNet's (widths, levels, layers, cross-attention, projections, SDXL's
    label_emb), plus the hint convs: conditioning_channels from the first, the conditioning widths from every second
    one (each stride-2 conv's output). The heads and norm groups come from the UNet's config (FROM_BASE_CONFIG);
    alone, SD 1.x's 8 heads per level or 64-wide heads for linear projections, and 32 groups, as for a UNet."""
    weights = under_prefix_if_present(weights, ORIGINAL_PREFIX)
    levels, layers = unet._layout(weights, up=False)

    def shape(key, ndim=None):
        return required_shape(weights, key, "ControlNet", ndim)

    first = [1 + level * (layers + 1) for level in range(levels)]
    widths = [shape(f"input_blocks.{n}.0.in_layers.2.weight", 4)[0] for n in first]
    depths = [unet._depth(weights, f"input_blocks.{n}.1") for n in first]
    if not any(depths):
        raise MlxdiffError("not a ControlNet original checkpoint: no SpatialTransformer (input_blocks.N.1.*) found")
    depth_per_level = [d or 1 for d in depths]
    block = f"input_blocks.{first[[d > 0 for d in depths].index(True)]}.1"
    linear = len(shape(f"{block}.proj_in.weight")) == 2
    hints = _hints(weights)
    config = {
        "in_channels": shape("input_blocks.0.0.weight", 4)[1],
        "block_out_channels": widths,
        "layers_per_block": layers,
        "down_block_types": ["CrossAttnDownBlock2D" if d else "DownBlock2D" for d in depths],
        "cross_attention_dim": shape(f"{block}.transformer_blocks.0.attn2.to_k.weight", 2)[1],
        "attention_head_dim": [w // 64 for w in widths] if linear else 8,
        "use_linear_projection": linear,
        "transformer_layers_per_block": depth_per_level if len(set(depth_per_level)) > 1 else depth_per_level[0],
        "norm_num_groups": 32 if not any(w % 32 for w in widths) else math.gcd(*widths),   # the UNet's, given one
        "conditioning_channels": shape("input_hint_block.0.weight", 4)[1],
        "conditioning_embedding_out_channels": [shape(f"input_hint_block.{n}.weight", 4)[0] for n in hints[:-1:2]],
    }
    if "label_emb.0.0.weight" in weights:
        config.update(addition_embed_type="text_time", addition_time_embed_dim=256,
                      projection_class_embeddings_input_dim=shape("label_emb.0.0.weight", 2)[1])
    return config
