"""Chroma transformer: diffusers' ChromaTransformer2DModel (models/transformers/transformer_chroma.py) in MLX.

Chroma (lodestones/Chroma1-HD, Chroma1-Base, the chroma-unlocked files) is FLUX.1-schnell's DiT with its 3.3 B of
per-block modulation layers pruned: one small network, the distilled guidance approximator, maps (timestep, a zero
guidance, the index of each modulation vector) to every block's shift / scale / gate vectors at once, and no pooled
CLIP vector is taken (T5 only). The blocks, attention, RoPE and feed-forwards are FLUX.1's (models/flux1.py), with
one addition: the text tokens after the prompt and its first padding token are masked out as keys.

Modulation vectors, in the approximator's output order: 3 per single block, 6 per double block for the image stream,
6 per double block for the text stream, 2 for the output norm (shift, scale).
"""

import re
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from ..config_checks import MAX_LAYERS, MAX_WIDTH, Rule, between
from ..errors import MlxdiffError
from ..formats.keymaps import compile_rules, remap, under_prefix_if_present
from ..pacing import pace
from . import flux1
from .embeddings import TextProjection, timestep_embedding
from .flux2 import clip_fp16, scaled_time
from .fused import compiled_block, double_stream, gated_residual, norm_modulate
from .mmdit import FeedForward

EPS = flux1.EPS
MLP_RATIO = flux1.MLP_RATIO

CLASS_NAMES = ("ChromaTransformer2DModel",)   # diffusers' class: its key in models/registry.ARCHITECTURES


@dataclass
class ModelArgs(flux1.ModelArgs):
    # defaults: lodestones/Chroma1-HD transformer/config.json (diffusers' class defaults)
    approximator_num_channels: int = 64      # its input: 1/4 timestep, 1/4 guidance, 1/2 modulation index sinusoids
    approximator_hidden_dim: int = 5120
    approximator_layers: int = 5
    pooled_projection_dim: int = 0           # no pooled CLIP vector (FLUX.1's field, unused here)
    guidance_embeds: bool = False            # no guidance embedding (the approximator gets a zero guidance)

    WHAT = "Chroma transformer config"
    LIMITS = {**{k: v for k, v in flux1.ModelArgs.LIMITS.items() if k != "pooled_projection_dim"},
              "approximator_num_channels": between(4, MAX_WIDTH),
              "approximator_hidden_dim": between(1, MAX_WIDTH),
              "approximator_layers": between(0, MAX_LAYERS)}
    RULES = flux1.ModelArgs.RULES + (
        Rule("approximator_num_channels", lambda a: a.approximator_num_channels % 4 == 0,
             lambda a: "expected a multiple of 4 (a quarter each for the timestep and guidance sinusoids, half for "
                       "the modulation index's)"),
    )

    @property
    def modulations(self) -> int:
        """How many modulation vectors the approximator gives: 3 per single block, 2 x 6 per double, 2 at the end."""
        return 3 * self.num_single_layers + 12 * self.num_layers + 2


class RMSNorm(nn.Module):
    """torch.nn.RMSNorm(dim) with its default eps: the machine epsilon of the input's dtype (diffusers'
    ChromaApproximator norms)."""

    def __init__(self, dim: int):
        super().__init__()
        self.weight = mx.ones((dim,))

    def __call__(self, x):
        return mx.fast.rms_norm(x, self.weight.astype(x.dtype), mx.finfo(x.dtype).eps)


class Approximator(nn.Module):
    """ChromaApproximator: in_proj, n residual (RMSNorm -> Linear -> SiLU -> Linear) layers, out_proj."""

    def __init__(self, in_dim: int, out_dim: int, hidden: int, n_layers: int):
        super().__init__()
        self.in_proj = nn.Linear(in_dim, hidden)
        self.layers = [TextProjection(hidden, hidden, act_fn="silu") for _ in range(n_layers)]
        self.norms = [RMSNorm(hidden) for _ in range(n_layers)]
        self.out_proj = nn.Linear(hidden, out_dim)

    def __call__(self, x):
        x = self.in_proj(x)
        for layer, norm in zip(self.layers, self.norms):
            x = x + layer(norm(x))
        return self.out_proj(x)


