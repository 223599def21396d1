"""T5 encoder (transformers' `T5EncoderModel`, modeling_t5.py) in MLX: SD3's text_encoder_3, T5 v1.1 XXL.

Pre-norm blocks with T5's RMSNorm (variance in float32, no mean, no bias), attention without 1/sqrt(d) scaling plus
a bucketed relative position bias that only block 0 owns and every block reuses, and a gated-gelu feed-forward
(gelu_new = tanh GELU). No biases anywhere. The token embedding is `shared.weight`; transformers ties
`encoder.embed_tokens.weight` to it, so either key is accepted and only one array is ever kept.

float16: transformers keeps `wo` in float32 (`_keep_in_fp32_modules`) and clamps float16 hidden states that reach
inf; both are reproduced (see T5DenseGatedActDense and clamp_fp16), so the residual stream leaves float16 after
block 0's feed-forward exactly as it does in transformers.
"""

import math
import re
from dataclasses import dataclass

import numpy as np

import mlx.core as mx
import mlx.nn as nn

from ..config_checks import (MAX_HEAD_DIM, MAX_HEADS, MAX_LAYERS, MAX_POSITIONS, MAX_VOCAB, MAX_WIDTH, CheckedArgs,
                             Rule, between, positive)
from ..errors import MlxdiffError
from ..formats.keymaps import remap
from .sharding import check_counts, divides_all, shard_layer


# transformers' ACT2FN names -> functions
ACTIVATIONS = {
    "gelu_new": nn.gelu_approx,           # 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
    "gelu_pytorch_tanh": nn.gelu_approx,
    "gelu": nn.gelu,                      # exact erf
    "relu": nn.relu,
    "silu": nn.silu,
}


def _ff_parts(feed_forward_proj) -> list:
    """'ACT' or 'gated-ACT' -> its parts, as T5Config splits it."""
    return feed_forward_proj.split("-")


def _ff_valid(feed_forward_proj) -> bool:
    parts = _ff_parts(feed_forward_proj)
    return len(parts) == 1 or (len(parts) == 2 and parts[0] == "gated")


CLASS_NAMES = ("T5EncoderModel",)   # transformers' class: its key in models/registry.ARCHITECTURES


@dataclass
class ModelArgs(CheckedArgs):
    """T5Config fields (defaults: google/t5-v1_1-xxl, the SD3 text_encoder_3)."""
    vocab_size: int = 32128
    d_model: int = 4096
    d_kv: int = 64
    d_ff: int = 10240
    num_layers: int = 24
    num_heads: int = 64
    relative_attention_num_buckets: int = 32
    relative_attention_max_distance: int = 128
    layer_norm_epsilon: float = 1e-6
    feed_forward_proj: str = "gated-gelu"
    # Derived from feed_forward_proj as T5Config does, unless config.json states them (then those win, as there)
    dense_act_fn: str | None = None
    is_gated_act: bool | None = None

    WHAT = "T5 text encoder config"
    LIMITS = {
        "vocab_size": between(1, MAX_VOCAB),
        "d_model": between(1, MAX_WIDTH),
        "d_kv": between(1, MAX_HEAD_DIM),
        "d_ff": between(1, MAX_WIDTH),
        "num_layers": between(1, MAX_LAYERS),
        "num_heads": between(1, MAX_HEADS),
        "relative_attention_num_buckets": between(2, 1024),
        "relative_attention_max_distance": between(1, MAX_POSITIONS),
        "layer_norm_epsilon": positive(1),
    }
    RULES = (
        Rule("feed_forward_proj", lambda a: _ff_valid(a.feed_forward_proj),
             lambda a: "expected 'ACT' or 'gated-ACT'"),
        Rule("dense_act_fn", lambda a: a.dense_act_fn in ACTIVATIONS,
             lambda a: "expected one of " + ", ".join(sorted(ACTIVATIONS))
                       + " (it comes from feed_forward_proj unless given)"),
        Rule("num_heads", lambda a: a.num_heads * a.d_kv <= MAX_WIDTH,
             lambda a: f"num_heads * d_kv (the attention width) must be at most {MAX_WIDTH}"),
    )

    def __post_init__(self):
        parts = _ff_parts(self.feed_forward_proj)
        if self.dense_act_fn is None:
            self.dense_act_fn = "gelu_new" if self.feed_forward_proj == "gated-gelu" else parts[-1]
        if self.is_gated_act is None:
            self.is_gated_act = parts[0] == "gated"


