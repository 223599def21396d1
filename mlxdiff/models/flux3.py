"""FLUX 3 Image Klein transformer: diffusers' Flux3Transformer2DModel (models/transformers/transformer_flux3.py) in MLX.

Attribute names mirror diffusers, so a diffusers checkpoint loads as it is (sanitize changes nothing: no convolutions).

Structure: three token modes (the noisy image tokens, the optional reference-image tokens, the text) each pass their
own per-mode blocks (`mode_blocks.image`, `mode_blocks.image_cond`, `txt_mode_blocks`: self-attention within the
mode only), then the joint single blocks run over [text; image; references] with each mode's own modulation, and
only the image tokens reach the output layers. Every block is one parallel attention + SwiGLU feed-forward from the
same modulated input (FLUX.2's pieces: its feed-forward, qk RMSNorm + 4-axis RoPE with adjacent pairs, LayerNorm
modulation, its output AdaLayerNorm; theta 10000 here). The modulation is per token in diffusers: the image tokens at
the flow timestep, the text and the references at timestep 0 (a flow-map checkpoint, the step-distilled one, adds the
embedding of the timestep each step jumps to to both). Since every token of a mode has the same timestep, the
modulation is computed once per mode, (B, 1, D), and broadcast: the same numbers as diffusers' (B, S, D) rows.
"""

import re
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from ..config_checks import MAX_WIDTH, CheckedArgs, between
from ..errors import MlxdiffError
from ..formats.keymaps import compile_rules, remap, required_shape, under_prefix_if_present
from ..pacing import pace
from .embeddings import TimestepEmbedding, timestep_embedding
from .flux2 import (AdaLayerNormContinuous, FeedForward, Modulation, StreamAttention, apply_rope, attention,
                    block_limits, block_rules, cached_rope, clip_fp16, modulate, scaled_time)
from .fused import compiled_block, cuda_kernels, gated_residual, norm_rope

MODES = ("image", "image_cond")     # the image token modes (diffusers' in_channels_per_mode), then "txt"

CLASS_NAMES = ("Flux3Transformer2DModel",)   # diffusers' class: its key in models/registry.ARCHITECTURES


@dataclass
class ModelArgs(CheckedArgs):
    # defaults: diffusers' class defaults (FLUX 3 Image Klein)
    in_channels: int = 128
    cond_in_channels: int = 128
    num_layers: int = 5                      # per-mode blocks (of each mode)
    num_single_layers: int = 28
    attention_head_dim: int = 128
    num_attention_heads: int = 24
    joint_attention_dim: int = 20480         # 8 stacked Qwen3-VL hidden states
    timestep_channels: int = 256
    mlp_ratio: float = 3.0
    axes_dims_rope: tuple[int, ...] = (32, 32, 32, 32)
    rope_theta: float = 10000
    eps: float = 1e-6
    flow_map: bool = False                   # step-distilled: a target_timestep_embedder

    WHAT = "FLUX 3 transformer config"
    LIMITS = {**block_limits("timestep_channels"), "cond_in_channels": between(1, MAX_WIDTH)}
    RULES = block_rules("timestep_channels")

    def __post_init__(self):
        self.axes_dims_rope = tuple(self.axes_dims_rope)


class ByMode(nn.Module):
    """diffusers' ModuleDict keyed by token mode, as a module (its entries are attributes, so that block paths such
    as `mode_blocks.image.3` resolve as any other: loading/streaming.py)."""

    def __init__(self, **entries):
        super().__init__()
        for name, entry in entries.items():
            setattr(self, name, entry)


class Attention(StreamAttention):
    """Flux3Attention: q, k, v of one sequence, qk RMSNorm, RoPE, SDPA, to_out (FLUX.2's layers of one stream)."""

    def __call__(self, x, cos, sin):
        q, k, v = (f(x).reshape(*x.shape[:2], self.heads, self.head_dim) for f in (self.to_q, self.to_k, self.to_v))
        # the qk norm and RoPE in float32 with one cast back, as diffusers (and BFL) run them for FLUX 3
        q, k = (norm_rope([(t.astype(mx.float32), n)], cos, sin, apply_rope).astype(v.dtype)
                for t, n in ((q, self.norm_q), (k, self.norm_k)))
        return self.to_out[0](pace(attention(q, k, v)))