def approximator_input(timestep, channels: int, count: int):
    """ChromaCombinedTimestepTextProjEmbeddings: per batch row and modulation index i < count, [sinusoid(t),
    sinusoid(0) (the guidance, always 0), sinusoid(1000 i) (twice as wide)] -> (B, count, channels), in the
    timestep's dtype. timestep: (B,) already x 1000."""
    quarter = channels // 4
    sinusoid = lambda t, dim: timestep_embedding(t, dim, flip_sin_to_cos=True,
                                                 downscale_freq_shift=0).astype(timestep.dtype)
    b = timestep.shape[0]
    time_guidance = mx.concatenate([sinusoid(timestep, quarter), sinusoid(mx.zeros((b,)), quarter)], axis=-1)
    index = sinusoid(mx.arange(count).astype(mx.float32) * 1000, 2 * quarter)
    return mx.concatenate([mx.broadcast_to(time_guidance[:, None], (b, count, 2 * quarter)),
                           mx.broadcast_to(index[None], (b, count, 2 * quarter))], axis=-1)


def _norm(x, mod, i):
    """LayerNorm(x) * (1 + mod[i + 1]) + mod[i]: shift then scale, as the pruned adaLN layers read them."""
    return norm_modulate(x, mod[:, i + 1][:, None], mod[:, i][:, None], EPS)


class TransformerBlock(nn.Module):
    """ChromaTransformerBlock: FLUX.1's double-stream block with its modulation given (B, 12, D: the image stream's
    6, then the text stream's) instead of computed."""

    def __init__(self, dim: int, heads: int, head_dim: int):
        super().__init__()
        self.attn = flux1.Attention(dim, heads, head_dim, joint=True)
        self.ff = FeedForward(dim, MLP_RATIO)
        self.ff_context = FeedForward(dim, MLP_RATIO)

    def __call__(self, x, context, mod, cos, sin, mask):
        img, txt = mod[:, :6], mod[:, 6:]
        attn_out, context_attn_out = self.attn(_norm(x, img, 0), cos, sin, context=_norm(context, txt, 0), mask=mask)
        x = gated_residual(x, img[:, 2][:, None], attn_out)
        x = pace(gated_residual(x, img[:, 5][:, None], self.ff(_norm(x, img, 3))))
        context = gated_residual(context, txt[:, 2][:, None], context_attn_out)
        context = pace(gated_residual(context, txt[:, 5][:, None], self.ff_context(_norm(context, txt, 3))))
        return clip_fp16(context), x


class SingleTransformerBlock(nn.Module):
    """ChromaSingleTransformerBlock: FLUX.1's single-stream block with its (shift, scale, gate) given."""

    def __init__(self, dim: int, heads: int, head_dim: int):
        super().__init__()
        self.proj_mlp = nn.Linear(dim, MLP_RATIO * dim)
        self.proj_out = nn.Linear(dim + MLP_RATIO * dim, dim)
        self.attn = flux1.Attention(dim, heads, head_dim, joint=False)

    def __call__(self, h, mod, cos, sin, mask):
        normed = _norm(h, mod, 0)
        attn = self.attn(normed, cos, sin, mask=mask)
        mlp = pace(nn.gelu_approx(self.proj_mlp(normed)))
        out = self.proj_out(mx.concatenate([attn, mlp], axis=-1))
        return clip_fp16(gated_residual(h, mod[:, 2][:, None], out))


# the approximator, the embedders and the output layer stay in full precision (loading/quantize.py)
FULL_PRECISION = re.compile(r"(x_embedder|context_embedder|distilled_guidance_layer\..*|proj_out)")