MAX_TOKENS = 512      # the longest prompt SD3.5 gives it (diffusers' max_sequence_length is at most 512)

# Keys a T5 file may carry that the encoder does not use. transformers' T5EncoderModel ignores `decoder.*`
# (_keys_to_ignore_on_load_unexpected); lm_head belongs to the full seq2seq model.
ORIGINAL_KEYMAP = [
    (r"decoder\..*", None),
    (r"lm_head\.weight", None),
]

# llama.cpp's T5 encoder GGUF names (city96's t5-v1_1-xxl-encoder-*.gguf; ComfyUI-GGUF's T5_SD_MAP) -> transformers'
GGUF_KEYMAP = [
    (r"token_embd\.weight", "shared.weight"),
    (r"enc\.output_norm\.weight", "encoder.final_layer_norm.weight"),
    *[(rf"enc\.blk\.(\d+)\.{gguf}\.weight", rf"encoder.block.\1.{ours}.weight") for gguf, ours in (
        ("attn_q", "layer.0.SelfAttention.q"), ("attn_k", "layer.0.SelfAttention.k"),
        ("attn_v", "layer.0.SelfAttention.v"), ("attn_o", "layer.0.SelfAttention.o"),
        ("attn_rel_b", "layer.0.SelfAttention.relative_attention_bias"), ("attn_norm", "layer.0.layer_norm"),
        ("ffn_gate", "layer.1.DenseReluDense.wi_0"), ("ffn_up", "layer.1.DenseReluDense.wi_1"),
        ("ffn_down", "layer.1.DenseReluDense.wo"), ("ffn_norm", "layer.1.layer_norm"))],
    (r"dec\..*|output\.weight", None),
]


def is_gguf_naming(names) -> bool:
    return any(n.startswith("enc.blk.") for n in names)


def from_gguf(weights: dict) -> dict:
    """A T5 encoder GGUF's tensors in transformers' names, kept quantized (an embedding kept as the file's blocks
    becomes a RawEmbedding, which decodes only the looked-up rows: formats/gguf.use_raw_layers)."""
    return remap(weights, GGUF_KEYMAP)


def clamp_fp16(x):
    """transformers' fp16 guard in T5Block: if any value is inf, clamp everything to +-(max - 1000)."""
    if x.dtype != mx.float16:
        return x
    limit = float(np.finfo(np.float16).max)
    bound = mx.where(mx.isinf(x).any(), limit - 1000, limit).astype(mx.float16)
    return mx.clip(x, -bound, bound)


