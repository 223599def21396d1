"""ZImageControlNetModel (Z-Image-Turbo's Fun ControlNet Union, alibaba-pai): diffusers/models/controlnets/
controlnet_z_image.py, re-implemented in MLX on models/zimage.py's blocks.

The ControlNet shares the transformer's embedders, refiners and pad tokens (diffusers' from_transformer): it is
called with the transformer. The control image's VAE latents (control_in_dim channels: the latents, zero-padded by
the pipeline for the 2.x files' 33) are patchified as the noise is and embedded (control_all_x_embedder), their
padding the transformer's x_pad_token. Then, by `add_control_noise_refiner`:
- null (Union 1.0): control_noise_refiner, plain modulated Z-Image blocks, over the control tokens;
- "control_noise_refiner" (Union 2.1) / "control_layers" (2.0: the control layers reused): those control blocks run
  first beside the embedded image tokens, and their hints (after_proj outputs, times the scale) join the image
  tokens after noise-refiner block control_refiner_layers_places[i], in the ControlNet's own pass only.
Then the control layers run over [control tokens; captions] beside [image tokens; captions]: the first adds
before_proj(c) + the transformer's stream, each block's after_proj output is a hint, times the conditioning scale,
that the transformer adds after its main layer control_layers_places[i] (zimage.Model's controlnet_block_samples).

Files: diffusers folders (config.json + weights), and alibaba-pai's single files (Z-Image-Turbo-Fun-Controlnet-
Union.safetensors, -2.0, -2.1: diffusers' names already, as diffusers' from_single_file reads them), whose config is
read off their shapes with the published layouts' places (`file_config`, diffusers' infer_diffusers_model_type
and its hub configs).
"""

import re
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from ..config_checks import MAX_HEADS, MAX_LAYERS, MAX_WIDTH, CheckedArgs, Rule, between, one_of, positive
from ..errors import MlxdiffError
from . import zimage
from .fused import compiled_block

MODES = ("control_layers", "control_noise_refiner")

CLASS_NAMES = ("ZImageControlNetModel",)   # diffusers' class: its key in models/registry.ARCHITECTURES


@dataclass
class ModelArgs(zimage.BlockWidths, CheckedArgs):
    # defaults: diffusers' ZImageControlNetModel, its places the Union 1.0 file's (the class has none)
    control_layers_places: tuple[int, ...] = (0, 5, 10, 15, 20, 25)
    control_refiner_layers_places: tuple[int, ...] | None = None
    control_in_dim: int = 16
    add_control_noise_refiner: str | None = None
    all_patch_size: tuple[int, ...] = (2,)
    all_f_patch_size: tuple[int, ...] = (1,)
    dim: int = 3840
    n_refiner_layers: int = 2
    n_heads: int = 30
    n_kv_heads: int = 30
    norm_eps: float = 1e-5
    qk_norm: bool = True

    WHAT = "Z-Image ControlNet config"
    LIMITS = {
        "control_layers_places": between(0, MAX_LAYERS - 1, items=(1, MAX_LAYERS)),
        "control_refiner_layers_places": between(0, MAX_LAYERS - 1, items=(0, MAX_LAYERS)),
        "control_in_dim": between(1, MAX_WIDTH),
        "add_control_noise_refiner": one_of(*MODES),
        "all_patch_size": between(1, 16, items=(1, 8)),
        "all_f_patch_size": between(1, 1, items=(1, 8)),
        "dim": between(1, MAX_WIDTH),
        "n_refiner_layers": between(0, MAX_LAYERS),
        "n_heads": between(1, MAX_HEADS),
        "n_kv_heads": between(1, MAX_HEADS),
        "norm_eps": positive(1.0),
    }
    RULES = (
        Rule("control_layers_places", lambda a: a.control_layers_places[0] == 0,
             lambda a: "expected the layer indices to start with 0 (the first control block takes the stream)"),
        Rule("all_f_patch_size", lambda a: len(a.all_f_patch_size) == len(a.all_patch_size),
             lambda a: f"expected one per all_patch_size entry ({len(a.all_patch_size)})"),
        Rule("n_heads", lambda a: a.dim % a.n_heads == 0, lambda a: f"expected a divisor of dim {a.dim}"),
        Rule("control_refiner_layers_places",
             lambda a: a.add_control_noise_refiner is None or len(a.control_refiner_layers_places or ()) <= (
                 len(a.control_layers_places) if a.add_control_noise_refiner == "control_layers"
                 else a.n_refiner_layers),
             lambda a: "expected at most one place per refiner-stage control block"),
    )

    def __post_init__(self):
        for key in ("control_layers_places", "all_patch_size", "all_f_patch_size"):
            setattr(self, key, tuple(getattr(self, key)))
        if self.control_refiner_layers_places is not None:
            self.control_refiner_layers_places = tuple(self.control_refiner_layers_places)


