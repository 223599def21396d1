"""FLUX.2's LLM text encoders through mlx-lm, stopped at the deepest hidden-state tap.

    dev:   Mistral3ForConditionalGeneration (Mistral-Small-3.x; text_config nested), taps (10, 20, 30)
    klein: Qwen3ForCausalLM (Qwen3-4B / 8B), taps (9, 18, 27)
    Qwen-Image: Qwen2_5_VLForConditionalGeneration's language model (Qwen2's layers), tap num_hidden_layers
               (hidden_states[-1], the final-normed output; the pipeline folder names it)
    Krea 2 (FLUX 3 Klein, Qwen-Image 2.1): Qwen3VLModel / Qwen3VLForConditionalGeneration's language model (Qwen3's
               layers; the taps and the positions the pipeline's; models/text_qwen3vl.py)

diffusers (`_get_mistral_3_small_prompt_embeds`, `_get_qwen3_prompt_embeds`) runs the whole LLM with
`output_hidden_states=True` and keeps hidden_states[k] for k in the taps: [0] is the embedding output, [k] the output of
decoder layer k (1-based), and the last entry is the final-normed output. The taps are concatenated per token,
[tap0 | tap1 | tap2] -> (B, L, 3 * hidden). So only the embedding and the first max(taps) layers are ever needed: the
mlx-lm language model is built with num_hidden_layers = max(taps), and the deeper layers, the final norm (unless a tap
is the last layer), the lm_head, the vision tower and the projector are dropped from the lazily mapped weights before
anything is read.

The layers are mlx-lm's own (llama.LlamaModel for Mistral, qwen3.Qwen3Model). We run embed -> layers ourselves with the
mask transformers builds: causal AND the tokenizer's padding mask (AND a sliding window where the config has one);
and, where the pipeline gives them, each token's own RoPE position (Krea 2's: text_qwen3vl.block_at_positions).
Left padding (Mistral's tokenizer) makes every pad query see no key at all; torch's SDPA, which diffusers runs by
default, returns a zero attention output for such a row, where MLX's SDPA returns the mean of the values. Those pad
positions reach the DiT (it gets no text mask), so for them we compose mlx-lm's block ourselves with a zero attention
output (`block_with_blind_rows`); every other row goes through the mlx-lm layer unchanged.

Accepted folders: a diffusers `text_encoder/` (transformers names: `model.language_model.*` or the older
`language_model.model.*` for Mistral3, `model.*` for Qwen3, `model.language_model.*` or `language_model.*` for
Qwen3-VL) or an mlx-lm converted one, also quantized (config has
"quantization"; layers are quantized exactly where the file has `.scales`, with mlx-lm's per-layer settings).
Accepted single files (text_encoder=FILE, loading/sources.text_encoder_from_file): the same names flat in one
safetensors (ComfyUI's `model.*`, pruned or whole), or a llama.cpp GGUF (`token_embd`, `blk.N.*`; kept quantized,
llama-arch q/k rows un-permuted); config_from_file reads the config off the shapes.
"""

import dataclasses
from dataclasses import dataclass, field

import numpy as np

from .. import backend  # noqa: F401  (OpenBLAS preload before mlx)
import mlx.core as mx
import mlx.nn as nn
from .mlx_lm_models import llama, qwen2, qwen3   # mlx-lm's model files without its package's torch import

from ..config_checks import (MAX_HEAD_DIM, MAX_HEADS, MAX_LAYERS, MAX_POSITIONS, MAX_VOCAB, MAX_WIDTH, CheckedArgs,
                             Rule, between, check_rules, check_values, field_types, one_of, positive, require_object)
from ..errors import MlxdiffError
from ..formats.keymaps import compile_rules, remap
from ..formats.quantized import QuantizedTensor, RawBlocks
from . import text_qwen3vl
from .fused import through
from .sharding import check_counts, divides_all, shard_layer

# diffusers' text_encoder_out_layers defaults
TAPS = {"mistral3": (10, 20, 30), "qwen3": (9, 18, 27)}
# config.json model_type -> the class it comes from (for error messages)
ARCHITECTURES = {"mistral3": "Mistral3ForConditionalGeneration", "qwen3": "Qwen3ForCausalLM",
                 "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",   # Qwen-Image's: its language model only
                 text_qwen3vl.MODEL_TYPE: text_qwen3vl.CLASSES[1]}      # Krea 2's (Qwen3VLModel too)
# transformers' classes it reads (its keys in models/registry.ARCHITECTURES): those above, Tongyi-MAI's Z-Image
# folders' name for their Qwen3, and Qwen3-VL's two (Krea 2's, FLUX 3's, Qwen-Image 2.1's: the language model only)
CLASS_NAMES = (ARCHITECTURES["mistral3"], ARCHITECTURES["qwen3"], ARCHITECTURES["qwen2_5_vl"], "Qwen3Model",
               *text_qwen3vl.CLASSES)
# Mistral3's text_config model_type -> mlx-lm language model (as mlx_lm.models.mistral3 chooses it)
MISTRAL3_TEXT_MODELS = {"mistral": llama, "llama": llama}