class Model(flux1.Model):
    """ChromaTransformer2DModel. FLUX.1's Model (its rope, shard and layer names) with the approximator in place of
    the per-block modulation layers.

    __call__(hidden_states (B, N_img, C) packed 2x2 latents, encoder_hidden_states (B, L_txt, J) T5 features,
    timestep (B,) = sigma in [0, 1], img_ids (N_img, 3), txt_ids (L_txt, 3), text_mask (B, L_txt) of 0 / 1 or
    None: the text tokens that take part as keys (ChromaPipeline's: the prompt and its first padding token))
    -> (B, N_img, patch^2 * C_out).
    """

    def __init__(self, args: ModelArgs):
        nn.Module.__init__(self)
        self.args = args
        self.compute_dtype = mx.float32
        dim, heads, head_dim = args.width, args.num_attention_heads, args.attention_head_dim
        self.distilled_guidance_layer = Approximator(args.approximator_num_channels, dim,
                                                     args.approximator_hidden_dim, args.approximator_layers)
        self.context_embedder = nn.Linear(args.joint_attention_dim, dim)
        self.x_embedder = nn.Linear(args.in_channels, dim)
        self.transformer_blocks = [TransformerBlock(dim, heads, head_dim) for _ in range(args.num_layers)]
        self.single_transformer_blocks = [SingleTransformerBlock(dim, heads, head_dim)
                                          for _ in range(args.num_single_layers)]
        self.proj_out = nn.Linear(dim, args.patch_size * args.patch_size * (args.out_channels or args.in_channels))

    def modulations(self, timestep):
        """(B, modulations, D): every block's modulation vectors for this timestep, in the compute dtype."""
        a = self.args
        return self.distilled_guidance_layer(
            approximator_input(scaled_time(timestep, self.compute_dtype), a.approximator_num_channels, a.modulations))

    def __call__(self, hidden_states, encoder_hidden_states, timestep, img_ids, txt_ids, text_mask=None,
                 after_block=None, step_cache=None, stream_dtype=None):
        dtype = self.compute_dtype
        stream = stream_dtype or dtype
        b, n_img = hidden_states.shape[:2]
        n_txt = encoder_hidden_states.shape[1]
        n_single, n_double = self.args.num_single_layers, self.args.num_layers
        cos, sin = self.rope(img_ids, txt_ids)
        if cos.shape[0] != n_txt + n_img:
            raise MlxdiffError(f"position ids cover {cos.shape[0]} tokens but the inputs have {n_txt} text + {n_img} "
                               "image tokens; img_ids/txt_ids must match hidden_states/encoder_hidden_states")
        mask = None
        if text_mask is not None:     # keys only: a masked text token still attends (its output is never read)
            keys = mx.concatenate([text_mask.astype(mx.bool_), mx.ones((b, n_img), dtype=mx.bool_)], axis=1)
            mask = keys[:, None, None, :]
        mod = self.modulations(timestep)
        x = self.x_embedder(hidden_states.astype(dtype)).astype(stream)
        context = self.context_embedder(encoder_hidden_states.astype(dtype)).astype(stream)
        img_at, txt_at = 3 * n_single, 3 * n_single + 6 * n_double
        def block_args(i):   # the block's image and text modulation vectors, side by side
            return (mx.concatenate([mod[:, img_at + 6 * i:img_at + 6 * i + 6],
                                    mod[:, txt_at + 6 * i:txt_at + 6 * i + 6]], axis=1), cos, sin, mask)
        context, x, x_head, reused = double_stream(self.transformer_blocks, x, context, block_args, after_block,
                                                   step_cache)
        if reused is not None:
            return self.output(x + reused, mod)
        h = mx.concatenate([context, x], axis=1)
        for i, block in enumerate(self.single_transformer_blocks):
            h = compiled_block(block, h, mod[:, 3 * i:3 * i + 3], cos, sin, mask)
            if after_block:
                after_block(h)
        if step_cache is not None:
            step_cache.remember(h[:, n_txt:] - x_head)
        return self.output(h[:, n_txt:], mod)

    def output(self, x, mod):
        return self.proj_out(_norm(x, mod[:, -2:], 0))

    def quant_predicate(self, path, module) -> bool:
        """Which layers may be quantized: not the approximator, the embedders or the output layer."""
        return not FULL_PRECISION.fullmatch(path)


def check_shardable(args: ModelArgs, n: int) -> None:
    flux1.check_shardable(args, n)


# -- original names: lodestones' chroma files (FLUX.1's BFL names less the modulation layers) and their GGUFs -------

