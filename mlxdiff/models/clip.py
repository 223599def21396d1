"""CLIP text encoder with projection (transformers' `CLIPTextModelWithProjection`, modeling_clip.py) in MLX.

SD3 uses two: CLIP-L (openai ViT-L/14, quick_gelu) and CLIP-G (OpenCLIP bigG, exact-erf gelu). Pre-LN transformer
with learned absolute positions and a causal mask; the pooled vector is the final-LayerNormed hidden state at the
EOS token, projected by `text_projection` (no bias).

Parameter names are transformers' (`text_model.embeddings.token_embedding.weight` ... `text_projection.weight`), so a
diffusers/transformers folder loads as is. Original single files (`clip_l.safetensors`, `clip_g.safetensors`, or the
`text_encoders.clip_{l,g}.transformer.` part of an "incl_clips" SD3 file) already use these names once the prefix is
stripped; `config_from_weights` infers their config and `sd3_clip_l_extras` supplies CLIP-L's identity projection.
"""

import re
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from ..config_checks import (MAX_HEADS, MAX_LAYERS, MAX_POSITIONS, MAX_VOCAB, MAX_WIDTH, CheckedArgs, Rule, between,
                             positive)
from ..errors import MlxdiffError
from ..formats.keymaps import remap

# transformers' classes (its keys in models/registry.ARCHITECTURES); CLIPTextModel, SD 1.x's and SDXL's first
# encoder, has no text_projection
CLASS_NAMES = ("CLIPTextModelWithProjection", "CLIPTextModel")


@dataclass
class ModelArgs(CheckedArgs):
    """CLIPTextConfig fields, read from the flat config.json transformers writes for CLIPTextModelWithProjection
    (defaults: openai/clip-vit-large-patch14's text model, SD3's CLIP-L, with its legacy token ids)."""
    vocab_size: int = 49408
    hidden_size: int = 768
    intermediate_size: int = 3072
    projection_dim: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    max_position_embeddings: int = 77
    hidden_act: str = "quick_gelu"
    layer_norm_eps: float = 1e-5
    eos_token_id: int | tuple[int, ...] = 2     # transformers allows a list; pooling uses the first
    bos_token_id: int | None = 0                # not used
    pad_token_id: int | None = 1                # not used
    architectures: tuple[str, ...] | None = None    # ["CLIPTextModel"]: no text_projection (SD 1.x, SDXL's first)

    WHAT = "CLIP text encoder config"
    LIMITS = {
        "vocab_size": between(1, MAX_VOCAB),
        "hidden_size": between(1, MAX_WIDTH),
        "intermediate_size": between(1, MAX_WIDTH),
        "projection_dim": between(1, MAX_WIDTH),
        "num_hidden_layers": between(1, MAX_LAYERS),
        "num_attention_heads": between(1, MAX_HEADS),
        "max_position_embeddings": between(1, MAX_POSITIONS),
        "layer_norm_eps": positive(1),
        "eos_token_id": between(0, MAX_VOCAB, items=(1, 16)),
    }
    RULES = (
        # ACTIVATIONS (below the class) is looked up when the rule runs
        Rule("hidden_act", lambda a: a.hidden_act in ACTIVATIONS,
             lambda a: "expected one of " + ", ".join(sorted(ACTIVATIONS))),
        Rule("hidden_size", lambda a: a.hidden_size % a.num_attention_heads == 0,
             lambda a: f"must be a multiple of num_attention_heads {a.num_attention_heads}"),
        Rule("eos_token_id", lambda a: a.eos_token_id < a.vocab_size,
             lambda a: f"must be a token id below vocab_size {a.vocab_size}"),
    )

    def __post_init__(self):
        if isinstance(self.eos_token_id, (list, tuple)):  # pooling uses one id
            self.eos_token_id = self.eos_token_id[0]

    @property
    def with_projection(self) -> bool:
        """CLIPTextModelWithProjection (SD3's encoders, SDXL's second) unless the config names CLIPTextModel."""
        return "CLIPTextModel" not in (self.architectures or ())