# transformers / mlx-lm names -> this module's names (embed_tokens, layers.N, norm). Everything else (vision tower,
# multi_modal_projector, lm_head) is dropped.
KEYMAP = compile_rules([
    (r"model\.language_model\.((?:embed_tokens|layers|norm)\..+)", r"\1"),   # Mistral3, transformers >= 4.52
    (r"language_model\.model\.((?:embed_tokens|layers|norm)\..+)", r"\1"),   # Mistral3, older / mlx-lm converted
    (r"language_model\.((?:embed_tokens|layers|norm)\..+)", r"\1"),         # Qwen3VLModel (transformers 5.25)
    # Qwen3ForCausalLM, mlx-lm, ComfyUI; Qwen2_5_VLForConditionalGeneration as transformers 4.x and 5.25 save it
    (r"model\.((?:embed_tokens|layers|norm)\..+)", r"\1"),
    (r"((?:embed_tokens|layers|norm)\..+)", r"\1"),                          # Qwen3Model (Tongyi-MAI's Z-Image)
    # llama.cpp's GGUF names (convert_hf_to_gguf.py; q/k rows of llama-arch files are permuted: gguf_unpermute)
    (r"token_embd\.weight", "embed_tokens.weight"),
    (r"output_norm\.weight", "norm.weight"),
    *[(rf"blk\.(\d+)\.{gguf}\.(weight|bias)", rf"layers.\1.{ours}.\2") for gguf, ours in (
        ("attn_q", "self_attn.q_proj"), ("attn_k", "self_attn.k_proj"), ("attn_v", "self_attn.v_proj"),
        ("attn_output", "self_attn.o_proj"), ("attn_q_norm", "self_attn.q_norm"), ("attn_k_norm", "self_attn.k_norm"),
        ("attn_norm", "input_layernorm"), ("ffn_norm", "post_attention_layernorm"), ("ffn_gate", "mlp.gate_proj"),
        ("ffn_up", "mlp.up_proj"), ("ffn_down", "mlp.down_proj"))],
    (r".*", None),
])


# The language model's config (text_config for Mistral3, the flat config for Qwen3) is checked against the mlx-lm
# ModelArgs it becomes (types from its annotations), plus the keys attention_windows reads, with these limits.
MAX_ROPE_THETA = 1e12     # RoPE base (largest released: Mistral-Small's 1e9); below 1 the frequencies grow
TEXT_TYPES = {"sliding_window": int | None, "use_sliding_window": bool, "max_window_layers": int,
              "layer_types": list[str] | None}
TEXT_LIMITS = {
    "hidden_size": between(1, MAX_WIDTH),
    "num_hidden_layers": between(1, MAX_LAYERS),
    "intermediate_size": between(1, MAX_WIDTH),
    "num_attention_heads": between(1, MAX_HEADS),
    "num_key_value_heads": between(1, MAX_HEADS),
    "head_dim": between(1, MAX_HEAD_DIM),
    "vocab_size": between(1, MAX_VOCAB),
    "max_position_embeddings": between(1, MAX_POSITIONS),
    "rms_norm_eps": positive(1),
    "rope_theta": between(1, MAX_ROPE_THETA),
    "sliding_window": between(1, MAX_POSITIONS),
    "max_window_layers": between(0, MAX_LAYERS),
    "layer_types": one_of("full_attention", "sliding_attention"),
}


def _heads(t) -> int:
    return t["num_attention_heads"]


