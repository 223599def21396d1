"""SD3ControlNetModel (SD3 / SD3.5): diffusers/models/controlnets/controlnet_sd3.py, re-implemented in MLX on
models/mmdit.py's blocks.

The noisy latents are patch-embedded as the transformer embeds them (its own `pos_embed`, or, for SD3.5's official
ControlNets with `use_pos_embed: false`, the transformer's, passed in), the control image's VAE latents through a
zero-initialised patch conv without a position table (`pos_embed_input`) are added, then `num_layers` joint blocks
(or, with `joint_attention_dim: null`, SD3SingleTransformerBlocks on the image tokens alone) run, and one linear per
block (`controlnet_blocks`) turns each block's image stream into a residual, times the conditioning scale. The
transformer adds residual int(i / (num_layers_T / n)) after its block i (mmdit.Model's block_controlnet_hidden_states).

Covered: InstantX's SD3 ControlNets (joint blocks, zero pooled projections: force_zeros_for_pooled_projection) and
the SD3.5 ControlNets without joint attention, in diffusers folders. Refused by the pipeline: extra conditioning
channels (the inpainting ControlNets' StableDiffusion3ControlNetInpaintingPipeline).
"""

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from ..config_checks import MAX_LAYERS, Rule, between
from ..errors import MlxdiffError
from ..pacing import pace
from . import mmdit
from .embeddings import CombinedTimestepTextProjEmbeddings
from .fused import compiled_block, gated_residual

CLASS_NAMES = ("SD3ControlNetModel",)   # diffusers' class: its key in models/registry.ARCHITECTURES


@dataclass
class ModelArgs(mmdit.ModelArgs):
    # defaults: diffusers' SD3ControlNetModel
    sample_size: int = 128
    num_layers: int = 18
    num_attention_heads: int = 18
    joint_attention_dim: int | None = 4096
    caption_projection_dim: int = 1152
    pos_embed_max_size: int = 96
    dual_attention_layers: tuple[int, ...] | None = ()
    qk_norm: str | None = None
    extra_conditioning_channels: int = 0
    pos_embed_type: str | None = "sincos"
    use_pos_embed: bool = True
    force_zeros_for_pooled_projection: bool = True

    WHAT = "SD3 ControlNet config"
    LIMITS = {**mmdit.ModelArgs.LIMITS, "extra_conditioning_channels": between(0, 64),
              "num_layers": between(1, MAX_LAYERS)}
    # the transformer's rules, the caption width only where there is a context stream (SD3.5's official
    # ControlNets keep caption_projection_dim in their config with joint_attention_dim null)
    RULES = tuple(r for r in mmdit.ModelArgs.RULES if r.key != "caption_projection_dim") + (
        Rule("caption_projection_dim", lambda a: a.joint_attention_dim is None or a.caption_projection_dim == a.width,
             lambda a: f"must equal num_attention_heads * attention_head_dim = {a.width}"),
        Rule("pos_embed_type", lambda a: a.pos_embed_type == "sincos",
             lambda a: 'expected "sincos" (the only position table SD3 ControlNets use)'),)

    @property
    def width(self) -> int:
        return self.num_attention_heads * self.attention_head_dim


class PatchProjection(nn.Module):
    """diffusers' PatchEmbed with pos_embed_type None: the patch conv alone, flattened to tokens."""

    def __init__(self, patch_size: int, in_channels: int, dim: int):
        super().__init__()
        self.proj = nn.Conv2d(in_channels, dim, kernel_size=patch_size, stride=patch_size)

    def __call__(self, x_nhwc):
        x = self.proj(x_nhwc)
        b, h, w, d = x.shape
        return x.reshape(b, h * w, d)


