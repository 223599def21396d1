"""FluxControlNetModel (FLUX.1): diffusers/models/controlnets/controlnet_flux.py, re-implemented in MLX on
models/flux1.py's blocks.

The packed noise tokens are embedded (x_embedder) and the control tokens added through a zero-initialised linear
(controlnet_x_embedder): the control image's packed VAE latents (InstantX's and Shakker's ControlNets), or, with
`conditioning_embedding_channels` (XLabs' layout), its pixels through a small conv stack (input_hint_block, the
SD ControlNets' conditioning embedding with widths 16) folded into patch_size x patch_size tokens. A Union
ControlNet (`num_mode`) puts its mode's embedding before the text tokens (position ids: the first text token's).
`num_layers` double and `num_single_layers` single blocks run as FLUX.1's, and one linear per block
(controlnet_blocks, controlnet_single_blocks) turns each block's image stream into a residual, times the
conditioning scale; the transformer adds them after its blocks (flux1.Model's controlnet_block_samples /
controlnet_single_block_samples: sample i // ceil(N_T / N_C), or, for XLabs', i % N_C over its double blocks).
"""

from dataclasses import dataclass

import numpy as np

import mlx.core as mx
import mlx.nn as nn

from ..config_checks import between
from ..errors import MlxdiffError
from . import flux1
from .controlnet import ControlNetConditioningEmbedding
from .fused import compiled_block, double_stream

HINT_WIDTHS = (16, 16, 16, 16)      # FluxControlNetModel's input_hint_block: fixed in diffusers


@dataclass
class ModelArgs(flux1.ModelArgs):
    # defaults: diffusers' FluxControlNetModel (its guidance_embeds False, as the class's)
    num_mode: int | None = None
    conditioning_embedding_channels: int | None = None

    WHAT = "FLUX.1 ControlNet config"
    LIMITS = {**flux1.ModelArgs.LIMITS, "num_mode": between(1, 1 << 16),
              "conditioning_embedding_channels": between(1, 1 << 12)}