class TransformerBlock(nn.Module):
    """Flux3ModeTransformerBlock and Flux3SingleTransformerBlock, which have the same layers: attention and
    feed-forward in parallel from one modulated input, x + gate * (attention + feed-forward). A mode block runs on
    one mode's tokens (x alone); a joint block on [context; x; cond], each part normed and modulated by its own
    modulation, attending together. Returns the parts given, in that order."""

    def __init__(self, dim: int, heads: int, head_dim: int, mlp_hidden: int, eps: float):
        super().__init__()
        self.eps = eps
        self.attn = Attention(dim, heads, head_dim, eps)
        self.ff = FeedForward(dim, mlp_hidden)

    def __call__(self, x, mod, cos, sin, context=None, context_mod=None, cond=None, cond_mod=None):
        parts = [(p, m) for p, m in ((context, context_mod), (x, mod), (cond, cond_mod)) if p is not None]
        normed = [modulate(p, m, self.eps) for p, m in parts]
        h = normed[0] if len(normed) == 1 else mx.concatenate(normed, axis=1)
        out = pace(self.attn(h, cos, sin) + self.ff(h))
        outs, start = [], 0
        for p, m in parts:
            outs.append(clip_fp16(gated_residual(p, m.gate, out[:, start:start + p.shape[1]])))
            start += p.shape[1]
        return tuple(outs)


# embedders, the modulations and the output layers stay in full precision (loading/quantize.py)
FULL_PRECISION = re.compile(r"(x_embedders\..*|context_embedder|(target_)?timestep_embedder\..*|.*modulations\..*|"
                            r"norm_out\.linear|proj_out)")