class SingleTransformerBlock(nn.Module):
    """SD3SingleTransformerBlock: adaLN-Zero, self-attention over the image tokens, a GELU feed-forward."""

    def __init__(self, dim: int, heads: int, head_dim: int):
        super().__init__()
        self.norm1 = mmdit.AdaLayerNormZero(dim)
        self.attn = mmdit.Attention(dim, heads, head_dim, None)
        self.ff = mmdit.FeedForward(dim)

    def __call__(self, x, temb):
        img = self.norm1(x, temb)
        x = pace(gated_residual(x, img.msa.gate[:, None], self.attn(img.x_mod)))
        return pace(gated_residual(x, img.mlp.gate[:, None], self.ff(mmdit.modulate(x, img.mlp.scale,
                                                                                    img.mlp.shift))))


class Model(nn.Module):
    """SD3ControlNetModel. `hidden_states` (B, C, H, W) and `controlnet_cond` (B, C + extra, H, W) NCHW as diffusers';
    returns [(B, tokens, D)] one residual per block, times `conditioning_scale`. `pos_embed`: the transformer's patch
    embedding, for a ControlNet without its own (use_pos_embed false)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = a = args
        self.compute_dtype = mx.float32
        dim = a.width
        if a.use_pos_embed:
            self.pos_embed = mmdit.PatchEmbed(a.patch_size, a.in_channels, dim, a.pos_embed_max_size,
                                              base_size=a.sample_size // a.patch_size)
        self.time_text_embed = CombinedTimestepTextProjEmbeddings(dim, a.pooled_projection_dim)
        if a.joint_attention_dim is not None:
            self.context_embedder = nn.Linear(a.joint_attention_dim, a.caption_projection_dim)
            self.transformer_blocks = [
                mmdit.JointTransformerBlock(dim, a.num_attention_heads, a.attention_head_dim, context_pre_only=False,
                                            qk_norm=a.qk_norm, use_dual_attention=i in a.dual_attention_layers)
                for i in range(a.num_layers)]
        else:
            self.transformer_blocks = [SingleTransformerBlock(dim, a.num_attention_heads, a.attention_head_dim)
                                       for _ in range(a.num_layers)]
        self.controlnet_blocks = [nn.Linear(dim, dim) for _ in range(a.num_layers)]
        self.pos_embed_input = PatchProjection(a.patch_size, a.in_channels + a.extra_conditioning_channels, dim)

    def __call__(self, hidden_states, controlnet_cond, conditioning_scale=1.0, encoder_hidden_states=None,
                 pooled_projections=None, timestep=None, pos_embed=None, after_block=None):
        a, dtype = self.args, self.compute_dtype
        embed = self.pos_embed if a.use_pos_embed else pos_embed
        if embed is None:
            raise MlxdiffError("SD3 ControlNet: this ControlNet has no patch embedding of its own (use_pos_embed "
                               "false); it takes the transformer's (pos_embed=)")
        x = embed(hidden_states.astype(dtype).transpose(0, 2, 3, 1))
        temb = self.time_text_embed(mx.array(timestep).astype(mx.float32).reshape(-1), pooled_projections.astype(dtype))
        x = x + self.pos_embed_input(controlnet_cond.astype(dtype).transpose(0, 2, 3, 1))
        context = None
        if a.joint_attention_dim is not None:
            context = self.context_embedder(encoder_hidden_states.astype(dtype))
        residuals = []
        for block in self.transformer_blocks:
            if context is None:
                x = compiled_block(block, x, temb)
            else:
                context, x = compiled_block(block, x, context, temb)
            if after_block:
                after_block(x)
            residuals.append(x)
        return [block(r) * conditioning_scale for block, r in zip(self.controlnet_blocks, residuals)]

    def quant_predicate(self, path, module) -> bool:
        """As the transformer's: the embedders stay in full precision, and the zero-initialised input conv."""
        return not (mmdit.FULL_PRECISION.fullmatch(path) or path.startswith("pos_embed_input"))

    def sanitize(self, weights: dict) -> dict:
        """diffusers names and PyTorch layouts -> this module: the patch convs OIHW -> OHWI."""
        out = dict(weights)
        for key in ("pos_embed.proj.weight", "pos_embed_input.proj.weight"):
            w = out.get(key)
            if w is not None and w.ndim == 4:
                out[key] = w.transpose(0, 2, 3, 1)
        return out