# transformers' ACT2FN names -> functions (quick_gelu is x * sigmoid(1.702 x); gelu is the exact erf form)
ACTIVATIONS = {
    "quick_gelu": nn.gelu_fast_approx,
    "gelu": nn.gelu,
    "gelu_new": nn.gelu_approx,
    "gelu_pytorch_tanh": nn.gelu_approx,
    "relu": nn.relu,
}

# Keys that original/older files carry but the model does not have: the non-persistent position_ids buffer
# (old openai/SD checkpoints save it) and CLIPModel's logit_scale. diffusers' loader skips keys the model lacks.
ORIGINAL_KEYMAP = [
    (r"text_model\.embeddings\.position_ids", None),
    (r"logit_scale", None),
]


BARE_PREFIXES = ("embeddings.", "encoder.", "final_layer_norm.")


@dataclass
class CLIPTextOutput:
    """As transformers' CLIPTextModelOutput: hidden_states has num_hidden_layers + 1 entries, the embeddings first,
    none of them final-LayerNormed; last_hidden_state is after final_layer_norm; pooler_output the pooled vector
    (at the end-of-text token); text_embeds its projection (None for a CLIPTextModel, which has none)."""
    hidden_states: list
    last_hidden_state: mx.array
    text_embeds: mx.array | None
    pooler_output: mx.array | None = None


class CLIPTextEmbeddings(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.token_embedding = nn.Embedding(args.vocab_size, args.hidden_size)
        self.position_embedding = nn.Embedding(args.max_position_embeddings, args.hidden_size)

    def __call__(self, input_ids, dtype):
        length = input_ids.shape[-1]
        return self.token_embedding(input_ids).astype(dtype) + self.position_embedding.weight[:length].astype(dtype)


class CLIPAttention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        dim = args.hidden_size
        self.num_heads = args.num_attention_heads
        self.scale = (dim // self.num_heads) ** -0.5
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim)
        self.v_proj = nn.Linear(dim, dim)
        self.out_proj = nn.Linear(dim, dim)

    def __call__(self, x):
        b, n, _ = x.shape
        heads = lambda t: t.reshape(b, n, self.num_heads, -1).transpose(0, 2, 1, 3)
        q, k, v = heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        # causal mask only: the SD3 pipeline passes no attention mask; softmax runs in float32 inside
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask="causal")
        return self.out_proj(out.transpose(0, 2, 1, 3).reshape(b, n, -1))


class CLIPMLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.activation_fn = ACTIVATIONS[args.hidden_act]
        self.fc1 = nn.Linear(args.hidden_size, args.intermediate_size)
        self.fc2 = nn.Linear(args.intermediate_size, args.hidden_size)

    def __call__(self, x):
        return self.fc2(self.activation_fn(self.fc1(x)))