TEXT_RULES = (
    Rule("num_key_value_heads", lambda t: _heads(t) % (t.get("num_key_value_heads") or _heads(t)) == 0,
         lambda t: f"must divide num_attention_heads {_heads(t)}"),
    Rule("hidden_size", lambda t: t.get("head_dim") is not None or t["hidden_size"] % _heads(t) == 0,
         lambda t: f"must be a multiple of num_attention_heads {_heads(t)} (no head_dim given)"),
    Rule("num_attention_heads", lambda t: _heads(t) * (t.get("head_dim") or t["hidden_size"] // _heads(t))
         <= MAX_WIDTH, lambda t: f"num_attention_heads * head_dim must be at most {MAX_WIDTH}"),
    Rule("head_dim", lambda t: (t.get("head_dim") or t["hidden_size"] // _heads(t)) % 2 == 0,
         lambda t: "the head size must be even (RoPE rotates pairs of channels)"),
    Rule("layer_types", lambda t: t.get("layer_types") is None or len(t["layer_types"]) == t["num_hidden_layers"],
         lambda t: f"expected one entry per layer (num_hidden_layers {t['num_hidden_layers']})"),
)


@dataclass
class ModelArgs(CheckedArgs):
    """config.json of the text encoder. For Qwen3 (a flat config) text_config is the config itself."""
    model_type: str = "mistral3"
    text_config: dict = field(default_factory=dict)
    taps: tuple[int, ...] | None = None       # hidden_states indices; None: diffusers' default for the model type
    quantization: dict | None = None          # mlx-lm converted folders
    quantization_config: dict | None = None   # transformers-quantized (bitsandbytes, ...): not supported
    architectures: list[str] | None = None
    file_layers: int | None = None            # a single file (text_encoder=FILE): the decoder layers it holds (a
                                              # pruned file holds fewer than text_config's num_hidden_layers)

    WHAT = "FLUX.2 text encoder config"
    LIMITS = {"taps": between(0, MAX_LAYERS, items=(1, 16))}

    @classmethod
    def from_dict(cls, params, where=None):
        where = where or cls.WHAT
        params = dict(require_object(params, where))
        if "text_config" not in params:
            params["text_config"] = {k: v for k, v in params.items() if k not in ("taps", "quantization",
                                                                                  "file_layers")}
        elif params.get("model_type") == text_qwen3vl.MODEL_TYPE and isinstance(params["text_config"], dict):
            # Qwen3VLConfig keeps tie_word_embeddings at the top; mlx-lm's Qwen3 args require it (the lm_head is
            # never read either way)
            params["text_config"] = {"tie_word_embeddings": bool(params.get("tie_word_embeddings", False)),
                                     **params["text_config"]}
        args = super().from_dict(params, where)
        check_language_model(args, where)
        return args

    def __post_init__(self):
        self.taps = tuple(TAPS.get(self.model_type, ()) if self.taps is None else self.taps)

    @property
    def num_layers(self) -> int:
        """Decoder layers in the checkpoint (not all are loaded)."""
        return int(self.text_config.get("num_hidden_layers", 0))

    @property
    def depth(self) -> int:
        """Decoder layers actually built: up to the deepest tap."""
        return max(self.taps)

    @property
    def tapped_final_norm(self) -> bool:
        """hidden_states[num_layers] is the final-normed output, so that tap needs the final norm."""
        return self.depth == self.num_layers


def language_model_class(args: ModelArgs):
    """The mlx-lm ModelArgs class the language model config becomes (None: a model type check_args refuses)."""
    if args.model_type in ("qwen3", text_qwen3vl.MODEL_TYPE):
        return qwen3.ModelArgs
    if args.model_type == "qwen2_5_vl":
        return qwen2.ModelArgs
    if args.model_type == "mistral3":
        arch = MISTRAL3_TEXT_MODELS.get(args.text_config.get("model_type"))
        return arch.ModelArgs if arch else None
    return None


def check_language_model(args: ModelArgs, where) -> None:
    """The language model's config: the keys mlx-lm requires present, every value typed and in range, and mlx-lm
    able to read it."""
    cls = language_model_class(args)
    if cls is None:
        return
    text = require_object(args.text_config, where, "text_config")
    prefix = "text_config." if args.model_type in ("mistral3", text_qwen3vl.MODEL_TYPE) else ""
    hints = {**field_types(cls), **TEXT_TYPES}
    required = [f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING
                and f.default_factory is dataclasses.MISSING and f.name != "rope_theta"]  # or in rope_parameters
    check_values(text, hints, TEXT_LIMITS, where, prefix, required)
    check_rules(text, TEXT_RULES, where, prefix)
    try:
        cls.from_dict(language_model_config(args))
    except (TypeError, ValueError, KeyError) as e:   # mlx-lm's own checks (rope_scaling, ...)
        raise MlxdiffError(f"{where}: mlx-lm cannot read the language model config ({e})") from None


def check_args(args: ModelArgs, source, taps=True) -> None:
    """Raise MlxdiffError when the folder is not a text encoder we can tap as asked (`taps=False`: whether it is
    one at all, before the run's taps are known)."""
    if args.model_type not in ARCHITECTURES:
        what = ", ".join(args.architectures or []) or "no architectures"
        raise MlxdiffError(f"{source}: model_type {args.model_type!r} ({what}) is not a FLUX.2 text encoder; "
                           "expected Mistral3ForConditionalGeneration (FLUX.2-dev) or Qwen3ForCausalLM (FLUX.2-klein)"
                           " (or Qwen-Image's Qwen2_5_VLForConditionalGeneration, Krea 2's Qwen3VLModel)")
    if args.model_type == "mistral3":
        text_type = args.text_config.get("model_type")
        if text_type not in MISTRAL3_TEXT_MODELS:
            raise MlxdiffError(f"{source}: Mistral3 text_config model_type {text_type!r} is not supported; "
                               f"supported: {', '.join(sorted(MISTRAL3_TEXT_MODELS))}")
    if args.quantization_config and not args.quantization:
        method = args.quantization_config.get("quant_method", "?")
        raise MlxdiffError(f"{source}: the text encoder is quantized with {method!r}, which MLX cannot load; use the "
                           "bf16 text encoder, or convert it with mlx_lm.convert (-q for an MLX-quantized one)")
    if not taps:
        return
    if not args.taps or any(not isinstance(t, int) or t < 0 for t in args.taps):
        raise MlxdiffError(f"{source}: taps {args.taps!r} must be hidden-state indices (0 = the embeddings, "
                           "k = decoder layer k's output)")
    if args.depth > args.num_layers:
        raise MlxdiffError(f"{source}: taps {args.taps} need {args.depth} decoder layers but the model has "
                           f"{args.num_layers}; this is not the text encoder the pipeline expects")
    if args.file_layers is not None and args.depth > args.file_layers:
        raise MlxdiffError(f"{source}: taps {args.taps} need decoder layers 1 to {args.depth} but the file holds "
                           f"{args.file_layers}; a pruned encoder must keep every tapped layer")


def language_model_config(args: ModelArgs) -> dict:
    """The language model's config with only the layers the taps need, in the form mlx-lm's ModelArgs reads."""
    text = dict(args.text_config)
    text["num_hidden_layers"] = args.depth
    if text.get("layer_types"):
        text["layer_types"] = list(text["layer_types"])[:args.depth]
    # transformers >= 5 nests rope_theta (and any scaling) under rope_parameters; llama.ModelArgs reads neither there
    rope = text.get("rope_parameters") or {}
    if text.get("rope_theta") is None and "rope_theta" in rope:
        text["rope_theta"] = rope["rope_theta"]
    if not text.get("rope_scaling") and rope.get("rope_type", "default") != "default":
        text["rope_scaling"] = rope
    if args.model_type == "qwen2_5_vl":
        # Qwen2.5-VL's multimodal RoPE: text alone puts the same position on its three rows (transformers'
        # position_ids arange expanded to 3 rows), so the mrope_section split recombines one frequency table: plain
        # RoPE over the whole head (tests/test_qwenimage_pipeline.py checks this against transformers)
        scaling = text.get("rope_scaling") or {}
        if scaling.get("type", scaling.get("rope_type", "default")) in ("mrope", "default"):
            text["rope_scaling"] = None
    if args.model_type == text_qwen3vl.MODEL_TYPE:
        text = text_qwen3vl.language_model_config(text)
    return text


def attention_windows(args: ModelArgs) -> list:
    """Per built layer: the sliding window transformers applies (None: full causal attention)."""
    text = args.text_config
    if args.model_type == "mistral3":
        # MistralModel: one window for every layer; MistralConfig's default is 4096 when config.json omits it
        window = text.get("sliding_window", 4096) if text.get("model_type") == "mistral" else None
        return [window] * args.depth
    # Qwen3Config: sliding_window only with use_sliding_window, on the layers layer_types marks
    window = text.get("sliding_window", 4096) if text.get("use_sliding_window") else None
    types = text.get("layer_types") or [
        "sliding_attention" if window is not None and i >= text.get("max_window_layers", 28) else "full_attention"
        for i in range(args.num_layers)]
    return [window if types[i] == "sliding_attention" else None for i in range(args.depth)]


def visible_keys(attention_mask: np.ndarray, window) -> np.ndarray:
    """(B, L) padding mask -> (B, 1, L, L) bool, True where query q may attend key k (transformers' sdpa_mask)."""
    length = attention_mask.shape[1]
    q = np.arange(length)[:, None]
    k = np.arange(length)[None, :]
    allowed = k <= q
    if window is not None:
        allowed &= q - k < window
    return allowed[None, None] & (attention_mask[:, None, None, :] != 0)


def reads(key: str, args: ModelArgs) -> bool:
    """Whether the encoder reads this (mapped) weight: the embedding, layers below the deepest tap, and the final norm
    only when a tap is the last layer's output."""
    if key.startswith("layers."):
        return int(key.split(".")[1]) < args.depth
    return key.startswith("embed_tokens.") or (key.startswith("norm.") and args.tapped_final_norm)


def block_with_blind_rows(layer, h, mask, blind):
    """mlx-lm's TransformerBlock.__call__ (pre-norm attention and MLP residuals), except that query rows that see no
    key (`blind`, (B, L, 1)) get the attention output torch's SDPA gives them: zero (o_proj's bias, if any)."""
    attn = layer.self_attn
    r = attn(layer.input_layernorm(h), mask)
    zero = attn.o_proj["bias"].astype(r.dtype) if "bias" in attn.o_proj else mx.zeros((), r.dtype)
    h = h + mx.where(blind, zero, r)
    return h + layer.mlp(layer.post_attention_layernorm(h))


def _split_counts(args: ModelArgs) -> dict:
    """What Model.shard splits over the ranks: {config name: (count, unit)}."""
    text = language_model_config(args)
    heads = text["num_attention_heads"]
    return {"num_attention_heads": (heads, " heads"),
            "num_key_value_heads": (text.get("num_key_value_heads") or heads, " heads"),
            "intermediate_size": (text["intermediate_size"], "")}


def shards_evenly(args: ModelArgs, n: int) -> bool:
    """Whether Model.shard can split this encoder over n ranks (loading/tensor_parallel.shardable)."""
    return divides_all(_split_counts(args), n)


def check_shardable(args: ModelArgs, n: int) -> None:
    """Whether Model.shard can split this encoder over n ranks (query and key/value heads, the MLP width), else one
    line; checked before anything is read."""
    check_counts("text encoder", _split_counts(args), n)


class Model(nn.Module):
    """embed_tokens + layers[:max(taps)] (+ the final norm when a tap is the last layer) of the mlx-lm model.

    __call__(input_ids (B, L), attention_mask (B, L) or None, position_ids (B, L) or None: each token's RoPE
    position, 0 .. L-1 when None; inputs_embeds (B, L, hidden) or None: the embeddings to run instead of
    input_ids' (Qwen-Image-Edit's, with the vision tower's features at the image tokens)) -> prompt_embeds (B, L,
    len(taps) * hidden) in compute_dtype: diffusers' stacked hidden states, per token [tap0 | tap1 | ...]."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.windows = attention_windows(args)
        self.compute_dtype = mx.float32
        text = language_model_config(args)
        if args.model_type == "mistral3":
            arch = MISTRAL3_TEXT_MODELS[args.text_config.get("model_type")]
            language_model = arch.LlamaModel(arch.ModelArgs.from_dict(text))
        elif args.model_type == "qwen2_5_vl":      # Qwen2.5-VL's language model is Qwen2's (mlx_lm qwen2_vl)
            language_model = qwen2.Qwen2Model(qwen2.ModelArgs.from_dict(text))
        else:                                      # Qwen3, and Qwen3-VL's language model (mlx_lm qwen3_vl)
            language_model = qwen3.Qwen3Model(qwen3.ModelArgs.from_dict(text))
        self.embed_tokens = language_model.embed_tokens
        self.layers = language_model.layers
        if args.tapped_final_norm:
            self.norm = language_model.norm

    def shard(self, group):
        """Tensor-parallel over `group`, mlx-lm's scheme for these models (mlx_lm.models.llama / qwen3 Model.shard):
        q/k/v and the MLP's gate/up split by output rows, o_proj and down_proj by input columns with one all_sum
        each, the heads divided; through models/sharding.shard_layer, which refuses in one line what cannot be
        split (palettized weights). The embedding and norms stay whole on every rank."""
        n = group.size()
        check_shardable(self.args, n)
        for i, layer in enumerate(self.layers):
            attn, mlp, where = layer.self_attn, layer.mlp, f"text encoder layers.{i}"
            for name in ("q_proj", "k_proj", "v_proj"):
                setattr(attn, name, shard_layer(getattr(attn, name), "all-to-sharded", group,
                                                f"{where}.self_attn.{name}"))
            attn.o_proj = shard_layer(attn.o_proj, "sharded-to-all", group, f"{where}.self_attn.o_proj")
            attn.n_heads //= n
            attn.n_kv_heads //= n
            for name in ("gate_proj", "up_proj"):
                setattr(mlp, name, shard_layer(getattr(mlp, name), "all-to-sharded", group, f"{where}.mlp.{name}"))
            mlp.down_proj = shard_layer(mlp.down_proj, "sharded-to-all", group, f"{where}.mlp.down_proj")

    def sanitize(self, weights: dict) -> dict:
        """transformers / mlx-lm / llama.cpp names -> ours, keeping only what the taps need (the rest is never read).
        An embedding kept quantized (GGUF blocks, float8) decodes only the looked-up rows (formats/gguf.RawEmbedding,
        formats/fp8.Fp8Embedding, MLX's QuantizedEmbedding)."""
        return {k: v for k, v in remap(weights, KEYMAP).items() if reads(k, self.args)}

    def __call__(self, input_ids, attention_mask=None, position_ids=None, inputs_embeds=None, rope_tables=None,
                 deepstack=()):
        """`rope_tables`: (cos, sin) (B, 1, L, head_dim) in place of the RoPE at positions (Qwen3-VL's multimodal
        positions: text_qwen3vl.mrope_tables); `deepstack`: (B, L, hidden) arrays added after the first layers,
        one each (Qwen3-VL's deepstack image features: text_qwen3vl.scatter_images)."""
        if not isinstance(input_ids, mx.array):
            input_ids = mx.array(np.asarray(input_ids), dtype=mx.int32)
        batch, length = input_ids.shape
        if position_ids is not None:
            position_ids = mx.array(np.asarray(position_ids, np.int32)) if not isinstance(position_ids, mx.array) \
                else position_ids.astype(mx.int32)
            if position_ids.shape != (batch, length):
                raise MlxdiffError(f"position_ids has shape {position_ids.shape}, input_ids {(batch, length)}")
            if self.args.model_type not in ("qwen3", text_qwen3vl.MODEL_TYPE):
                raise MlxdiffError(f"position_ids: only for Qwen3 layers, not {self.args.model_type}")
            if text_qwen3vl.plain_positions(position_ids, length):
                position_ids = None
        pad = np.ones((batch, length), np.int32) if attention_mask is None else np.asarray(attention_mask)
        if pad.shape != (batch, length):
            raise MlxdiffError(f"attention_mask has shape {pad.shape}, input_ids {(batch, length)}")

        masks = {}  # window -> (mask for mlx-lm's attention, blind rows or None)
        for window in set(self.windows):
            if pad.all() and (window is None or window >= length):
                masks[window] = ("causal", None)
                continue
            visible = visible_keys(pad, window)
            blind = ~visible.any(axis=-1)                                   # (B, 1, L)
            masks[window] = (mx.array(visible), mx.array(blind.reshape(batch, length, 1)) if blind.any() else None)

        h = (self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds).astype(self.compute_dtype)
        states = {0: h}
        for i, (layer, window) in enumerate(zip(self.layers, self.windows)):
            mask, blind = masks[window]
            if rope_tables is not None:
                h = through(layer, text_qwen3vl.block_with_tables, h, mask, blind, *rope_tables)
            elif position_ids is not None:
                h = through(layer, text_qwen3vl.block_at_positions, h, mask, blind, position_ids)
            else:
                h = layer(h, mask) if blind is None else through(layer, block_with_blind_rows, h, mask, blind)
            if i < len(deepstack):
                h = h + deepstack[i].astype(h.dtype)
            states[i + 1] = h
        if self.args.tapped_final_norm:
            states[self.args.depth] = self.norm(h)
        return mx.concatenate([states[t] for t in self.args.taps], axis=-1)


def check_config(config: dict, where, taps=True) -> None:
    """The check mlxdiff.loading runs on a text encoder's config (taps=False when the folder is read, with the taps
    when it is built)."""
    check_args(ModelArgs.from_dict(config, where), where, taps)


# python -m mlxdiff.convert writes the encoder whole (every layer and the final norm) under transformers' Qwen3 /
# mlx-lm names, which KEYMAP reads back for any taps
STORED_PREFIX = "model."


def whole_model_config(config: dict) -> dict:
    """The taps that build every layer and the final norm (what convert writes)."""
    return {"taps": [ModelArgs.from_dict(config).num_layers]}


def reads_stored(name: str, args: ModelArgs) -> bool:
    """Whether a stored tensor (transformers / mlx-lm name) is one the encoder reads for its taps."""
    mapped = list(remap({name: None}, KEYMAP))
    return bool(mapped) and reads(mapped[0], args)


# -- one file (text_encoder=FILE): the config read off the tensors ------------------------------------------------

# What shapes cannot give, for the released encoders (their config.json files): Mistral-Small-3.1 / 3.2-24B
# (FLUX.2-dev's text_config; ComfyUI's mistral_3_small_flux2 files, full or pruned to 30 layers) and Qwen3-4B / 8B
# (klein 4B / 9B). A file that is none of these takes them from the folder's text_encoder/config.json or, for a GGUF,
# its metadata.
KNOWN_MODELS = (
    ("Mistral-Small-3.x", "mistral3", dict(hidden_size=5120, vocab_size=131072),
     dict(head_dim=128, num_hidden_layers=40, rope_theta=1e9, rms_norm_eps=1e-5, max_position_embeddings=131072,
          sliding_window=None)),
    ("Qwen3-4B", "qwen3", dict(hidden_size=2560, vocab_size=151936),
     dict(num_hidden_layers=36, rope_theta=1e6, rms_norm_eps=1e-6, max_position_embeddings=40960)),
    ("Qwen3-8B", "qwen3", dict(hidden_size=4096, vocab_size=151936),
     dict(num_hidden_layers=36, rope_theta=1e6, rms_norm_eps=1e-6, max_position_embeddings=40960)),
)
# GGUF metadata key (under "<general.architecture>.") -> the text config key it gives
GGUF_METADATA = {"attention.key_length": "head_dim", "rope.freq_base": "rope_theta",
                 "attention.layer_norm_rms_epsilon": "rms_norm_eps", "context_length": "max_position_embeddings"}
# GGUF metadata keys the shapes also give: read (typed, bounded) and checked against them
GGUF_SHAPE_KEYS = {"attention.head_count": "num_attention_heads", "attention.head_count_kv": "num_key_value_heads",
                   "attention.value_length": "head_dim", "embedding_length": "hidden_size",
                   "feed_forward_length": "intermediate_size", "block_count": "num_hidden_layers",
                   "vocab_size": "vocab_size"}
GGUF_FLOATS = ("rope.freq_base", "attention.layer_norm_rms_epsilon")   # float32 in llama.cpp; the rest integers
GGUF_PER_LAYER = ("attention.head_count", "attention.head_count_kv", "feed_forward_length")   # or arrays
# llama.cpp permutes the q/k rows of these architectures (convert_hf_to_gguf.py LlamaModel.permute; Mistral3 is a
# LlamaModel there); Qwen3 (Qwen2Model) is written as transformers has it
GGUF_PERMUTED = ("llama", "mistral", "mistral3")
# general.architecture of each kind of decoder (llama.cpp's names)
GGUF_ARCHITECTURES = {"mistral3": GGUF_PERMUTED, "qwen3": ("qwen3",)}
NOT_TEXT = ("taps", "quantization", "quantization_config", "file_layers", "architectures", "text_config",
            "vision_config", "_name_or_path", "transformers_version")


def gguf_architecture(metadata, model_type):
    """general.architecture of a GGUF text encoder: absent (None: taken by its shapes), or a string naming the
    kind of decoder its shapes are (llama / mistral / mistral3 for Mistral, qwen3 for Qwen3), since it decides the
    q/k row order (gguf_is_permuted)."""
    from ..formats.gguf import metadata_value  # heavy: formats.gguf imports the gguf package (~0.7 s)
    arch = metadata_value(metadata, "general.architecture", "str")
    if arch is not None and arch not in GGUF_ARCHITECTURES[model_type]:
        kind = "a Qwen3" if model_type == "qwen3" else "a Mistral"
        raise MlxdiffError(f"GGUF metadata general.architecture is {arch[:40]!r}, but the tensors are {kind} "
                           f"decoder's; expected {' or '.join(map(repr, GGUF_ARCHITECTURES[model_type]))} (or give "
                           "the encoder of the model's own family)")
    return arch


def gguf_values(metadata, model_type, layers) -> dict:
    """{GGUF key (without the architecture prefix): value} of the hyperparameters a text encoder GGUF carries,
    each read as llama.cpp types it (formats/gguf.metadata_value: integers, float32 for the rope base and the
    epsilon; head counts also per layer, all equal) and within the text config's limits (TEXT_LIMITS), so that a
    forged value is one line naming the key. `layers`: the decoder layers the file holds (a per-layer array has one
    entry each)."""
    from ..formats.gguf import metadata_value  # heavy: formats.gguf imports the gguf package (~0.7 s)
    arch = gguf_architecture(metadata, model_type)
    if arch is None:
        return {}
    out = {}
    for key, ours in {**GGUF_METADATA, **GGUF_SHAPE_KEYS}.items():
        limit = TEXT_LIMITS.get(ours, between(1, MAX_WIDTH))
        value = metadata_value(metadata, f"{arch}.{key}", "float" if key in GGUF_FLOATS else "int", lo=limit.lo,
                               hi=limit.hi, gt=limit.gt, per_layer=layers if key in GGUF_PER_LAYER else None)
        if value is not None:
            out[key] = value
    return out


def _gguf_agrees(meta, arch, shape_values) -> None:
    """The GGUF hyperparameters that the shapes also give must be what the shapes give."""
    for key, (value, what) in shape_values.items():
        if key in meta and meta[key] != value:
            raise MlxdiffError(f"GGUF metadata {arch}.{key} is {meta[key]}, but {what} {value}; the metadata does "
                               "not describe these tensors; re-download or re-convert the file")


# what config_from_file's refusal advises where the shapes cannot say the settings (a reader of files without a
# pipeline folder gives its own advice)
FOLDER_CONFIG_HINT = "put the model's config.json in the pipeline folder's text_encoder/"


def config_from_file(shapes: dict, metadata=None, base=None, expected=None, kind="FLUX.2",
                     config_hint=FOLDER_CONFIG_HINT) -> dict:
    """A text encoder config (as text_encoder/config.json has it, plus file_layers) from one file's tensor shapes
    ({stored name: shape-like}), in transformers / ComfyUI or llama.cpp names. Widths, layers, heads and (Qwen3)
    head_dim come from the shapes; the rest from the GGUF `metadata`, the folder's config `base` (when it is the same
    kind of model), else KNOWN_MODELS. `expected`: the class the pipeline's text encoder must be. `kind`: the
    encoder's name in the refusal of a file that is none; `config_hint`: what gives the settings its shapes cannot (a
    reader without a pipeline folder says its own). Errors name no file (the caller does)."""
    mapped = remap(shapes, KEYMAP)
    layers = sorted({int(k.split(".")[1]) for k in mapped if k.startswith("layers.")})
    if "embed_tokens.weight" not in mapped or not layers:
        names = ", ".join(sorted(shapes)[:4]) or "no tensors"
        raise MlxdiffError(f"not a {kind} text encoder in a naming mlxdiff reads (transformers / ComfyUI "
                           f"'model.embed_tokens.weight', 'model.layers.N.*', or llama.cpp's 'token_embd.weight', "
                           f"'blk.N.*'); its tensors are {names}")
    count = layers[-1] + 1
    if layers != list(range(count)):
        gap = sorted(set(range(count)) - set(layers))[0]
        raise MlxdiffError(f"decoder layer {gap} is missing (the file has layers up to {count - 1})")

    def shape(key):
        if key not in mapped:
            raise MlxdiffError(f"tensor for {key} is missing; not a Mistral or Qwen3 decoder")
        return tuple(mapped[key].shape)

    vocab, hidden = shape("embed_tokens.weight")
    q_out, q_in = shape("layers.0.self_attn.q_proj.weight")
    kv_out = shape("layers.0.self_attn.k_proj.weight")[0]
    inter = shape("layers.0.mlp.gate_proj.weight")[0]
    qwen = "layers.0.self_attn.q_norm.weight" in mapped
    model_type = "qwen3" if qwen else "mistral3"
    if expected is not None and ARCHITECTURES[model_type] != expected:
        raise MlxdiffError(f"a {'Qwen3' if qwen else 'Mistral'} decoder ({ARCHITECTURES[model_type]}), but this "
                           f"pipeline's text encoder is a {expected}; give the encoder of the model's own family")
    if q_in != hidden:
        raise MlxdiffError(f"q_proj takes {q_in} features but the embedding gives {hidden}; the file is inconsistent")
    base = base if isinstance(base, dict) and base.get("model_type") == model_type else {}
    text_base = (base.get("text_config") or {}) if model_type == "mistral3" else base
    text = {k: v for k, v in text_base.items() if k not in NOT_TEXT}
    known = next((values for _, kind, match, values in KNOWN_MODELS if kind == model_type
                  and match == {"hidden_size": hidden, "vocab_size": vocab}), {})
    gguf = metadata is not None   # a GGUF's metadata (maybe empty); None for safetensors
    metadata = metadata or {}
    meta = gguf_values(metadata, model_type, count)
    arch = metadata.get("general.architecture")   # checked by gguf_values: absent or this kind's
    for key, ours in GGUF_METADATA.items():
        if key in meta:
            text[ours] = meta[key]
    head_source = f"GGUF metadata {arch}.attention.key_length" if "attention.key_length" in meta else None
    for key in ("rope_theta", "rms_norm_eps", "max_position_embeddings", "head_dim"):
        if text.get(key) is None and known.get(key) is not None:
            text[key] = known[key]
    if qwen:
        text["head_dim"] = shape("layers.0.self_attn.q_norm.weight")[0]
        _gguf_agrees(meta, arch, {"attention.key_length": (text["head_dim"], "q_norm's length (the head size) is")})
    elif "attention.key_length" not in meta and "attention.head_count" in meta:
        heads = meta["attention.head_count"]
        if q_out % heads:
            raise MlxdiffError(f"GGUF metadata {arch}.attention.head_count is {heads}, which does not divide q_proj's "
                               f"{q_out} rows into heads; re-download or re-convert the file")
        text["head_dim"] = q_out // heads
        head_source = f"GGUF metadata {arch}.attention.head_count"
    missing = [k for k in ("head_dim", "rope_theta", "rms_norm_eps") if text.get(k) is None
               and not (k == "rope_theta" and (text.get("rope_parameters") or {}).get("rope_theta"))]
    if missing:
        kinds = "; ".join(f"{name}: hidden {m['hidden_size']}, vocab {m['vocab_size']}" for name, kind, m, _ in
                          KNOWN_MODELS if kind == model_type)
        note = ""
        if gguf and arch is None:
            note = " (the GGUF metadata has no general.architecture, the prefix of its hyperparameters' keys)"
        elif gguf:
            keys = {"head_dim": ("attention.key_length", "attention.head_count"), "rope_theta": ("rope.freq_base",),
                    "rms_norm_eps": ("attention.layer_norm_rms_epsilon",)}
            note = " (the GGUF metadata has no " + " or ".join(f"{arch}.{k}" for m in missing for k in keys[m]) + ")"
        raise MlxdiffError(f"its shapes ({'Qwen3' if qwen else 'Mistral'}: hidden {hidden}, vocab {vocab}, {count} "
                           f"layers) fit no known model ({kinds}), so {', '.join(missing)} cannot be told{note}; "
                           + config_hint)
    head_dim = text["head_dim"]
    source = f" (from {head_source})" if head_source else ""
    if q_out % head_dim or kv_out % head_dim or (q_out // head_dim) % (kv_out // head_dim):
        raise MlxdiffError(f"q_proj's {q_out} and k_proj's {kv_out} rows are not whole heads of head_dim "
                           f"{head_dim}{source}")
    if head_dim % 2:
        raise MlxdiffError(f"head_dim {head_dim}{source} is odd; the head size must be even (RoPE rotates pairs of "
                           "channels)")
    _gguf_agrees(meta, arch, {
        "attention.head_count": (q_out // head_dim, f"q_proj's {q_out} rows in heads of {head_dim} are"),
        "attention.head_count_kv": (kv_out // head_dim, f"k_proj's {kv_out} rows in heads of {head_dim} are"),
        "attention.value_length": (head_dim, "the head size is"),
        "embedding_length": (hidden, "the embedding's width is"),
        "feed_forward_length": (inter, "gate_proj's rows are"),
        "vocab_size": (vocab, "the embedding's rows are"),
        "block_count": (count, "the file's decoder layers are")})
    full = max(count, text.get("num_hidden_layers") or 0, known.get("num_hidden_layers") or 0)
    text.update(hidden_size=hidden, vocab_size=vocab, intermediate_size=inter, num_hidden_layers=full,
                num_attention_heads=q_out // head_dim, num_key_value_heads=kv_out // head_dim)
    if text.get("layer_types") is not None and len(text["layer_types"]) != full:
        text.pop("layer_types")
    if qwen:
        text.update(model_type="qwen3", tie_word_embeddings=bool(text.get("tie_word_embeddings", False)))
        text.setdefault("max_position_embeddings", MAX_POSITIONS)
        return {**text, "architectures": [ARCHITECTURES["qwen3"]], "file_layers": count}
    if "layers.0.self_attn.q_proj.bias" in mapped:
        text["attention_bias"] = True
    if "sliding_window" not in text:   # MistralConfig's 4096 only applies to a folder config that omits it
        text["sliding_window"] = 4096 if text_base and "sliding_window" not in text_base else None
    text["model_type"] = "mistral"
    return {"model_type": "mistral3", "architectures": [ARCHITECTURES["mistral3"]], "text_config": text,
            "file_layers": count}


def gguf_is_permuted(metadata, config) -> bool:
    """Whether a GGUF file's q/k rows are in llama.cpp's rotary order: llama-arch files are (Mistral included),
    Qwen3's are not; a file without general.architecture is taken by its kind."""
    arch = metadata.get("general.architecture")
    return arch in GGUF_PERMUTED if arch is not None else config.get("model_type") == "mistral3"


def unpermute_index(rows: int, heads: int) -> np.ndarray:
    """Row order that undoes convert_hf_to_gguf.py's LlamaModel.permute: W = W_gguf[index]."""
    return np.arange(rows).reshape(heads, rows // heads // 2, 2).swapaxes(1, 2).reshape(-1)


def take_rows(value, index):
    """Rows `index` of a weight, kept in its form (array, QuantizedTensor or RawBlocks), lazily."""
    index = mx.array(index.astype(np.int32))
    if isinstance(value, RawBlocks):
        return dataclasses.replace(value, blocks=mx.take(value.blocks, index, axis=0))
    if isinstance(value, QuantizedTensor):
        return dataclasses.replace(value, **{a: mx.take(getattr(value, a), index, axis=0)
                                             for a in ("weight", "scales", "biases")})
    return mx.take(value, index, axis=0)


def gguf_unpermute(weights: dict, heads: int, kv_heads: int) -> dict:
    """A llama-arch GGUF's tensors with the q/k rows put back in transformers' order (ComfyUI-GGUF's llama_permute)."""
    out = dict(weights)
    for name, value in weights.items():
        parts = name.split(".")
        if len(parts) == 4 and parts[0] == "blk" and parts[2] in ("attn_q", "attn_k"):
            n = heads if parts[2] == "attn_q" else kv_heads
            out[name] = take_rows(value, unpermute_index(value.shape[0], n))
    return out