class Model(nn.Module):
    """Flux3Transformer2DModel.

    __call__(hidden_states (B, N_img, in_channels), encoder_hidden_states (B, L_txt, J), timestep (B,) = sigma in
    [0, 1] (scaled by 1000 here, as diffusers), img_ids (N_img, 4), txt_ids (L_txt, 4) (a batch axis is allowed:
    element 0 is used), image_cond_hidden_states (B, N_ref, cond_in_channels) and image_cond_ids (N_ref, 4) for
    reference images, target_timestep (B,): the timestep the step jumps to, by and only by a flow-map model) ->
    the image tokens' velocity (B, N_img, in_channels).
    `after_block(*outputs)`: called after every block (the caller's memory policy). `step_cache`: a
    pipelines/step_cache.BlockResiduals that may skip every block after the image tokens' first (it decides).
    `stream_dtype`: the residual streams' dtype when wider than the compute dtype.
    """

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.compute_dtype = mx.float32
        dim = args.num_attention_heads * args.attention_head_dim
        mlp_hidden = int(dim * args.mlp_ratio)
        block = (dim, args.num_attention_heads, args.attention_head_dim, mlp_hidden, args.eps)
        self.timestep_embedder = TimestepEmbedding(args.timestep_channels, dim, bias=False)
        if args.flow_map:
            self.target_timestep_embedder = TimestepEmbedding(args.timestep_channels, dim, bias=False)
        # Flux3Modulation is linear(silu(temb)) -> (shift, scale, gate): FLUX.2's Modulation of one set
        self.early_stream_modulations = ByMode(**{m: Modulation(dim, 1) for m in (*MODES, "txt")})
        self.single_stream_modulations = ByMode(**{m: Modulation(dim, 1) for m in (*MODES, "txt")})
        self.x_embedders = ByMode(image=nn.Linear(args.in_channels, dim, bias=False),
                                  image_cond=nn.Linear(args.cond_in_channels, dim, bias=False))
        self.context_embedder = nn.Linear(args.joint_attention_dim, dim, bias=False)
        self.mode_blocks = ByMode(**{m: [TransformerBlock(*block) for _ in range(args.num_layers)] for m in MODES})
        self.txt_mode_blocks = [TransformerBlock(*block) for _ in range(args.num_layers)]
        self.single_transformer_blocks = [TransformerBlock(*block) for _ in range(args.num_single_layers)]
        self.norm_out = AdaLayerNormContinuous(dim, args.eps)      # Flux3AdaLayerNorm: (scale, shift), no bias
        self.proj_out = nn.Linear(dim, args.in_channels, bias=False)

    def _embed(self, embedder, t):
        # the sinusoid is float32, cast to the (scaled) timestep's dtype before the MLP, as diffusers
        return embedder(timestep_embedding(t, self.args.timestep_channels, flip_sin_to_cos=True,
                                           downscale_freq_shift=0).astype(t.dtype))

    def rope(self, txt_ids, img_ids, cond_ids):
        """cos, sin (L_txt + N_img + N_ref, head_dim) of the joint sequence [text; image; references] (cached per
        set of ids: the same at every step)."""
        ids = img_ids if cond_ids is None else mx.concatenate([_ids2d(img_ids), _ids2d(cond_ids)], axis=0)
        return cached_rope(self, ids, txt_ids, self.args.axes_dims_rope, self.args.rope_theta, at_least=True)

    def __call__(self, hidden_states, encoder_hidden_states, timestep, img_ids, txt_ids,
                 image_cond_hidden_states=None, image_cond_ids=None, target_timestep=None, after_block=None,
                 step_cache=None, stream_dtype=None):
        if (image_cond_hidden_states is None) != (image_cond_ids is None):
            raise MlxdiffError("image_cond_hidden_states and image_cond_ids go together: give both or neither")
        if (target_timestep is not None) != self.args.flow_map:
            raise MlxdiffError("target_timestep is required by, and only by, a flow-map transformer "
                               f"(flow_map={self.args.flow_map})")
        dtype = self.compute_dtype
        stream = stream_dtype or dtype
        n_txt, n_img = encoder_hidden_states.shape[1], hidden_states.shape[1]
        n_ref = 0 if image_cond_hidden_states is None else image_cond_hidden_states.shape[1]
        cos, sin = self.rope(txt_ids, img_ids, image_cond_ids)
        if cos.shape[0] != n_txt + n_img + n_ref:
            raise MlxdiffError(f"position ids cover {cos.shape[0]} tokens but the inputs have {n_txt} text + {n_img} "
                               f"image + {n_ref} reference tokens; the ids must match the token sequences")
        txt_rope, img_rope = (cos[:n_txt], sin[:n_txt]), (cos[n_txt:n_txt + n_img], sin[n_txt:n_txt + n_img])
        ref_rope = (cos[n_txt + n_img:], sin[n_txt + n_img:])

        # the image tokens at `timestep`, the text and the references at 0 (+ the target's embedding: flow map)
        t = scaled_time(timestep, dtype)
        image_temb, zero_temb = self._embed(self.timestep_embedder, t), self._embed(self.timestep_embedder,
                                                                                    mx.zeros_like(t))
        if target_timestep is not None:
            target = self._embed(self.target_timestep_embedder, scaled_time(target_timestep, dtype))
            image_temb, zero_temb = image_temb + target, zero_temb + target
        early, single = self.early_stream_modulations, self.single_stream_modulations
        (img_early,), (img_single,) = early.image(image_temb), single.image(image_temb)
        (txt_early,), (txt_single,) = early.txt(zero_temb), single.txt(zero_temb)

        x = self.x_embedders.image(hidden_states.astype(dtype)).astype(stream)
        # the image tokens' per-mode blocks first (the modes never meet before the joint blocks, so the order is
        # free): a first-block cache decides after the first of them whether anything else runs
        x_head, reused = None, None
        for i, block in enumerate(self.mode_blocks.image):
            x_in = x
            (x,) = compiled_block(block, x, img_early, *img_rope)
            if after_block:
                after_block(x)
            if i == 0 and step_cache is not None:
                reused = step_cache.reuse(x - x_in)
                if reused is not None:
                    return self.proj_out(self.norm_out(x + reused, image_temb))
                x_head = x
        if x_head is None and step_cache is not None:      # no per-mode blocks: the cache sees the embedding
            reused = step_cache.reuse(x)
            if reused is not None:
                return self.proj_out(self.norm_out(x + reused, image_temb))
            x_head = x

        context = self.context_embedder(encoder_hidden_states.astype(dtype)).astype(stream)
        for block in self.txt_mode_blocks:
            (context,) = compiled_block(block, context, txt_early, *txt_rope)
            if after_block:
                after_block(context)
        cond, cond_single = None, None
        if image_cond_hidden_states is not None:
            (cond_early,), (cond_single,) = early.image_cond(zero_temb), single.image_cond(zero_temb)
            cond = self.x_embedders.image_cond(image_cond_hidden_states.astype(dtype)).astype(stream)
            for block in self.mode_blocks.image_cond:
                (cond,) = compiled_block(block, cond, cond_early, *ref_rope)
                if after_block:
                    after_block(cond)

        for block in self.single_transformer_blocks:
            out = compiled_block(block, x, img_single, cos, sin, context, txt_single, cond, cond_single)
            context, x = out[0], out[1]
            cond = out[2] if cond is not None else None
            if after_block:
                after_block(*out)
        if step_cache is not None:
            step_cache.remember(x - x_head)
        return self.proj_out(self.norm_out(x, image_temb))

    def eager_is_faster(self) -> bool:
        """As FLUX.2's: with the fused CUDA norm+RoPE kernel, eager blocks beat compiled ones
        (memory.compile_blocks_for)."""
        return cuda_kernels()

    def quant_predicate(self, path, module) -> bool:
        """Which layers may be quantized: not the embedders, the modulations or the output layers."""
        return not FULL_PRECISION.fullmatch(path)

    def sanitize(self, weights: dict) -> dict:
        """diffusers names and layouts are this module's own (no convolutions): nothing to change."""
        return dict(weights)