class CLIPEncoderLayer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.self_attn = CLIPAttention(args)
        self.layer_norm1 = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)
        self.mlp = CLIPMLP(args)
        self.layer_norm2 = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)

    def __call__(self, x):
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class CLIPEncoder(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.layers = [CLIPEncoderLayer(args) for _ in range(args.num_hidden_layers)]


class CLIPTextTransformer(nn.Module):
    """transformers' CLIPTextModel body (the `text_model.` part of the names)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embeddings = CLIPTextEmbeddings(args)
        self.encoder = CLIPEncoder(args)
        self.final_layer_norm = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)


class Model(nn.Module):
    """CLIPTextModelWithProjection, or CLIPTextModel when the config says so (no text_projection).
    `model(input_ids)` -> CLIPTextOutput."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.compute_dtype = mx.float32
        self.text_model = CLIPTextTransformer(args)
        if args.with_projection:
            self.text_projection = nn.Linear(args.hidden_size, args.projection_dim, bias=False)

    def __call__(self, input_ids) -> CLIPTextOutput:
        input_ids = mx.array(input_ids)
        if input_ids.ndim == 1:
            input_ids = input_ids[None]
        if input_ids.shape[-1] > self.args.max_position_embeddings:
            raise MlxdiffError(f"CLIP: {input_ids.shape[-1]} tokens is more than the model's "
                               f"{self.args.max_position_embeddings} positions; truncate the prompt")
        body = self.text_model
        x = body.embeddings(input_ids, self.compute_dtype)
        hidden_states = [x]
        for layer in body.encoder.layers:
            x = layer(x)
            hidden_states.append(x)
        last = body.final_layer_norm(x)
        pooled = mx.take_along_axis(last, self.eos_index(input_ids)[:, None, None], axis=1)[:, 0]
        projected = self.text_projection(pooled) if self.args.with_projection else None
        return CLIPTextOutput(hidden_states, last, projected, pooled)

    def eos_index(self, input_ids):
        """Where the pooled vector is taken, as transformers does: for legacy configs (eos_token_id == 2) the
        largest id (49407 = <|endoftext|>, first occurrence), otherwise the first position of eos_token_id
        (position 0 if there is none)."""
        if self.args.eos_token_id == 2:
            return mx.argmax(input_ids, axis=-1)
        return mx.argmax((input_ids == self.args.eos_token_id).astype(mx.int32), axis=-1)

    def quant_predicate(self, path, module) -> bool:
        """The text projection stays in full precision (small; the pooled output every image reads)."""
        return path != "text_projection"

    def sanitize(self, weights: dict) -> dict:
        # transformers names and layouts already; only drop keys the model does not have. transformers 5 saves a
        # CLIPTextModel without the text_model. prefix (4.x and the released SD folders with it): both load
        weights = {(f"text_model.{k}" if k.startswith(BARE_PREFIXES) else k): v for k, v in weights.items()}
        return remap(weights, ORIGINAL_KEYMAP)


def _count_layers(weights: dict, pattern: str) -> int:
    found = {int(m.group(1)) for k in weights if (m := re.fullmatch(pattern, k))}
    if found != set(range(len(found))):
        raise MlxdiffError(f"CLIP weights: layer indices {sorted(found)} are not contiguous from 0; the file is "
                           "incomplete or not a CLIP text encoder")
    return len(found)


def config_from_weights(weights: dict) -> dict:
    """The CLIPTextConfig of an original single file (keys `text_model.*` [+ `text_projection.weight`]).

    diffusers does not infer this: `create_diffusers_clip_model_from_ldm` fetches the config of the detected
    pipeline's repo (text_encoder / text_encoder_2 of stabilityai/stable-diffusion-3*) and only checks that the
    file's position-embedding width equals that config's hidden_size. Those configs are openai CLIP-L (768 wide,
    quick_gelu) and OpenCLIP bigG (1280 wide, gelu). Here the sizes come from the tensor shapes, heads = hidden/64
    (both real models use 64-wide heads), and the activation follows the width: quick_gelu for 768, gelu otherwise.
    eos_token_id is 2, the legacy value of those configs (pooling at argmax(input_ids), which for tokenizer output
    is the first <|endoftext|>, as eos_token_id 49407 would give).
    """
    def shape(key):
        if key not in weights:
            raise MlxdiffError(f"CLIP weights: key {key!r} is missing; this is not a CLIP text encoder file "
                               "(expected transformers' text_model.* names)")
        found = tuple(weights[key].shape)
        if len(found) != 2 or not all(found):   # every tensor read here is a matrix
            raise MlxdiffError(f"CLIP weights: tensor {key!r} has shape {list(found)}; expected 2 non-zero "
                               "dimensions")
        return found

    vocab, hidden = shape("text_model.embeddings.token_embedding.weight")
    positions = shape("text_model.embeddings.position_embedding.weight")[0]
    layers = _count_layers(weights, r"text_model\.encoder\.layers\.(\d+)\.self_attn\.q_proj\.weight")
    if layers == 0:
        raise MlxdiffError("CLIP weights: no text_model.encoder.layers.*; this is not a CLIP text encoder file")
    intermediate = shape("text_model.encoder.layers.0.mlp.fc1.weight")[0]
    projection = shape("text_projection.weight")[0] if "text_projection.weight" in weights else hidden
    if hidden % 64:
        raise MlxdiffError(f"CLIP weights: hidden size {hidden} is not a multiple of 64, so the head count "
                           "cannot be inferred; use a diffusers folder with a config.json")
    return dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, projection_dim=projection,
                num_hidden_layers=layers, num_attention_heads=hidden // 64, max_position_embeddings=positions,
                hidden_act="quick_gelu" if hidden == 768 else "gelu", layer_norm_eps=1e-5,
                bos_token_id=0, eos_token_id=2, pad_token_id=1)