class T5LayerNorm(nn.Module):
    def __init__(self, dims: int, eps: float):
        super().__init__()
        self.weight = mx.ones((dims,))
        self.eps = eps

    def __call__(self, x, dtype):
        x32 = x.astype(mx.float32)
        normed = x32 * mx.rsqrt(mx.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.weight * normed.astype(dtype)


def relative_position_buckets(query_length: int, key_length: int, num_buckets: int, max_distance: int) -> np.ndarray:
    """(q, k) int32 buckets of key_pos - query_pos, bidirectional, exactly as T5Attention._relative_position_bucket:
    half the buckets per sign, exact below num_buckets/4, then log-spaced up to max_distance (float32 log, truncated)."""
    relative = np.arange(key_length)[None, :] - np.arange(query_length)[:, None]
    half = num_buckets // 2
    buckets = (relative > 0).astype(np.int64) * half
    distance = np.abs(relative)
    max_exact = half // 2
    # distance 0 takes the exact branch; 1 in its place only keeps log() finite
    scaled = (np.log(np.maximum(distance, 1).astype(np.float32) / np.float32(max_exact))
              / np.float32(math.log(max_distance / max_exact)) * np.float32(half - max_exact))
    large = np.minimum(max_exact + scaled.astype(np.int64), half - 1)
    return (buckets + np.where(distance < max_exact, distance, large)).astype(np.int32)


class T5Attention(nn.Module):
    def __init__(self, args: ModelArgs, has_relative_attention_bias: bool):
        super().__init__()
        inner = args.num_heads * args.d_kv
        self.num_heads = args.num_heads
        self.num_buckets = args.relative_attention_num_buckets
        self.max_distance = args.relative_attention_max_distance
        self.q = nn.Linear(args.d_model, inner, bias=False)
        self.k = nn.Linear(args.d_model, inner, bias=False)
        self.v = nn.Linear(args.d_model, inner, bias=False)
        self.o = nn.Linear(inner, args.d_model, bias=False)
        if has_relative_attention_bias:
            self.relative_attention_bias = nn.Embedding(self.num_buckets, self.num_heads)

    def position_bias(self, length: int, dtype):
        buckets = relative_position_buckets(length, length, self.num_buckets, self.max_distance)
        values = self.relative_attention_bias(mx.array(buckets))  # (q, k, heads)
        return values.transpose(2, 0, 1)[None].astype(dtype)

    def __call__(self, x, position_bias):
        b, n, _ = x.shape
        heads = lambda t: t.reshape(b, n, self.num_heads, -1).transpose(0, 2, 1, 3)
        q, k, v = heads(self.q(x)), heads(self.k(x)), heads(self.v(x))
        # T5 folds the scale into its weights: no 1/sqrt(d). The bias (with a padding mask when one is given) is
        # added to the scores.
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=1.0, mask=position_bias)
        return self.o(out.transpose(0, 2, 1, 3).reshape(b, n, -1))


class T5LayerSelfAttention(nn.Module):
    def __init__(self, args: ModelArgs, has_relative_attention_bias: bool):
        super().__init__()
        self.SelfAttention = T5Attention(args, has_relative_attention_bias)
        self.layer_norm = T5LayerNorm(args.d_model, args.layer_norm_epsilon)

    def __call__(self, x, position_bias, dtype):
        return x + self.SelfAttention(self.layer_norm(x, dtype), position_bias)


def _wo_input(h):
    # transformers keeps wo in float32 when the model runs in float16 (the XXL feed-forward output overflows
    # float16), so its input is upcast and the block's output, and from then on the residual stream, is float32
    return h.astype(mx.float32) if h.dtype == mx.float16 else h


