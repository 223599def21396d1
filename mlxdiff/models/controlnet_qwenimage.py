"""QwenImageControlNetModel (Qwen-Image): diffusers/models/controlnets/controlnet_qwenimage.py, re-implemented in MLX
on models/qwenimage.py's blocks (InstantX's Qwen-Image-ControlNet-Union and its Inpainting ControlNet).

The packed noise tokens are embedded (img_in) and the control tokens added through a zero-initialised linear
(controlnet_x_embedder): the control image's packed VAE latents, with `extra_condition_channels` more (the
Inpainting ControlNet's mask channels). The text runs through txt_norm and txt_in, and `num_layers` of the
transformer's dual-stream blocks run as there (the same RoPE, timestep embedding and key mask); one linear per block
(controlnet_blocks) turns each block's image stream into a residual, times the conditioning scale. The transformer
adds residual i // ceil(N_T / N_C) after its block i (qwenimage.Model's controlnet_block_samples). The Union
ControlNet has no mode input: the control image alone says what it is. QwenImageMultiControlNetModel runs one
ControlNet over several control images and sums their residuals, which the pipeline does (pipelines/controls.py).
"""

from dataclasses import dataclass

import numpy as np

import mlx.core as mx
import mlx.nn as nn

from ..config_checks import MAX_WIDTH, between
from ..errors import MlxdiffError
from . import qwenimage
from .fused import double_stream

CLASS_NAMES = ("QwenImageControlNetModel",)   # diffusers' class: its key in models/registry.ARCHITECTURES


@dataclass
class ModelArgs(qwenimage.ModelArgs):
    # defaults: diffusers' QwenImageControlNetModel (InstantX/Qwen-Image-ControlNet-Union's num_layers is 5)
    extra_condition_channels: int = 0         # the Inpainting ControlNet's: the control tokens' extra channels

    WHAT = "Qwen-Image ControlNet config"
    LIMITS = {**qwenimage.ModelArgs.LIMITS, "extra_condition_channels": between(0, MAX_WIDTH)}


class Model(nn.Module):
    """QwenImageControlNetModel. __call__(hidden_states (B, N, C) packed noise, controlnet_cond (B, N, C + extra)
    packed control latents, conditioning_scale, encoder_hidden_states (B, L, J), encoder_hidden_states_mask (B, L)
    of 0 / 1 or None, timestep (B,) sigma, img_shapes as qwenimage.Model's) -> [residual (B, N, D) per block], times
    the scale (None for no blocks, as diffusers')."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = a = args
        self.compute_dtype = mx.float32
        dim = a.width
        self.time_text_embed = qwenimage.TimestepProjEmbeddings(dim)
        self.txt_norm = nn.RMSNorm(a.joint_attention_dim, eps=qwenimage.EPS)
        self.img_in = nn.Linear(a.in_channels, dim)
        self.txt_in = nn.Linear(a.joint_attention_dim, dim)
        self.transformer_blocks = [qwenimage.TransformerBlock(dim, a.num_attention_heads, a.attention_head_dim)
                                   for _ in range(a.num_layers)]
        self.controlnet_blocks = [nn.Linear(dim, dim) for _ in range(a.num_layers)]
        self.controlnet_x_embedder = nn.Linear(a.in_channels + a.extra_condition_channels, dim)

    rope = qwenimage.Model.rope       # the transformer's RoPE tables, cached the same way

    def __call__(self, hidden_states, controlnet_cond, conditioning_scale=1.0, encoder_hidden_states=None,
                 encoder_hidden_states_mask=None, timestep=None, img_shapes=None, after_block=None):
        a, dtype = self.args, self.compute_dtype
        b, n_img = hidden_states.shape[:2]
        n_txt = encoder_hidden_states.shape[1]
        want = a.in_channels + a.extra_condition_channels
        if controlnet_cond.shape[-1] != want or tuple(controlnet_cond.shape[:2]) != (b, n_img):
            raise MlxdiffError(f"Qwen-Image ControlNet: controlnet_cond has shape {tuple(controlnet_cond.shape)}, "
                               f"expected ({b}, {n_img}, {want}) (the packed control latents of the noise's tokens)")
        cos, sin = self.rope(img_shapes, n_txt)
        if cos.shape[0] != n_txt + n_img:
            raise MlxdiffError(f"img_shapes {list(qwenimage.image_shapes(img_shapes))} cover {cos.shape[0] - n_txt} "
                               f"image tokens but hidden_states has {n_img}")
        mask = qwenimage.key_mask(encoder_hidden_states_mask, b, n_txt, n_img)
        x = self.img_in(hidden_states.astype(dtype)) + self.controlnet_x_embedder(controlnet_cond.astype(dtype))
        timestep = timestep if isinstance(timestep, mx.array) else mx.array(np.asarray(timestep, np.float32))
        temb = self.time_text_embed(timestep.reshape(-1).astype(dtype))
        context = self.txt_in(self.txt_norm(encoder_hidden_states.astype(dtype)))
        samples = []

        def keep(context, x):
            samples.append(x)
            if after_block:
                after_block(context, x)
        double_stream(self.transformer_blocks, x, context, lambda i: (temb, cos, sin, mask), keep)
        residuals = [block(s) * conditioning_scale for block, s in zip(self.controlnet_blocks, samples)]
        return residuals or None

    def quant_predicate(self, path, module) -> bool:
        """As the transformer's, and the control input's layer stays in full precision."""
        return not (qwenimage.FULL_PRECISION.fullmatch(path) or path.startswith("controlnet_x_embedder"))

    def sanitize(self, weights: dict) -> dict:
        """diffusers names and layouts are this module's own (no convolutions): nothing to change."""
        return dict(weights)