def identity_projection(weights: dict, config: dict):
    """SD3's CLIP-L projection: diffusers sets text_projection.weight = eye(hidden) for clip_l single files. In the
    token embedding's dtype (0 and 1 are exact in every float dtype)."""
    dtype = weights["text_model.embeddings.token_embedding.weight"].dtype
    return mx.eye(config["projection_dim"], config["hidden_size"], dtype=dtype)


def sd3_clip_l_extras(config: dict) -> dict:
    """For ComponentSpec.extra: tensors to add to a clip_l single file when it has none of them."""
    return {"text_projection.weight": lambda weights: identity_projection(weights, config)}


# -- OpenCLIP text towers (SDXL's `conditioner.embedders.1.model.*`, SD 2.x's `cond_stage_model.model.*`) ------------
# OpenCLIP names -> transformers' CLIPTextModel(WithProjection) names, as diffusers' convert_open_clip_checkpoint
# reads them; also stable-diffusion.cpp's GGUF names for the same tensors (its convert renames them to transformers'
# except the fused `self_attn.in_proj` and `text_model.text_projection`, whose data it keeps as OpenCLIP stores
# them). The fused in_proj splits into q, k, v rows; text_projection is stored (hidden, projection), used as
# `x @ P`, so transformers' Linear weight is its transpose (`transpose` below, applied by openclip_to_transformers).
LAYER = r"text_model.encoder.layers.\1."
OPENCLIP_KEYMAP = [
    (r"token_embedding\.weight", "text_model.embeddings.token_embedding.weight"),
    (r"positional_embedding", "text_model.embeddings.position_embedding.weight"),
    (r"ln_final\.(weight|bias)", r"text_model.final_layer_norm.\1"),
    (r"(?:text_model\.)?text_projection", "text_projection.weight"),
    (r"transformer\.resblocks\.(\d+)\.attn\.in_proj_(weight|bias)",
     (LAYER + r"self_attn.q_proj.\2", LAYER + r"self_attn.k_proj.\2", LAYER + r"self_attn.v_proj.\2")),
    (r"text_model\.encoder\.layers\.(\d+)\.self_attn\.in_proj\.(weight|bias)",
     (LAYER + r"self_attn.q_proj.\2", LAYER + r"self_attn.k_proj.\2", LAYER + r"self_attn.v_proj.\2")),
    (r"transformer\.resblocks\.(\d+)\.attn\.out_proj\.(weight|bias)", LAYER + r"self_attn.out_proj.\2"),
    (r"transformer\.resblocks\.(\d+)\.ln_1\.(weight|bias)", LAYER + r"layer_norm1.\2"),
    (r"transformer\.resblocks\.(\d+)\.ln_2\.(weight|bias)", LAYER + r"layer_norm2.\2"),
    (r"transformer\.resblocks\.(\d+)\.mlp\.c_fc\.(weight|bias)", LAYER + r"mlp.fc1.\2"),
    (r"transformer\.resblocks\.(\d+)\.mlp\.c_proj\.(weight|bias)", LAYER + r"mlp.fc2.\2"),
    (r"logit_scale|attn_mask", None),
]
_LAYER_INDEX = re.compile(r"text_model\.encoder\.layers\.(\d+)\.")