def _ids2d(ids):
    ids = ids if isinstance(ids, mx.array) else mx.array(ids)
    return ids[0] if ids.ndim == 3 else ids


# -- single files: diffusers' names (bare or under ComfyUI's prefix), the config read off the shapes -----------------

ORIGINAL_PREFIX = "model.diffusion_model."
# no other naming of FLUX 3's tensors is published: its files carry diffusers' names, mapped as they are
ORIGINAL_KEYMAP = [(r"(.+)", r"\1")]
_ORIGINAL_RULES = compile_rules(ORIGINAL_KEYMAP)
_P = r"(?:model\.diffusion_model\.)?"
_MARK = re.compile(_P + r"(txt_mode_blocks\.\d+|mode_blocks\.image\.\d+|early_stream_modulations)\..*")
_SINGLE, _TXT = re.compile(r"single_transformer_blocks\.(\d+)\."), re.compile(r"txt_mode_blocks\.(\d+)\.")
NOT_IN_WEIGHTS = {"rope_theta": 10000, "eps": 1e-6}        # diffusers' defaults
FROM_BASE_CONFIG = ("axes_dims_rope", "rope_theta", "eps")  # taken from a pipeline folder's config when given


def is_original(names) -> bool:
    """Whether tensor names are a FLUX 3 transformer file's (diffusers' names, with or without ComfyUI's prefix):
    its per-mode blocks or modulations."""
    return any(_MARK.fullmatch(n) for n in names)


def _check(weights):
    weights = under_prefix_if_present(weights, ORIGINAL_PREFIX)
    if not is_original(weights):
        raise MlxdiffError("not a FLUX 3 transformer checkpoint: no txt_mode_blocks.* / mode_blocks.image.* / "
                           "early_stream_modulations.* tensors")
    return weights


def original_to_diffusers(weights: dict) -> dict:
    """A file's names -> diffusers' (the same: the prefix is stripped; lazy, nothing is read). Unchecked: the whole
    file was claimed by is_original before this key map is attached, and a streamed block's group
    (loading/streaming.py) holds its own names only."""
    return remap(under_prefix_if_present(weights, ORIGINAL_PREFIX), _ORIGINAL_RULES)


def _count(weights, pattern, what):
    indices = sorted({int(m.group(1)) for k in weights if (m := pattern.match(k))})
    if indices != list(range(len(indices))):
        raise MlxdiffError(f"FLUX 3 transformer checkpoint: {what} indices are not 0..n-1 ({indices[:8]}...); the "
                           "file is incomplete")
    return len(indices)