_P = flux1._P
ORIGINAL_PREFIX = flux1.ORIGINAL_PREFIX
FROM_BASE_CONFIG = flux1.FROM_BASE_CONFIG
# diffusers' convert_chroma_transformer_checkpoint_to_diffusers: FLUX.1's names, and the approximator's
_APPROXIMATOR_KEYMAP = [
    (_P + r"distilled_guidance_layer\.(in_proj|out_proj)\.(weight|bias)", r"distilled_guidance_layer.\1.\2"),
    (_P + r"distilled_guidance_layer\.layers\.(\d+)\.in_layer\.(weight|bias)",
     r"distilled_guidance_layer.layers.\1.linear_1.\2"),
    (_P + r"distilled_guidance_layer\.layers\.(\d+)\.out_layer\.(weight|bias)",
     r"distilled_guidance_layer.layers.\1.linear_2.\2"),
    (_P + r"distilled_guidance_layer\.norms\.(\d+)\.scale", r"distilled_guidance_layer.norms.\1.weight"),
]
_APPROXIMATOR_RULES = compile_rules(_APPROXIMATOR_KEYMAP)
_ORIGINAL_RULES = _APPROXIMATOR_RULES + flux1._ORIGINAL_RULES     # the whole table (the protocol's OriginalFile)
_CHROMA_MARK = re.compile(_P + r"distilled_guidance_layer\.")
_GUIDANCE_LAYER = re.compile(r"distilled_guidance_layer\.layers\.(\d+)\.in_layer\.weight")

LORA_NAME = "Chroma transformer"
# Chroma's blocks are FLUX.1's under the same names, so FLUX.1-named LoRAs (kohya, PEFT, BFL, XLabs) are its LoRAs
LORA_ARCHITECTURE = "FLUX.1"     # its label in lora.ARCHITECTURES
LORA_ORDER = 40     # no rows (FLUX.1's tell its LoRAs): orders only lora's messages
LORA_ARCHITECTURE_PATTERNS = ()     # FLUX.1's names tell its LoRAs (flux1.py's rows)
lora_original_rules = flux1.lora_original_rules     # the same block names as FLUX.1's


def is_original(names) -> bool:
    """Whether tensor names are a Chroma file's original names (with or without ComfyUI's prefix)."""
    return any(_CHROMA_MARK.match(n) for n in names) and any(re.match(_P + "double_blocks\\.", n) for n in names)


def original_to_diffusers(weights: dict) -> dict:
    """Original names -> diffusers names (lazy: nothing is read)."""
    weights = under_prefix_if_present(weights, flux1.ORIGINAL_PREFIX)
    if not is_original(weights):
        raise MlxdiffError("not a Chroma original checkpoint: no distilled_guidance_layer.* and double_blocks.* keys")
    approximator = {k: v for k, v in weights.items() if k.startswith("distilled_guidance_layer.")}
    blocks = flux1.original_to_diffusers({k: v for k, v in weights.items() if k not in approximator}, check=False)
    return {**remap(approximator, _APPROXIMATOR_RULES), **blocks}


def config_from_original(weights: dict) -> dict:
    """The diffusers config of an original Chroma file from its names and shapes: FLUX.1's reading of the blocks,
    the approximator's sizes from its layers."""
    weights = under_prefix_if_present(weights, flux1.ORIGINAL_PREFIX)
    if not is_original(weights):
        raise MlxdiffError("not a Chroma original checkpoint: no distilled_guidance_layer.* and double_blocks.* keys")
    config = flux1.config_from_original(weights, check=False)
    hidden, channels = flux1._shape(weights, "distilled_guidance_layer.in_proj.weight")
    layers = sorted(int(m.group(1)) for k in weights if (m := _GUIDANCE_LAYER.fullmatch(k)))
    if layers != list(range(len(layers))):
        raise MlxdiffError(f"Chroma original checkpoint: distilled_guidance_layer.layers indices {layers[:8]} are not "
                           "0..n-1; the file is incomplete")
    for key in ("pooled_projection_dim", "guidance_embeds"):
        config.pop(key)
    return {**config, "approximator_num_channels": channels, "approximator_hidden_dim": hidden,
            "approximator_layers": len(layers)}