def _transposed(w):
    """OpenCLIP's text_projection (hidden, projection) -> a Linear weight (projection, hidden). A quantized one
    (sd.cpp GGUFs quantize it) is dequantized first: it is small and stays in full precision (quant_predicate)."""
    if not isinstance(w, mx.array):
        w = w.dequantize()
    return w.T


def openclip_to_transformers(weights: dict, layers=None, projection=True) -> dict:
    """OpenCLIP (or sd.cpp GGUF) text-tower names -> transformers' (lazy). `layers`: keep only the first `layers`
    layers (SD 2.x runs OpenCLIP-H without its last one, as diffusers' 23-layer text encoder does), and
    `projection` False drops text_projection (a CLIPTextModel has none)."""
    out = remap(weights, OPENCLIP_KEYMAP)
    if "text_projection.weight" in out:
        p = out.pop("text_projection.weight")
        if projection:
            out["text_projection.weight"] = _transposed(p)
    if layers is not None:
        out = {k: v for k, v in out.items() if not ((m := _LAYER_INDEX.match(k)) and int(m.group(1)) >= layers)}
    return out


def config_from_openclip(weights: dict) -> dict:
    """The CLIPTextConfig of an OpenCLIP text tower (names as OPENCLIP_KEYMAP reads them, prefix stripped), read off
    its shapes: widths, layers, positions and the projection width; heads = width / 64 (OpenCLIP's ViT-H and bigG
    both have 64-wide heads: 16 at 1024, 20 at 1280), exact-erf gelu, eos_token_id 2 as diffusers' configs of these
    encoders have (pooling at argmax of the ids)."""
    def shape(*keys):
        key = next((k for k in keys if k in weights), None)
        if key is None:
            raise MlxdiffError(f"OpenCLIP text encoder: tensor {keys[0]!r} is missing; the file is incomplete, "
                               "re-download it")
        found = tuple(weights[key].shape)
        if len(found) != 2 or not all(found):
            raise MlxdiffError(f"OpenCLIP text encoder: tensor {key!r} has shape {list(found)}; expected 2 non-zero "
                               "dimensions")
        return found

    vocab, hidden = shape("token_embedding.weight", "text_model.embeddings.token_embedding.weight")
    positions = shape("positional_embedding", "text_model.embeddings.position_embedding.weight")[0]
    layers = _count_layers(weights, r"(?:transformer\.resblocks|text_model\.encoder\.layers)\.(\d+)\."
                                    r"(?:attn\.in_proj_weight|self_attn\.in_proj\.weight)")
    if layers == 0:
        raise MlxdiffError("OpenCLIP text encoder: no transformer.resblocks.N.attn.in_proj_weight; this is not an "
                           "OpenCLIP text tower")
    intermediate = shape("transformer.resblocks.0.mlp.c_fc.weight", "text_model.encoder.layers.0.mlp.fc1.weight")[0]
    if hidden % 64:
        raise MlxdiffError(f"OpenCLIP text encoder: width {hidden} is not a multiple of 64, so the head count cannot "
                           "be inferred")
    has_projection = any(k in weights for k in ("text_projection", "text_model.text_projection"))
    projection = shape("text_projection", "text_model.text_projection")[1] if has_projection else hidden
    return dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, projection_dim=projection,
                num_hidden_layers=layers, num_attention_heads=hidden // 64, max_position_embeddings=positions,
                hidden_act="gelu", layer_norm_eps=1e-5, bos_token_id=0, eos_token_id=2, pad_token_id=1)
