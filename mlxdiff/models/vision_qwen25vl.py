"""Qwen2.5-VL's vision tower (transformers' Qwen2_5_VisionTransformerPretrainedModel) and its image processor
(Qwen2VLImageProcessor), for Qwen-Image-Edit's prompt encoding (pipelines/qwenimage/edit.py).

The tower is mlx-vlm's (mlx_vlm/models/qwen2_5_vl/vision.py: the Conv3d patch embed, 2-D RoPE over the patch grid,
windowed attention with full attention at fullatt_block_indexes, the 2x2 patch merger), unchanged. mlx-lm carries
no vision towers; mlx-vlm is the well-kept MLX home of Qwen2.5-VL. Its package __init__ (and qwen2_5_vl's) import its
processors, generate and convert tools and through them transformers (and torch where present), so the files are
loaded as submodules of bare private packages over mlx-vlm's own folders, as models/mlx_lm_models.py does for
mlx-lm: vision.py needs only mlx, numpy and its config / rope_utils / base / cache / turboquant siblings (mlx, numpy,
Pillow). mlx-vlm is an optional dependency (`pip install mlxdiff[edit]`, or `pip install --no-deps mlx-vlm`: none of
its requirements is needed here), imported only when an Edit model builds its tower.

Weights: the text encoder folder's `model.visual.*` (transformers 5.x) or `visual.*` (4.x); every other tensor (the
language model, lm_head) is not read. The Conv3d kernel is transposed from torch's (out, in, t, h, w).

The processor (`preprocess`): Pillow and numpy as Qwen2VLImageProcessorPil does it: smart_resize to multiples of
patch_size * merge_size within [min_pixels, max_pixels], BICUBIC, rescale, normalize (CLIP's mean / std), and the
patches flattened in merge-window order with the frame repeated temporal_patch_size times -> (pixel_values
(N, 3 * t * p * p), grid_thw (1, H/p, W/p) per image)."""

import importlib
import importlib.util
import math
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image

from .. import backend  # noqa: F401  (OpenBLAS preload before mlx)
import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..config_checks import MAX_HEADS, MAX_LAYERS, MAX_WIDTH, CheckedArgs, Rule, between, one_of
from ..errors import MlxdiffError

PACKAGE = __name__ + "._mlx_vlm"     # bare packages over mlx_vlm/, mlx_vlm/models/, mlx_vlm/models/qwen2_5_vl/
STORED_PREFIX = "model.visual."      # transformers 5.x names of the tower in Qwen2_5_VLForConditionalGeneration
PREFIXES = (STORED_PREFIX, "visual.")
# Qwen2VLImageProcessor's defaults (OPENAI_CLIP_MEAN / STD; Qwen/Qwen-Image-Edit's processor/ says the same)
PROCESSOR = dict(min_pixels=56 * 56, max_pixels=28 * 28 * 1280, patch_size=14, temporal_patch_size=2, merge_size=2,
                 image_mean=[0.48145466, 0.4578275, 0.40821073], image_std=[0.26862954, 0.26130258, 0.27577711],
                 rescale_factor=1 / 255, do_resize=True, do_rescale=True, do_normalize=True, do_convert_rgb=True)


def _vision_file(model="qwen2_5_vl", who="Qwen-Image-Edit"):
    """mlx_vlm/models/<model>/vision.py, its package __init__ files not run (module docstring); `who` names the
    pipeline that needs it in the line when mlx-vlm is missing."""
    name = PACKAGE + f".models.{model}.vision"
    if name not in sys.modules:
        spec = importlib.util.find_spec("mlx_vlm")     # finds the installed package; runs none of it
        if spec is None or not spec.submodule_search_locations:
            raise MlxdiffError(f"{who}'s vision tower is mlx-vlm's, which is not installed; pip install "
                               "'mlxdiff[edit]' (or pip install --no-deps mlx-vlm)")
        root = Path(list(spec.submodule_search_locations)[0])
        for package, folder in ((PACKAGE, root), (PACKAGE + ".models", root / "models"),
                                (PACKAGE + f".models.{model}", root / "models" / model)):
            if package not in sys.modules:
                module = types.ModuleType(package)
                module.__path__, module.__package__ = [str(folder)], package
                sys.modules[package] = module
    return importlib.import_module(name)