class ControlBlock(zimage.TransformerBlock):
    """ZImageControlTransformerBlock: a modulated Z-Image block on the control stream c; the first (block_id 0)
    starts it as before_proj(c) + x (the transformer's stream); after_proj(c) is the block's hint."""

    def __init__(self, args: ModelArgs, first: bool):
        super().__init__(args, modulation=True)
        if first:
            self.before_proj = nn.Linear(args.dim, args.dim)
        self.after_proj = nn.Linear(args.dim, args.dim)

    def __call__(self, c, x, cos, sin, mask, temb):
        if "before_proj" in self:
            c = self.before_proj(c) + x
        c = super().__call__(c, cos, sin, mask, temb)
        return c, self.after_proj(c)


def run_control(blocks, c, x, rope, mask, temb, after_block=None):
    """Control blocks in order -> (the last c, [each block's hint])."""
    hints = []
    for block in blocks:
        c, hint = compiled_block(block, c, x, *rope, mask, temb)
        hints.append(hint)
        if after_block:
            after_block(c)
    return c, hints


class Model(nn.Module):
    """ZImageControlNetModel. __call__(transformer (zimage.Model), hidden_states (B, C, H, W) latents, timestep (B,)
    1 - sigma, encoder_hidden_states (B, L, cap_feat_dim), controlnet_cond (B or 1, control_in_dim, H, W) the control
    latents, conditioning_scale, text_mask (B, L)) -> {main layer index: hint (B, S, D)}, diffusers' return (its
    list inputs as in zimage.Model)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = a = args
        self.compute_dtype = mx.float32
        self.control_layers = [ControlBlock(a, place == 0) for place in a.control_layers_places]
        self.control_all_x_embedder = {f"{p}-{f}": nn.Linear(f * p * p * a.control_in_dim, a.dim)
                                       for p, f in zip(a.all_patch_size, a.all_f_patch_size)}
        if a.add_control_noise_refiner == "control_noise_refiner":
            self.control_noise_refiner = [ControlBlock(a, i == 0) for i in range(a.n_refiner_layers)]
        elif a.add_control_noise_refiner is None:
            self.control_noise_refiner = [zimage.TransformerBlock(a, modulation=True)
                                          for _ in range(a.n_refiner_layers)]

    def __call__(self, transformer, hidden_states, timestep, encoder_hidden_states, controlnet_cond,
                 conditioning_scale=1.0, text_mask=None, patch_size=None, stream_dtype=None, after_block=None):
        a = self.args
        t = transformer.tokens(hidden_states, timestep, encoder_hidden_states, text_mask, patch_size, stream_dtype)
        b, _, h, w = t.shape
        if t.key not in self.control_all_x_embedder:
            raise MlxdiffError(f"Z-Image ControlNet: patch {t.key} is not one of its "
                               f"{list(self.control_all_x_embedder)}")
        cond = controlnet_cond if isinstance(controlnet_cond, mx.array) else mx.array(controlnet_cond)
        if cond.ndim != 4 or cond.shape[1] != a.control_in_dim or tuple(cond.shape[2:]) != (h, w) \
                or cond.shape[0] not in (1, b):
            raise MlxdiffError(f"controlnet_cond has shape {list(cond.shape)}; expected [{b}, {a.control_in_dim}, "
                               f"{h}, {w}] (the control image's latents, control_in_dim channels)")
        dtype = transformer.compute_dtype
        c = self.control_all_x_embedder[t.key](zimage.patchify(cond, t.patch).astype(dtype))
        c = transformer.pad_image(mx.broadcast_to(c, (b, *c.shape[1:])))
        c = c.astype(t.x.dtype)
        refiner_hints = None
        if a.add_control_noise_refiner is not None:
            blocks = self.control_layers if a.add_control_noise_refiner == "control_layers" \
                else self.control_noise_refiner
            c, hints = run_control(blocks, c, t.x, t.x_rope, None, t.temb, after_block)
            refiner_hints = {place: hints[i] * conditioning_scale
                             for i, place in enumerate(a.control_refiner_layers_places or ())}
        x = transformer.refine_image(t, t.x, refiner_hints, after_block)
        cap = transformer.refine_caption(t, after_block)
        if a.add_control_noise_refiner is None:
            for block in self.control_noise_refiner:
                c = compiled_block(block, c, *t.x_rope, None, t.temb)
                if after_block:
                    after_block(c)
        _, hints = run_control(self.control_layers, mx.concatenate([c, cap], axis=1), mx.concatenate([x, cap], axis=1),
                               t.u_rope, t.u_mask, t.temb, after_block)
        return {place: hint * conditioning_scale for place, hint in zip(a.control_layers_places, hints)}

    def quant_predicate(self, path, module) -> bool:
        """The control embedder and the modulations stay in full precision (as the transformer's)."""
        return not FULL_PRECISION.fullmatch(path)

    def sanitize(self, weights: dict) -> dict:
        """diffusers' names are this module's; a 2.0 file's control_noise_refiner (unused there: its control layers
        refine) dropped, as diffusers' convert_z_image_controlnet_checkpoint_to_diffusers drops it."""
        if self.args.add_control_noise_refiner == "control_layers":
            return {k: v for k, v in weights.items() if not k.startswith("control_noise_refiner.")}
        return dict(weights)


FULL_PRECISION = re.compile(r"(control_all_x_embedder\..*|.*adaLN_modulation\.\d+)")

# -- alibaba-pai's single files (diffusers' names; the config from the shapes) ---------------------------------------

EMBEDDER = "control_all_x_embedder.2-1.weight"       # what marks a Z-Image ControlNet file (diffusers' key)
# the published layouts, by control layer count (diffusers' hub configs for infer_diffusers_model_type's types)
PUBLISHED_PLACES = {6: tuple(range(0, 30, 5)), 15: tuple(range(0, 30, 2))}
REFINER_PLACES = (0, 1)                              # the 2.x files'
_INDEX = {name: re.compile(name + r"\.(\d+)\.") for name in ("control_layers", "control_noise_refiner")}


def is_controlnet_file(names) -> bool:
    return EMBEDDER in set(names)


def _count(shapes, name) -> int:
    indices = sorted({int(m.group(1)) for k in shapes if (m := _INDEX[name].match(k))})
    if indices != list(range(len(indices))):
        raise MlxdiffError(f"Z-Image ControlNet file: {name} indices are not 0..n-1 ({indices[:8]}); the file is "
                           "incomplete")
    return len(indices)


def file_config(shapes: dict, is_zero) -> dict:
    """{name: array or formats.TensorShape} -> a single file's config: dim and control_in_dim from the embedder, the
    head size from the qk norms, the places by its control layer count (6: Union 1.0; 15: 2.0 / 2.1), and the
    refiner stage as diffusers tells 2.0 from 2.1: no or an all-zero control_noise_refiner.0.before_proj
    (`is_zero(name)`) is 2.0's "control_layers"."""
    if EMBEDDER not in shapes:
        raise MlxdiffError(f"not a Z-Image ControlNet file: no {EMBEDDER}")
    dim, patch_in = shapes[EMBEDDER].shape
    if patch_in % 4:
        raise MlxdiffError(f"Z-Image ControlNet file: {EMBEDDER} takes {patch_in} inputs; expected 2 x 2 x the "
                           "control channels")
    count = _count(shapes, "control_layers")
    if count not in PUBLISHED_PLACES:
        raise MlxdiffError(f"Z-Image ControlNet file with {count} control layers: the published files have 6 (Union) "
                           "or 15 (Union 2.0 / 2.1), whose places mlxdiff knows; give a diffusers "
                           "ZImageControlNetModel folder (its config.json says control_layers_places)")
    norm = "control_layers.0.attention.norm_q.weight"
    if norm not in shapes:
        raise MlxdiffError("Z-Image ControlNet file without qk norms: its head count cannot be read from the shapes")
    head_dim = shapes[norm].shape[0]
    if dim % head_dim:
        raise MlxdiffError(f"Z-Image ControlNet file: width {dim} is not a multiple of its head size {head_dim}")
    config = {"control_layers_places": list(PUBLISHED_PLACES[count]), "control_in_dim": patch_in // 4, "dim": dim,
              "n_heads": dim // head_dim, "n_kv_heads": dim // head_dim, "qk_norm": True,
              "n_refiner_layers": _count(shapes, "control_noise_refiner") or 2, "add_control_noise_refiner": None}
    if count == 15:
        before = "control_noise_refiner.0.before_proj.weight"
        mode = "control_layers" if before not in shapes or is_zero(before) else "control_noise_refiner"
        config.update(add_control_noise_refiner=mode, control_refiner_layers_places=list(REFINER_PLACES))
    return config