def fold_patches(x, p):
    """(B, H, W, C) channels-last -> (B, (H/p) * (W/p), C * p * p) tokens, channels before the patch offsets (the
    order diffusers' reshape + permute(0, 2, 4, 1, 3, 5) gives)."""
    b, h, w, c = x.shape
    x = x.reshape(b, h // p, p, w // p, p, c).transpose(0, 1, 3, 5, 2, 4)
    return x.reshape(b, (h // p) * (w // p), c * p * p)


class Model(nn.Module):
    """FluxControlNetModel. __call__(hidden_states (B, N, C) packed noise, controlnet_cond (B, N, C) packed control
    latents, or (B, 3, H, W) pixels with an input_hint_block, conditioning_scale, encoder_hidden_states,
    pooled_projections, timestep (sigma), img_ids, txt_ids, guidance, controlnet_mode (B,) ints for a Union
    ControlNet) -> ([double-block residuals], [single-block residuals]) of (B, N, D), times the scale; an empty side
    is None, as diffusers'."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = a = args
        self.compute_dtype = mx.float32
        dim, heads, head_dim = a.width, a.num_attention_heads, a.attention_head_dim
        self.time_text_embed = flux1.TimeTextEmbeddings(dim, a.pooled_projection_dim, a.guidance_embeds)
        self.context_embedder = nn.Linear(a.joint_attention_dim, dim)
        self.x_embedder = nn.Linear(a.in_channels, dim)
        self.transformer_blocks = [flux1.TransformerBlock(dim, heads, head_dim) for _ in range(a.num_layers)]
        self.single_transformer_blocks = [flux1.SingleTransformerBlock(dim, heads, head_dim)
                                          for _ in range(a.num_single_layers)]
        self.controlnet_blocks = [nn.Linear(dim, dim) for _ in range(a.num_layers)]
        self.controlnet_single_blocks = [nn.Linear(dim, dim) for _ in range(a.num_single_layers)]
        if a.num_mode is not None:
            self.controlnet_mode_embedder = nn.Embedding(a.num_mode, dim)
        if a.conditioning_embedding_channels is not None:
            self.input_hint_block = ControlNetConditioningEmbedding(a.conditioning_embedding_channels, 3, HINT_WIDTHS)
        self.controlnet_x_embedder = nn.Linear(a.in_channels, dim)

    @property
    def union(self) -> bool:
        return self.args.num_mode is not None

    @property
    def hint(self) -> bool:
        """XLabs' layout: the control image as pixels (through input_hint_block), its residuals repeated."""
        return self.args.conditioning_embedding_channels is not None

    def rope(self, img_ids, txt_ids):
        return flux1.cached_rope(self, img_ids, txt_ids, self.args.axes_dims_rope, flux1.ROPE_THETA)

    def __call__(self, hidden_states, controlnet_cond, conditioning_scale=1.0, encoder_hidden_states=None,
                 pooled_projections=None, timestep=None, img_ids=None, txt_ids=None, guidance=None,
                 controlnet_mode=None, after_block=None):
        a, dtype = self.args, self.compute_dtype
        x = self.x_embedder(hidden_states.astype(dtype))
        cond = controlnet_cond.astype(dtype)
        if self.hint:
            cond = fold_patches(self.input_hint_block(cond.transpose(0, 2, 3, 1)), a.patch_size)
        x = x + self.controlnet_x_embedder(cond)
        use_guidance = guidance is not None and a.guidance_embeds
        temb = self.time_text_embed(flux1.scaled_time(timestep, dtype),
                                    flux1.scaled_time(guidance, dtype) if use_guidance else None,
                                    pooled_projections.astype(dtype))
        context = self.context_embedder(encoder_hidden_states.astype(dtype))
        txt_ids = np.asarray(txt_ids)
        txt_ids = txt_ids[0] if txt_ids.ndim == 3 else txt_ids
        if self.union:
            if controlnet_mode is None:
                raise MlxdiffError("FLUX.1 ControlNet: a Union ControlNet (num_mode in its config) needs the control "
                                   "mode of its image (control_modes=)")
            mode = self.controlnet_mode_embedder(mx.array(controlnet_mode).reshape(-1, 1)).astype(context.dtype)
            context = mx.concatenate([mx.broadcast_to(mode, (context.shape[0], 1, mode.shape[-1])), context], axis=1)
            txt_ids = np.concatenate([txt_ids[:1], txt_ids])
        cos, sin = self.rope(img_ids, txt_ids)
        n_txt = context.shape[1]
        samples = []

        def keep(context, x):
            samples.append(x)
            if after_block:
                after_block(context, x)
        context, x, _, _ = double_stream(self.transformer_blocks, x, context, lambda i: (temb, cos, sin), keep)
        single = []
        h = mx.concatenate([context, x], axis=1)
        for block in self.single_transformer_blocks:
            h = compiled_block(block, h, temb, cos, sin)
            if after_block:
                after_block(h)
            single.append(h[:, n_txt:])
        double = [block(s) * conditioning_scale for block, s in zip(self.controlnet_blocks, samples)]
        single = [block(s) * conditioning_scale for block, s in zip(self.controlnet_single_blocks, single)]
        return double or None, single or None

    def quant_predicate(self, path, module) -> bool:
        """As the transformer's, and the control input's layers stay in full precision."""
        return not (flux1.FULL_PRECISION.fullmatch(path) or path.startswith(
            ("controlnet_x_embedder", "controlnet_mode_embedder", "input_hint_block")))

    def sanitize(self, weights: dict) -> dict:
        """diffusers names and PyTorch layouts -> this module: input_hint_block's convs OIHW -> OHWI, its
        blocks.N (diffusers' ModuleList) as they are."""
        return {k: (v.transpose(0, 2, 3, 1) if k.startswith("input_hint_block.") and k.endswith(".weight")
                    and len(v.shape) == 4 and isinstance(v, mx.array) else v)
                for k, v in weights.items()}