class T5DenseGatedActDense(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.wi_0 = nn.Linear(args.d_model, args.d_ff, bias=False)
        self.wi_1 = nn.Linear(args.d_model, args.d_ff, bias=False)
        self.wo = nn.Linear(args.d_ff, args.d_model, bias=False)
        self.act = ACTIVATIONS[args.dense_act_fn]

    def __call__(self, x):
        return self.wo(_wo_input(self.act(self.wi_0(x)) * self.wi_1(x)))


class T5DenseActDense(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.wi = nn.Linear(args.d_model, args.d_ff, bias=False)
        self.wo = nn.Linear(args.d_ff, args.d_model, bias=False)
        self.act = ACTIVATIONS[args.dense_act_fn]

    def __call__(self, x):
        return self.wo(_wo_input(self.act(self.wi(x))))


class T5LayerFF(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.DenseReluDense = T5DenseGatedActDense(args) if args.is_gated_act else T5DenseActDense(args)
        self.layer_norm = T5LayerNorm(args.d_model, args.layer_norm_epsilon)

    def __call__(self, x, dtype):
        return x + self.DenseReluDense(self.layer_norm(x, dtype))


class T5Block(nn.Module):
    def __init__(self, args: ModelArgs, has_relative_attention_bias: bool):
        super().__init__()
        self.layer = [T5LayerSelfAttention(args, has_relative_attention_bias), T5LayerFF(args)]

    def __call__(self, x, position_bias, dtype):
        x = clamp_fp16(self.layer[0](x, position_bias, dtype))
        return clamp_fp16(self.layer[1](x, dtype))


class T5Stack(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.block = [T5Block(args, has_relative_attention_bias=(i == 0)) for i in range(args.num_layers)]
        self.final_layer_norm = T5LayerNorm(args.d_model, args.layer_norm_epsilon)


def _split_counts(args: ModelArgs) -> dict:
    """What Model.shard splits over the ranks: {config name: (count, unit)}."""
    return {"num_heads": (args.num_heads, " heads"), "d_ff": (args.d_ff, "")}


def shards_evenly(args: ModelArgs, n: int) -> bool:
    """Whether Model.shard can split this encoder over n ranks (loading/tensor_parallel.shardable)."""
    return divides_all(_split_counts(args), n)


def check_shardable(args: ModelArgs, n: int) -> None:
    """Whether Model.shard can split this encoder over n ranks, else one line; checked before anything is read."""
    check_counts("T5 text encoder", _split_counts(args), n)


class Model(nn.Module):
    """T5EncoderModel. `model(input_ids)` -> last_hidden_state (B, T, d_model), after the final RMSNorm."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.compute_dtype = mx.float32
        self.shared = nn.Embedding(args.vocab_size, args.d_model)
        self.encoder = T5Stack(args)

    def __call__(self, input_ids, attention_mask=None):
        """attention_mask: (B, L) of 0 / 1 or None; the 0 tokens are left out as keys, as transformers' T5 does
        with it (Chroma passes the tokenizer's; SD3 and FLUX.1 pass none)."""
        input_ids = mx.array(input_ids)
        if input_ids.ndim == 1:
            input_ids = input_ids[None]
        dtype = self.compute_dtype
        x = self.shared(input_ids).astype(dtype)
        # block 0 computes the bias; every block reuses it
        bias = self.encoder.block[0].layer[0].SelfAttention.position_bias(input_ids.shape[-1], dtype)
        if attention_mask is not None:     # transformers: (1 - mask) * the dtype's min, added to the bias
            keep = mx.array(attention_mask).reshape(input_ids.shape[0], 1, 1, -1)
            bias = bias + (1 - keep.astype(dtype)) * mx.finfo(dtype).min
        for block in self.encoder.block:
            x = block(x, bias, dtype)
        return self.encoder.final_layer_norm(x, dtype)

    def resident_blocks(self) -> tuple:
        return ("encoder.block.0",)     # its relative attention bias is read before the blocks run

    def activation_bytes(self, compute_dtype) -> int:
        """The most its forward holds in activations, at MAX_TOKENS: the stream, q/k/v/attention output, the scores
        and the bias, the feed-forward's two inputs and their product, in the compute dtype (float32 from the
        feed-forward output on under float16)."""
        a, n = self.args, MAX_TOKENS
        inner = a.num_heads * a.d_kv
        values = n * a.d_model * 2 + 4 * n * inner + 2 * a.num_heads * n * n + 3 * n * a.d_ff
        return values * max(compute_dtype.size, 4 if compute_dtype == mx.float16 else 0)

    def shard(self, group):
        """Tensor-parallel over `group`, the scheme of models/text_llm.py's shard: in every block q/k/v and the
        feed-forward input(s) split by output rows, o and wo by input columns with one all_sum each, the heads
        divided, and the relative attention bias table keeps this rank's heads' columns. The embedding and norms
        stay whole on every rank."""
        n, rank = group.size(), group.rank()
        check_shardable(self.args, n)
        for i, block in enumerate(self.encoder.block):
            attn, ff, where = block.layer[0].SelfAttention, block.layer[1].DenseReluDense, f"T5 encoder.block.{i}"
            for name in ("q", "k", "v"):
                setattr(attn, name, shard_layer(getattr(attn, name), "all-to-sharded", group,
                                                f"{where}.layer.0.SelfAttention.{name}"))
            attn.o = shard_layer(attn.o, "sharded-to-all", group, f"{where}.layer.0.SelfAttention.o")
            if "relative_attention_bias" in attn:
                table = attn.relative_attention_bias
                if type(table) is not nn.Embedding:
                    raise MlxdiffError(f"tensor-parallel split: {where}'s relative attention bias is a "
                                       f"{type(table).__name__}, which is not split; use --split guidance")
                heads = attn.num_heads // n
                table.weight = table.weight[:, rank * heads:(rank + 1) * heads]
            attn.num_heads //= n
            for name in ("wi_0", "wi_1", "wi"):
                if name in ff:
                    setattr(ff, name, shard_layer(getattr(ff, name), "all-to-sharded", group,
                                                  f"{where}.layer.1.DenseReluDense.{name}"))
            ff.wo = shard_layer(ff.wo, "sharded-to-all", group, f"{where}.layer.1.DenseReluDense.wo")

    def sanitize(self, weights: dict) -> dict:
        weights = remap(weights, ORIGINAL_KEYMAP)
        # encoder.embed_tokens is tied to shared: keep one (lazy arrays, so the other is never read)
        tied = weights.pop("encoder.embed_tokens.weight", None)
        if tied is not None:
            weights.setdefault("shared.weight", tied)
        return weights


def config_from_weights(weights: dict) -> dict:
    """The T5Config of an original single file (`t5xxl_fp16.safetensors`: `shared.weight`, `encoder.block.N...`).

    diffusers does not infer this: `create_diffusers_t5_model_from_checkpoint` loads the text_encoder_3 config of the
    detected SD3 repo (google/t5-v1_1-xxl's: gated-gelu, 32 buckets, max distance 128, eps 1e-6). Here every size
    comes from the tensor shapes (vocab and d_model from the embedding, heads and buckets from the relative bias,
    d_kv = q rows / heads, d_ff from wi_0, layers counted); the rest are those T5 v1.1 values.
    """
    def shape(key):
        if key not in weights:
            raise MlxdiffError(f"T5 weights: key {key!r} is missing; this is not a T5 encoder file "
                               "(expected shared.weight and encoder.block.N.* names)")
        found = tuple(weights[key].shape)
        if len(found) != 2 or not all(found):   # every tensor read here is a matrix
            raise MlxdiffError(f"T5 weights: tensor {key!r} has shape {list(found)}; expected 2 non-zero dimensions")
        return found

    embed = "shared.weight" if "shared.weight" in weights else "encoder.embed_tokens.weight"
    vocab, d_model = shape(embed)
    found = {int(m.group(1)) for k in weights
             if (m := re.fullmatch(r"encoder\.block\.(\d+)\.layer\.0\.SelfAttention\.q\.weight", k))}
    if not found or found != set(range(len(found))):
        raise MlxdiffError(f"T5 weights: encoder block indices {sorted(found)} are not 0..N-1; the file is "
                           "incomplete or not a T5 encoder")
    buckets, heads = shape("encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight")
    inner = shape("encoder.block.0.layer.0.SelfAttention.q.weight")[0]
    gated = "encoder.block.0.layer.1.DenseReluDense.wi_0.weight" in weights
    d_ff = shape("encoder.block.0.layer.1.DenseReluDense." + ("wi_0" if gated else "wi") + ".weight")[0]
    return dict(vocab_size=vocab, d_model=d_model, d_kv=inner // heads, d_ff=d_ff, num_layers=len(found),
                num_heads=heads, relative_attention_num_buckets=buckets, relative_attention_max_distance=128,
                layer_norm_epsilon=1e-6, feed_forward_proj="gated-gelu" if gated else "relu")
