"""Qwen3-VL's vision tower (transformers' Qwen3VLVisionModel), for Qwen-Image 2.1's condition images
(pipelines/qwenimage21/pipeline.py).

The tower is mlx-vlm's (mlx_vlm/models/qwen3_vl/vision.py: the Conv3d patch embed with its bias, the learned position
table bilinearly interpolated to each image's patch grid (align_corners, as transformers), the 2-D RoPE, full
attention within each image, LayerNorm blocks with a GELU-tanh MLP, the 2x2 merger and the deepstack mergers after
the blocks deepstack_visual_indexes names), loaded without its packages' __init__ files as models/vision_qwen25vl.py
loads Qwen2.5-VL's. It returns the merged features the prompt's <|image_pad|> tokens take and one deepstack feature
set per deepstack index, which the language model adds to those tokens' hidden states after its first layers
(models/text_qwen3vl.py).

Weights: the text encoder folder's `model.visual.*` (transformers 5.x) or `visual.*` (4.x); the Conv3d kernel is
transposed from torch's (out, in, t, h, w). The processor is Qwen2VLImageProcessor's (vision_qwen25vl.preprocess)
with Qwen3-VL's defaults (PROCESSOR)."""

from dataclasses import dataclass, field

from .. import backend  # noqa: F401  (OpenBLAS preload before mlx)
import mlx.nn as nn

from ..config_checks import MAX_HEADS, MAX_LAYERS, MAX_WIDTH, Rule, between, one_of
from . import vision_qwen25vl
from .vision_qwen25vl import PREFIXES, WRITTEN_WITH, stored_weights  # noqa: F401  (convert's, as Qwen2.5-VL's)
from .vision_qwen25vl import check_processor  # noqa: F401  (the folder's processor check, as Qwen2.5-VL's)

# Qwen3-VL's preprocessor_config.json: patches of 16 px merged 2 x 2, mean / std 0.5, 256^2 .. 4096^2 pixels
PROCESSOR = dict(vision_qwen25vl.PROCESSOR, min_pixels=65536, max_pixels=16777216, patch_size=16,
                 image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])


@dataclass
class ModelArgs(vision_qwen25vl.VisionArgs):
    """The tower's config: the text encoder's config.json `vision_config` (Qwen3VLVisionConfig's names; the whole
    config.json is taken too). Defaults: Qwen3-VL-8B's."""
    depth: int = 27
    hidden_size: int = 1152
    hidden_act: str = "gelu_pytorch_tanh"
    intermediate_size: int = 4304
    num_heads: int = 16
    in_channels: int = 3
    patch_size: int = 16
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    out_hidden_size: int = 4096
    num_position_embeddings: int = 2304
    deepstack_visual_indexes: list[int] = field(default_factory=lambda: [8, 16, 24])

    WHAT = "Qwen3-VL vision config"
    LIMITS = {
        "depth": between(1, MAX_LAYERS),
        "hidden_size": between(1, MAX_WIDTH),
        "hidden_act": one_of("gelu_pytorch_tanh"),     # mlx-vlm's MLP: GELU, tanh approximation
        "intermediate_size": between(1, MAX_WIDTH),
        "num_heads": between(1, MAX_HEADS),
        "in_channels": one_of(3),
        "patch_size": between(1, 64),
        "spatial_merge_size": one_of(2),     # mlx-vlm's PatchMerger merges 2x2
        "temporal_patch_size": between(1, 8),
        "out_hidden_size": between(1, MAX_WIDTH),
        "num_position_embeddings": between(1, 1 << 20),
        "deepstack_visual_indexes": between(0, MAX_LAYERS, items=(0, MAX_LAYERS)),
    }
    RULES = (
        vision_qwen25vl.HEADS_RULE,
        Rule("num_position_embeddings", lambda a: round(a.num_position_embeddings ** 0.5) ** 2
             == a.num_position_embeddings,
             lambda a: "must be a square (the position table is a square grid)"),
        Rule("deepstack_visual_indexes", lambda a: all(i < a.depth for i in a.deepstack_visual_indexes),
             lambda a: f"must name blocks below depth {a.depth}"),
    )



class Model(vision_qwen25vl.Model):
    """mlx-vlm's Qwen3-VL VisionModel; sanitize and __call__ are Qwen2.5-VL's (the same stored names and call).
    __call__(pixel_values (N, 3 t p p), grid_thw (images, 3)) -> (features (N / merge^2, out_hidden_size): each
    image's merged tokens in order, [deepstack features, same shape, one per deepstack index]), as transformers'
    get_image_features concatenates them."""

    def __init__(self, args: ModelArgs):
        nn.Module.__init__(self)   # not Qwen2.5-VL's __init__: another mlx-vlm model file and config
        self.args = args
        vision = vision_qwen25vl._vision_file("qwen3_vl", "Qwen-Image 2.1")
        config = vision.VisionConfig(model_type="qwen3_vl", depth=args.depth, hidden_size=args.hidden_size,
                                     intermediate_size=args.intermediate_size, out_hidden_size=args.out_hidden_size,
                                     num_heads=args.num_heads, patch_size=args.patch_size,
                                     spatial_merge_size=args.spatial_merge_size, in_channels=args.in_channels,
                                     temporal_patch_size=args.temporal_patch_size,
                                     num_position_embeddings=args.num_position_embeddings,
                                     deepstack_visual_indexes=list(args.deepstack_visual_indexes))
        self.tower = vision.VisionModel(config)


def reads_stored(name: str, args: ModelArgs) -> bool:
    """The tower's tensors among the text encoder folder's (ComponentSpec.nbytes counts only these)."""
    return name.startswith(PREFIXES)


def check_config(config: dict, where) -> None:
    ModelArgs.from_dict(config, where)


def whole_model_config(config: dict) -> dict:
    return {}


def processor_config(config: dict | None, where="the processor config") -> dict:
    """processor/preprocessor_config.json over Qwen3-VL's defaults, checked (vision_qwen25vl.processor_config)."""
    return vision_qwen25vl.processor_config(config, where, PROCESSOR)