def config_from_original(weights: dict) -> dict:
    """The diffusers config of a FLUX 3 file from its shapes: the width and in_channels from x_embedders.image
    (cond_in_channels from x_embedders.image_cond), joint_attention_dim from context_embedder, the sinusoid's channels
    from timestep_embedder.linear_1, the block counts from the indices, the head size from attn.norm_q (heads =
    width / head size), the MLP width from ff.linear_in's rows / 2 (SwiGLU), flow_map from a
    target_timestep_embedder. Not in the weights: axes_dims_rope (the head in 4 equal axes, as the released 4 x 32),
    rope_theta and eps (NOT_IN_WEIGHTS), taken from a folder's config when there is one (FROM_BASE_CONFIG)."""
    weights = _check(weights)

    def shape(key, ndim=2):
        return required_shape(weights, key, "FLUX 3", ndim)
    dim, in_channels = shape("x_embedders.image.weight")
    cond_dim, cond_in = shape("x_embedders.image_cond.weight")
    context_dim, joint = shape("context_embedder.weight")
    t_dim, channels = shape("timestep_embedder.linear_1.weight")
    num_layers = _count(weights, _TXT, "txt_mode_blocks")
    num_single = _count(weights, _SINGLE, "single_transformer_blocks")
    block = "txt_mode_blocks.0." if num_layers else "single_transformer_blocks.0."
    if not num_layers + num_single:
        raise MlxdiffError("FLUX 3 transformer checkpoint has neither txt_mode_blocks nor single_transformer_blocks")
    head_dim = shape(block + "attn.norm_q.weight", 1)[0]
    mlp_hidden = shape(block + "ff.linear_in.weight")[0] // 2
    if len({dim, cond_dim, context_dim, t_dim}) != 1 or dim % head_dim or head_dim % 8:
        raise MlxdiffError(f"FLUX 3 transformer checkpoint: the embedders' widths ({dim}, {cond_dim}, {context_dim}, "
                           f"{t_dim}) and the QK-norm length {head_dim} do not give one width of whole heads with a "
                           "4-axis RoPE; the file is damaged or another model's")
    mlp_ratio = mlp_hidden / dim
    if int(dim * mlp_ratio) != mlp_hidden:
        raise MlxdiffError(f"FLUX 3 transformer checkpoint: MLP width {mlp_hidden} is not int({dim} * mlp_ratio); "
                           "pass its folder's config")
    return {"in_channels": in_channels, "cond_in_channels": cond_in, "num_layers": num_layers,
            "num_single_layers": num_single, "attention_head_dim": head_dim, "num_attention_heads": dim // head_dim,
            "joint_attention_dim": joint, "timestep_channels": channels, "mlp_ratio": mlp_ratio,
            "axes_dims_rope": [head_dim // 4] * 4, **NOT_IN_WEIGHTS,
            "flow_map": "target_timestep_embedder.linear_1.weight" in weights}


# LoRAs (lora/, the protocol's LoRADenoiser): diffusers / PEFT names are the model's own
LORA_NAME = "FLUX 3 transformer"
LORA_ARCHITECTURE = "FLUX 3"     # its label in lora.ARCHITECTURES
LORA_ORDER = 20     # its own names before the BFL block names of FLUX.2's second row
# the layer names that tell a LoRA is for it: (pattern, labels) rows of lora.ARCHITECTURES (lora/names.py tries
# them in the modules' LORA_ORDER, the first that a name matches saying which architectures it fits).
# In diffusers' names: its per-mode blocks, modulations and embedders
LORA_ARCHITECTURE_PATTERNS = (
    (re.compile(r"(^|[._])(txt_mode_blocks|mode_blocks[._]image(_cond)?|(early|single)_stream_modulations|"
                r"x_embedders)([._]|$)"), (LORA_ARCHITECTURE,)),)


def lora_original_rules(args) -> list:
    """No other naming of FLUX 3 LoRAs is published: diffusers' / PEFT names (and lora/'s `diffusion_model.` /
    kohya readings of them) reach the layers as they are."""
    return []
