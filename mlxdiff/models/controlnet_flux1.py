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

Its files without config.json (`file_layout`, `config_from_file`): diffusers-named ones (InstantX's, Shakker-Labs')
and XLabs' x-flux files, whose names `xlabs_to_diffusers` maps (BFL's for the FLUX.1 parts).
"""

import re
from dataclasses import dataclass

import numpy as np

import mlx.core as mx
import mlx.nn as nn

from ..config_checks import between
from ..errors import MlxdiffError
from ..formats.keymaps import compile_rules, remap, required_shape
from . import flux1
from .controlnet import ControlNetConditioningEmbedding
from .flux2 import check_fused_rows
from .fused import compiled_block, double_stream

HINT_WIDTHS = (16, 16, 16, 16)      # FluxControlNetModel's input_hint_block: fixed in diffusers
# a Union ControlNet's (num_mode) modes by name, as InstantX's FLUX.1-dev-Controlnet-Union card (and Shakker-Labs'
# Union-Pro) number them (--control-mode NAME; a later name for the same number is an alias)
UNION_MODES = {"canny": 0, "tile": 1, "depth": 2, "blur": 3, "pose": 4, "gray": 5, "lq": 6, "low-quality": 6}

CLASS_NAMES = ("FluxControlNetModel",)   # diffusers' class: its key in models/registry.ARCHITECTURES


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



# -- single files without config.json -------------------------------------------------------------------------------
# InstantX's / Shakker-Labs' diffusion_pytorch_model.safetensors (diffusers names) and XLabs' x-flux files (BFL's
# names for the FLUX.1 parts, plus x-flux's own: controlnet_blocks.N, pos_embed_input, input_hint_block.N), told apart
# as ComfyUI's loader tells them (comfy/controlnet.py load_controlnet_state_dict).
_BLOCK = re.compile(r"transformer_blocks\.(\d+)\.")
_SINGLE = re.compile(r"single_transformer_blocks\.(\d+)\.")
# x-flux's input_hint_block is one nn.Sequential: its convs at the even indices 0..14 (SiLUs between), which are
# diffusers' conv_in, blocks.0..5 and conv_out (the same 8 convs, strides and widths)
_XLABS_RULES = compile_rules([
    (r"input_hint_block\.0\.(weight|bias)", r"input_hint_block.conv_in.\1"),
    *[(rf"input_hint_block\.{2 * (k + 1)}\.(weight|bias)", rf"input_hint_block.blocks.{k}.\1") for k in range(6)],
    (r"input_hint_block\.14\.(weight|bias)", r"input_hint_block.conv_out.\1"),
    (r"pos_embed_input\.(weight|bias)", r"controlnet_x_embedder.\1"),
])
XLABS_HINT_CONVS = tuple(range(0, 16, 2))


def file_layout(names) -> str | None:
    """A ControlNet file's naming: diffusers (FluxControlNetModel's own), xlabs (x-flux's ControlNetFlux), mistoline
    (TheMisto.ai's MistoLine, not read), or None: another model's file."""
    names = set(names)
    if "controlnet_blocks.0.linear.weight" in names:
        return "mistoline"
    if "controlnet_blocks.0.weight" not in names:
        return None
    if any(n.startswith("double_blocks.") and n.endswith(".img_attn.norm.key_norm.scale") for n in names):
        return "xlabs"
    if "controlnet_x_embedder.weight" in names and "pos_embed_input.proj.weight" not in names:   # not SD3's
        return "diffusers"
    return None


def _count(names, pattern, what) -> int:
    indices = sorted({int(m.group(1)) for n in names if (m := pattern.match(n))})
    if indices != list(range(len(indices))):
        raise MlxdiffError(f"FLUX.1 ControlNet file: its {what} indices are not 0..n-1 ({indices[:8]}...); the file "
                           "is incomplete, re-download it")
    return len(indices)


def _hint_config(shapes, in_channels, conv) -> dict:
    """An input_hint_block's config: its output channels, the patch size they fold into in_channels."""
    out = required_shape(shapes, conv, "FLUX.1 ControlNet", 4)[0]
    patch = round((in_channels / out) ** 0.5)
    if out * patch * patch != in_channels:
        raise MlxdiffError(f"FLUX.1 ControlNet file: its input_hint_block gives {out} channels, which fold into no "
                           f"square patch of its {in_channels} input channels; the file is not one mlxdiff reads")
    return {"conditioning_embedding_channels": out, "patch_size": patch}


def config_from_file(shapes: dict, layout: str, axes_dims_rope=None) -> dict:
    """FluxControlNetModel's config off a ControlNet file's tensor shapes: the width and in_channels from
    x_embedder (img_in), the prompt and pooled widths, guidance_embeds (its guidance embedder present), the block
    counts from their indices, head_dim from the QK norm, num_mode from controlnet_mode_embedder, the hint block's
    channels and patch size (XLabs' layout). The one value no shape holds, axes_dims_rope (only its sum, head_dim,
    is in the weights), is the model's transformer's (`axes_dims_rope`) where it sums to head_dim, else BFL's split
    (16, 56, 56 for 128)."""
    what = "FLUX.1 ControlNet"
    if layout == "xlabs":
        names = dict(x="img_in.weight", context="txt_in.weight", pooled="vector_in.in_layer.weight",
                     guidance="guidance_in.in_layer.weight", norm="double_blocks.0.img_attn.norm.query_norm.scale",
                     control="pos_embed_input.weight", hint="input_hint_block.14.weight")
        num_layers = _count(shapes, re.compile(r"double_blocks\.(\d+)\."), "double_blocks")
        num_single = _count(shapes, re.compile(r"single_blocks\.(\d+)\."), "single_blocks")
        if num_single:
            raise MlxdiffError("FLUX.1 ControlNet file: an XLabs ControlNet with single_blocks, which x-flux's "
                               "ControlNetFlux has none of; the file is not one mlxdiff reads")
        for k in XLABS_HINT_CONVS:
            required_shape(shapes, f"input_hint_block.{k}.weight", what, 4)
    else:
        names = dict(x="x_embedder.weight", context="context_embedder.weight",
                     pooled="time_text_embed.text_embedder.linear_1.weight",
                     guidance="time_text_embed.guidance_embedder.linear_1.weight",
                     norm="transformer_blocks.0.attn.norm_q.weight", control="controlnet_x_embedder.weight",
                     hint="input_hint_block.conv_out.weight")
        num_layers = _count(shapes, _BLOCK, "transformer_blocks")
        num_single = _count(shapes, _SINGLE, "single_transformer_blocks")
        if not num_layers:
            names["norm"] = "single_transformer_blocks.0.attn.norm_q.weight"
    dim, in_channels = required_shape(shapes, names["x"], what, 2)
    if not (num_layers or num_single):
        raise MlxdiffError("FLUX.1 ControlNet file: no transformer blocks; the file is incomplete, re-download it")
    head_dim = required_shape(shapes, names["norm"], what, 1)[0]
    if dim % head_dim:
        raise MlxdiffError(f"FLUX.1 ControlNet file: its width {dim} and QK-norm length {head_dim} give no whole "
                           "number of heads; the file is not one mlxdiff reads")
    control = required_shape(shapes, names["control"], what, 2)
    if tuple(control) != (dim, in_channels):
        raise MlxdiffError(f"FLUX.1 ControlNet file: {names['control']} has shape {list(control)}, expected "
                           f"{[dim, in_channels]} (the width and the packed channels x_embedder takes)")
    axes = list(axes_dims_rope or ())
    if sum(axes) != head_dim:       # the model's split fits other heads only: BFL's (16, 56, 56 for 128)
        first = head_dim // 8
        axes = [first, (head_dim - first) // 2, (head_dim - first) // 2]
        if sum(axes) != head_dim or any(a % 2 for a in axes):
            raise MlxdiffError(f"FLUX.1 ControlNet file: its heads are {head_dim} wide, which neither the model's "
                               f"RoPE axes {list(axes_dims_rope or ())} nor FLUX.1's split fit, and no tensor holds "
                               "its own; give its diffusers folder (with config.json)")
    config = {"_class_name": "FluxControlNetModel", "patch_size": 1, "in_channels": in_channels,
              "num_layers": num_layers, "num_single_layers": num_single, "attention_head_dim": head_dim,
              "num_attention_heads": dim // head_dim,
              "joint_attention_dim": required_shape(shapes, names["context"], what, 2)[1],
              "pooled_projection_dim": required_shape(shapes, names["pooled"], what, 2)[1],
              "guidance_embeds": names["guidance"] in shapes,
              "axes_dims_rope": axes,
              "num_mode": None, "conditioning_embedding_channels": None}
    if "controlnet_mode_embedder.weight" in shapes:
        config["num_mode"] = required_shape(shapes, "controlnet_mode_embedder.weight", what, 2)[0]
    if names["hint"] in shapes or layout == "xlabs":
        config.update(_hint_config(shapes, in_channels, names["hint"]))
    if layout == "xlabs":
        check_fused_rows(shapes, flux1.fused_shapes(dim, num_layers, 0), "FLUX.1 ControlNet")
    return config


def xlabs_to_diffusers(weights: dict) -> dict:
    """x-flux's names -> FluxControlNetModel's (lazy): the FLUX.1 parts by models/flux1.py's BFL key map, the hint
    block's Sequential indices and pos_embed_input by _XLABS_RULES; controlnet_blocks.N are the same."""
    return flux1.original_to_diffusers(remap(weights, _XLABS_RULES))