# What Qwen2.5-VL's and Qwen3-VL's tower configs share (models/vision_qwen3vl.py reads them too)
HEADS_RULE = Rule("num_heads", lambda a: a.hidden_size % a.num_heads == 0 and (a.hidden_size // a.num_heads) % 4 == 0,
                  lambda a: f"must divide hidden_size {a.hidden_size} into heads of a multiple of 4 (the 2-D RoPE)")


@dataclass
class VisionArgs(CheckedArgs):
    """A tower config: from_dict takes the vision_config of a whole model's config.json, or that dict itself."""

    @classmethod
    def from_dict(cls, params, where=None):
        if isinstance(params, dict) and isinstance(params.get("vision_config"), dict):
            params = params["vision_config"]
        return super().from_dict(params, where)


def check_processor(processor: dict, args, where, config_path) -> None:
    """The image processor's patching must be the tower's, or its patches are not the tower's input."""
    if (processor["patch_size"], processor["merge_size"], processor["temporal_patch_size"]) != (
            args.patch_size, args.spatial_merge_size, args.temporal_patch_size):
        raise MlxdiffError(f"{where}: patch_size {processor['patch_size']}, merge_size {processor['merge_size']}, "
                           f"temporal_patch_size {processor['temporal_patch_size']}, but the vision tower "
                           f"({config_path}) takes {args.patch_size}, {args.spatial_merge_size}, "
                           f"{args.temporal_patch_size}; the processor does not belong to this encoder")


@dataclass
class ModelArgs(VisionArgs):
    """The tower's config: the text encoder's config.json `vision_config` (Qwen2_5_VLVisionConfig's names; the
    whole config.json is taken too). Defaults: Qwen2.5-VL-7B's."""
    depth: int = 32
    hidden_size: int = 1280
    hidden_act: str = "silu"
    intermediate_size: int = 3420
    num_heads: int = 16
    in_channels: int = 3
    patch_size: int = 14
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    window_size: int = 112
    out_hidden_size: int = 3584
    fullatt_block_indexes: list[int] = field(default_factory=lambda: [7, 15, 23, 31])

    WHAT = "Qwen2.5-VL vision config"
    LIMITS = {
        "depth": between(1, MAX_LAYERS),
        "hidden_size": between(1, MAX_WIDTH),
        "hidden_act": one_of("silu"),
        "intermediate_size": between(1, MAX_WIDTH),
        "num_heads": between(1, MAX_HEADS),
        "in_channels": one_of(3),
        "patch_size": between(1, 64),
        "spatial_merge_size": one_of(2),     # mlx-vlm's PatchMerger merges 2x2
        "temporal_patch_size": between(1, 8),
        "window_size": between(1, 1 << 14),
        "out_hidden_size": between(1, MAX_WIDTH),
        "fullatt_block_indexes": between(0, MAX_LAYERS, items=(0, MAX_LAYERS)),
    }
    RULES = (
        HEADS_RULE,
        Rule("window_size", lambda a: a.window_size % (a.patch_size * a.spatial_merge_size) == 0,
             lambda a: f"must be a multiple of patch_size * spatial_merge_size ({a.patch_size * a.spatial_merge_size})"),
    )



class Model(nn.Module):
    """mlx-vlm's VisionModel. __call__(pixel_values (N, 3 t p p), grid_thw (images, 3)) -> (N / merge^2,
    out_hidden_size): each image's merged tokens in order, as transformers' get_image_features concatenated."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        vision = _vision_file()
        config = vision.VisionConfig(model_type="qwen2_5_vl", depth=args.depth, hidden_size=args.hidden_size,
                                     intermediate_size=args.intermediate_size, out_hidden_size=args.out_hidden_size,
                                     num_heads=args.num_heads, patch_size=args.patch_size,
                                     spatial_merge_size=args.spatial_merge_size, in_channels=args.in_channels,
                                     temporal_patch_size=args.temporal_patch_size, window_size=args.window_size,
                                     fullatt_block_indexes=list(args.fullatt_block_indexes))
        self.tower = vision.VisionModel(config)

    def sanitize(self, weights: dict) -> dict:
        out = {}
        for name, value in weights.items():
            prefix = next((p for p in PREFIXES if name.startswith(p)), None)
            if prefix is None:
                continue
            key = name[len(prefix):]
            if key == "patch_embed.proj.weight" and value.ndim == 5:
                value = value.transpose(0, 2, 3, 4, 1)      # torch Conv3d (O, I, T, H, W) -> MLX (O, T, H, W, I)
            out["tower." + key] = value
        return out

    def __call__(self, pixel_values, grid_thw):
        grid = mx.array(np.asarray(grid_thw, np.int32))
        return self.tower(pixel_values.astype(self.tower.patch_embed.proj.weight.dtype), grid)


# python -m mlxdiff.convert writes the tower into the text encoder's folder (whose files it is read from), as
# model.visual.* in torch's layouts: what sanitize reads back
WRITTEN_WITH = "text_encoder"


def stored_weights(model) -> dict:
    """The tower's float weights under STORED_PREFIX, the Conv3d kernel back in torch's (O, I, T, H, W)."""
    out = {}
    for name, value in tree_flatten(model.parameters()):
        key = name[len("tower."):]
        out[STORED_PREFIX + key] = value.transpose(0, 4, 1, 2, 3) if key == "patch_embed.proj.weight" else value
    return out


def reads_stored(name: str, args: ModelArgs) -> bool:
    """The tower's tensors among the text encoder folder's (ComponentSpec.nbytes counts only these)."""
    return name.startswith(PREFIXES)


def check_config(config: dict, where) -> None:
    ModelArgs.from_dict(config, where)


def whole_model_config(config: dict) -> dict:
    return {}


# -- the image processor ---------------------------------------------------------------------------------------------

def processor_config(config: dict | None, where="the processor config", defaults=PROCESSOR) -> dict:
    """preprocessor_config.json (Qwen2VLImageProcessor's keys; `size` {shortest_edge, longest_edge} as
    transformers 5.x writes the pixel bounds) over `defaults` (PROCESSOR: Qwen2.5-VL's), checked."""
    out = dict(defaults)
    config = dict(config or {})
    size = config.get("size") if isinstance(config.get("size"), dict) else {}
    for key, ours in (("shortest_edge", "min_pixels"), ("longest_edge", "max_pixels")):
        if size.get(key) is not None:
            out[ours] = size[key]
    out.update({k: config[k] for k in defaults if config.get(k) is not None})
    for key in ("min_pixels", "max_pixels", "patch_size", "temporal_patch_size", "merge_size"):
        value = out[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise MlxdiffError(f"{where}: {key} is {value!r}; expected a positive integer")
    for key in ("image_mean", "image_std"):
        value = out[key]
        if not (isinstance(value, list) and len(value) == 3 and all(isinstance(v, (int, float)) for v in value)):
            raise MlxdiffError(f"{where}: {key} is {value!r}; expected 3 numbers (R, G, B)")
    if any(v <= 0 for v in out["image_std"]) or out["min_pixels"] > out["max_pixels"]:
        raise MlxdiffError(f"{where}: image_std must be positive and min_pixels at most max_pixels")
    return out


def smart_resize(height, width, factor, min_pixels, max_pixels) -> tuple:
    """transformers' qwen2_vl smart_resize: the size, multiples of `factor`, nearest the image's aspect and area
    within [min_pixels, max_pixels]."""
    if max(height, width) / min(height, width) > 200:
        raise MlxdiffError(f"an input image of {width}x{height}: Qwen2.5-VL takes aspect ratios up to 200")
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar, w_bar = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def preprocess(images, config: dict) -> tuple:
    """Qwen2VLImageProcessor on PIL images -> (pixel_values (N, 3 t p p) float32, grid_thw (images, 3) int)."""
    p, t, m = config["patch_size"], config["temporal_patch_size"], config["merge_size"]
    mean = np.array(config["image_mean"], np.float32)[:, None, None]
    std = np.array(config["image_std"], np.float32)[:, None, None]
    patches, grids = [], []
    for image in images:
        if config["do_convert_rgb"]:
            image = image.convert("RGB")
        if config["do_resize"]:
            h, w = smart_resize(image.height, image.width, p * m, config["min_pixels"], config["max_pixels"])
            if (w, h) != image.size:
                image = image.resize((w, h), Image.BICUBIC)
        x = np.asarray(image, np.float32).transpose(2, 0, 1)
        if config["do_rescale"]:
            x = x * np.float32(config["rescale_factor"])
        if config["do_normalize"]:
            x = (x - mean) / std
        c, h, w = x.shape
        gh, gw = h // p, w // p
        x = x.reshape(c, gh // m, m, p, gw // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)   # (gh, gw, mh, mw, C, p, p)
        x = np.broadcast_to(x[:, :, :, :, :, None], (*x.shape[:5], t, p, p))
        patches.append(x.reshape(gh * gw, c * t * p * p))
        grids.append((1, gh, gw))
    return np.concatenate(patches, axis=0).astype(np.float32), np.array(grids, np.int64)


def image_tokens(grid_thw, merge_size) -> list:
    """The <|image_pad|> tokens each image takes in the prompt (Qwen2VLProcessor: t h w / merge^2)."""
    return [int(np.prod(g)) // merge_size ** 2 for g in grid_thw]
