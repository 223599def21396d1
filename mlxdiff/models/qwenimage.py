"""Qwen-Image transformer: diffusers' QwenImageTransformer2DModel (models/transformers/transformer_qwenimage.py) in
MLX.

Qwen-Image (and Qwen-Image-Edit / Edit-Plus, which share it) is a 60-block dual-stream MMDiT: every block keeps an
image and a text stream, each with its own adaLN-Zero modulation (Linear(silu(temb)) -> shift, scale, gate for the
attention and for the GELU feed-forward), and one joint attention over [text; image] with RMS-normed q/k. The
attention and the feed-forward are FLUX.1's (models/flux1.py Attention, models/mmdit.py FeedForward; the same
diffusers names); what differs: no single-stream blocks, no pooled vector, the text features RMS-normed (txt_norm)
before txt_in, the timestep sinusoid scaled by 1000 inside the embedding (Timesteps(scale=1000)), a key mask over the
padded text, and the RoPE's positions (QwenEmbedRope, `positions` below): image rows and columns centred on 0, the
frame axis the index of the image in the sequence, the text on the diagonal after the largest image's half-size.

The files in the wild (ComfyUI's qwen_image_bf16 / fp8_e4m3fn / 2512 safetensors, city96's and QuantStack's GGUFs)
carry diffusers' own names, bare or under `model.diffusion_model.`: diffusers' from_single_file maps them with the
identity (single_file_model.py), and so does ORIGINAL_KEYMAP here; their config comes from the shapes
(config_from_original). Its LoRAs (diffusers / PEFT, Lightning's / ComfyUI's / musubi's `diffusion_model.` names,
kohya's `lora_unet_transformer_blocks_0_attn_to_q`) name diffusers' layers too: no original-name rules.
"""

import re
from dataclasses import dataclass

import numpy as np

import mlx.core as mx
import mlx.nn as nn

from ..config_checks import MAX_HEAD_DIM, MAX_HEADS, MAX_LAYERS, MAX_WIDTH, CheckedArgs, Rule, between, one_of
from ..errors import MlxdiffError
from ..formats.keymaps import compile_rules, remap, required_shape, under_prefix_if_present
from ..pacing import pace
from .embeddings import TimestepEmbedding, timestep_embedding
from .flux1 import Attention, controlnet_index, modulate
from .flux2 import clip_fp16, rope_tables
from .fused import double_stream, gated_residual, norm_modulate
from .mmdit import AdaLayerNormContinuous, FeedForward, Modulation

ROPE_THETA = 10000       # QwenEmbedRope(theta=10000): fixed in diffusers, not a config key
EPS = 1e-6               # every norm of the model (qk RMSNorms, txt_norm and the affine-free LayerNorms)
MLP_RATIO = 4            # FeedForward's mult: fixed in diffusers
MAX_POSITION = 4096      # QwenEmbedRope's tables cover positions -4096..4095 per axis


class TransformerArgs(CheckedArgs):
    """What Qwen-Image 2.1's transformer config shares with Qwen-Image's: the limits of the patch, channel, layer,
    head and RoPE-axes keys (SHARED_LIMITS), the RoPE axes' rule, the tuple axes and the width."""
    SHARED_LIMITS = {
        "patch_size": between(1, 16),
        "in_channels": between(1, MAX_WIDTH),
        "out_channels": between(1, MAX_WIDTH),
        "num_layers": between(1, MAX_LAYERS),
        "attention_head_dim": between(1, MAX_HEAD_DIM),
        "num_attention_heads": between(1, MAX_HEADS),
        "axes_dims_rope": between(2, MAX_HEAD_DIM, items=(3, 3)),    # (frame, height, width) position axes
    }
    ROPE_RULE = Rule("axes_dims_rope", lambda a: sum(a.axes_dims_rope) == a.attention_head_dim
                     and not any(d % 2 for d in a.axes_dims_rope),
                     lambda a: f"expected even numbers summing to attention_head_dim {a.attention_head_dim}")

    def __post_init__(self):
        self.axes_dims_rope = tuple(self.axes_dims_rope)

    @property
    def width(self) -> int:
        return self.num_attention_heads * self.attention_head_dim


CLASS_NAMES = ("QwenImageTransformer2DModel",)   # diffusers' class: its key in models/registry.ARCHITECTURES


@dataclass
class ModelArgs(TransformerArgs):
    # defaults: Qwen/Qwen-Image transformer/config.json (diffusers' class defaults)
    patch_size: int = 2
    in_channels: int = 64
    out_channels: int | None = 16            # None: same as in_channels
    num_layers: int = 60
    attention_head_dim: int = 128
    num_attention_heads: int = 24
    joint_attention_dim: int = 3584
    guidance_embeds: bool = False            # builds nothing in diffusers (its guidance path is unused)
    axes_dims_rope: tuple[int, ...] = (16, 56, 56)
    # Qwen-Image-Edit-2511's: the input images' tokens modulated at timestep 0 (TransformerBlock)
    zero_cond_t: bool = False
    # Qwen-Image-Layered's switches: not supported yet
    use_additional_t_cond: bool = False
    use_layer3d_rope: bool = False

    WHAT = "Qwen-Image transformer config"
    LIMITS = {
        **TransformerArgs.SHARED_LIMITS,
        "joint_attention_dim": between(1, MAX_WIDTH),
        "zero_cond_t": one_of(False, True),
        "use_additional_t_cond": one_of(False),
        "use_layer3d_rope": one_of(False),
    }
    RULES = (
        TransformerArgs.ROPE_RULE,
        Rule("num_attention_heads", lambda a: a.num_attention_heads * a.attention_head_dim <= MAX_WIDTH,
             lambda a: f"num_attention_heads * attention_head_dim (the width) must be at most {MAX_WIDTH}"),
    )


# -- positions -------------------------------------------------------------------------------------------------------

def image_shapes(img_shapes) -> tuple:
    """The (frame, height, width) token grids of the image sequence, in order: a list of 3-tuples, or diffusers'
    per-batch-row form (a list of such lists), whose first row is used for the whole batch (as QwenEmbedRope)."""
    shapes = img_shapes
    if isinstance(shapes, (list, tuple)) and shapes and isinstance(shapes[0], (list, tuple)) \
            and shapes[0] and isinstance(shapes[0][0], (list, tuple)):
        shapes = shapes[0]
    if isinstance(shapes, (list, tuple)) and len(shapes) == 3 and all(isinstance(v, (int, np.integer))
                                                                     for v in shapes):
        shapes = [shapes]
    try:
        out = tuple(tuple(int(v) for v in s) for s in shapes)
    except (TypeError, ValueError):
        raise MlxdiffError(f"img_shapes must be a list of (frame, height, width) token grids, got {img_shapes!r}")
    if not out or any(len(s) != 3 or min(s) < 1 for s in out):
        raise MlxdiffError(f"img_shapes must be a list of (frame, height, width) token grids, got {img_shapes!r}")
    return out


def positions(shapes, n_txt: int) -> np.ndarray:
    """QwenEmbedRope's positions (scale_rope=True) as (L_txt + N_img, 3) ids for [text; image]: image i of grid
    (f, h, w) has frames i..i+f-1, rows -(h - h//2)..h//2 - 1 and columns -(w - w//2)..w//2 - 1 (centred); the text
    tokens j = 0.. sit at m + j on all three axes, m = the largest h//2 or w//2 of the images."""
    grids = []
    for i, (f, h, w) in enumerate(shapes):
        frame, row, col = np.meshgrid(np.arange(f) + i, np.arange(h) - (h - h // 2), np.arange(w) - (w - w // 2),
                                      indexing="ij")
        grids.append(np.stack([frame, row, col], axis=-1).reshape(-1, 3))
    start = max(max(h // 2, w // 2) for _, h, w in shapes)
    if start + n_txt > MAX_POSITION or max(max(h, w) for _, h, w in shapes) > MAX_POSITION \
            or len(shapes) + max(f for f, _, _ in shapes) > MAX_POSITION:
        raise MlxdiffError(f"img_shapes {list(shapes)} with {n_txt} text tokens reach past Qwen-Image's "
                           f"{MAX_POSITION} RoPE positions")
    text = np.repeat((start + np.arange(n_txt))[:, None], 3, axis=1)
    return np.concatenate([text] + grids, axis=0)


# -- blocks ----------------------------------------------------------------------------------------------------------

class TimestepProjEmbeddings(nn.Module):
    """QwenTimestepProjEmbeddings: MLP(sinusoid_256(1000 t)), the sinusoid cast to the compute dtype first."""

    def __init__(self, dim: int):
        super().__init__()
        self.timestep_embedder = TimestepEmbedding(256, dim)

    def __call__(self, timestep):
        """`timestep` in the compute dtype (Model casts it), which the sinusoid takes."""
        t = timestep_embedding(timestep, 256, flip_sin_to_cos=True, downscale_freq_shift=0, scale=1000)
        return self.timestep_embedder(t.astype(timestep.dtype))


def modulations(mod_layer, temb, dim) -> tuple:
    """img_mod / txt_mod (Sequential(SiLU, Linear)): Linear(silu(temb)) -> the attention's and the feed-forward's
    (shift, scale, gate), each (B, D)."""
    chunks = mx.split(mod_layer[1](nn.silu(temb)), 6, axis=-1)
    return Modulation(*chunks[:3]), Modulation(*chunks[3:])


def token_modulation(mod, cond_mod, is_output):
    """zero_cond_t's image-stream modulation: the output's tokens take `mod` (the step's timestep), the input images'
    `cond_mod` (timestep 0), as diffusers' _modulate with modulate_index -> a Modulation of (B, N_img, D) each."""
    return Modulation(*(mx.where(is_output, a[:, None], c[:, None]) for a, c in zip(mod, cond_mod)))


def modulate_tokens(x, mod):
    """flux1.modulate for a per-token Modulation (B, N, D)."""
    return norm_modulate(x, mod.scale, mod.shift, EPS)


class TransformerBlock(nn.Module):
    """QwenImageTransformerBlock: adaLN-Zero per stream, joint attention over [text; image], a GELU feed-forward per
    stream; both streams clipped to float16's range in float16. With zero_cond_t (Qwen-Image-Edit-2511) `cond_temb`
    is timestep 0's embedding and `is_output` (1, N_img, 1) marks the output's tokens: the other image tokens (the
    input images') are modulated by cond_temb, the text and the output's tokens by temb (diffusers'
    modulate_index)."""

    def __init__(self, dim: int, heads: int, head_dim: int):
        super().__init__()
        self.dim = dim
        self.img_mod = [nn.SiLU(), nn.Linear(dim, 6 * dim)]
        self.txt_mod = [nn.SiLU(), nn.Linear(dim, 6 * dim)]
        self.attn = Attention(dim, heads, head_dim, joint=True)
        self.img_mlp = FeedForward(dim, MLP_RATIO)
        self.txt_mlp = FeedForward(dim, MLP_RATIO)

    def __call__(self, x, context, temb, cos, sin, mask, cond_temb=None, is_output=None):
        img1, img2 = modulations(self.img_mod, temb, self.dim)
        txt1, txt2 = modulations(self.txt_mod, temb, self.dim)
        if cond_temb is None:
            norm1, gate1 = modulate(x, img1), img1.gate[:, None]
        else:
            cond1, cond2 = modulations(self.img_mod, cond_temb, self.dim)
            img1, img2 = token_modulation(img1, cond1, is_output), token_modulation(img2, cond2, is_output)
            norm1, gate1 = modulate_tokens(x, img1), img1.gate
        attn_out, context_attn_out = self.attn(norm1, cos, sin, context=modulate(context, txt1), mask=mask)
        x = gated_residual(x, gate1, attn_out)
        context = gated_residual(context, txt1.gate[:, None], context_attn_out)
        if cond_temb is None:
            norm2, gate2 = modulate(x, img2), img2.gate[:, None]
        else:
            norm2, gate2 = modulate_tokens(x, img2), img2.gate
        x = pace(gated_residual(x, gate2, self.img_mlp(norm2)))
        context = pace(gated_residual(context, txt2.gate[:, None], self.txt_mlp(modulate(context, txt2))))
        return clip_fp16(context), clip_fp16(x)


def key_mask(encoder_hidden_states_mask, b, n_txt, n_img):
    """The attention's key mask (B, 1, 1, L_txt + N_img) of the text's 0 / 1 mask (B, L_txt), or None: keys only, a
    padded text token's output is never read."""
    if encoder_hidden_states_mask is None:
        return None
    if tuple(encoder_hidden_states_mask.shape) != (b, n_txt):
        raise MlxdiffError(f"encoder_hidden_states_mask has shape {tuple(encoder_hidden_states_mask.shape)}; "
                           f"expected (batch, text tokens) = ({b}, {n_txt})")
    keys = mx.concatenate([encoder_hidden_states_mask.astype(mx.bool_), mx.ones((b, n_img), dtype=mx.bool_)], axis=1)
    return keys[:, None, None, :]


# embedders, the modulations and the output layers stay in full precision (loading/quantize.py)
FULL_PRECISION = re.compile(r"(img_in|txt_in|txt_norm|time_text_embed\..*|transformer_blocks\.\d+\.(img|txt)_mod\.1|"
                            r"norm_out\.linear|proj_out)")


class Model(nn.Module):
    """QwenImageTransformer2DModel.

    __call__(hidden_states (B, N_img, C) packed 2x2 latents (Edit / Edit-Plus: the noisy latents, then each reference
    image's), encoder_hidden_states (B, L_txt, J) Qwen2.5-VL features, timestep (B,) = sigma in [0, 1] (the
    pipeline's t / 1000; scaled by 1000 inside the embedding, as diffusers), img_shapes: the (frame, height, width)
    token grid of each image in hidden_states, in order ([(1, H/16, W/16)] for Qwen-Image; the target's, then every
    reference's for Edit-Plus), encoder_hidden_states_mask (B, L_txt) of 0 / 1 or None: the text tokens that take
    part as keys (the pipeline's padding mask)) -> (B, N_img, patch^2 * C_out).

    Against diffusers' forward: the same names and meanings; img_shapes may also be diffusers' per-batch-row list of
    lists, of which (as diffusers) the first row serves the whole batch. Not taken: guidance (diffusers' path for it
    cannot run), attention_kwargs, additional_t_cond (Qwen-Image-Layered) and
    return_dict; txt_seq_lens (older diffusers' argument) is not needed: the RoPE covers the padded text length, as
    diffusers 0.42 does. With zero_cond_t (Qwen-Image-Edit-2511's config) the tokens after img_shapes' first grid (the
    input images') are modulated at timestep 0, as diffusers' modulate_index; the text, the output's tokens and
    norm_out at `timestep`. `after_block(context, x)`: the caller's memory policy, called after every block;
    step_cache and stream_dtype as flux1.Model.
    controlnet_block_samples: a Qwen-Image ControlNet's residuals (models/controlnet_qwenimage.py), sample
    i // ceil(blocks / samples) added to the image stream after block i.
    """

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.compute_dtype = mx.float32
        dim, heads, head_dim = args.width, args.num_attention_heads, args.attention_head_dim
        self.time_text_embed = TimestepProjEmbeddings(dim)
        self.txt_norm = nn.RMSNorm(args.joint_attention_dim, eps=EPS)
        self.img_in = nn.Linear(args.in_channels, dim)
        self.txt_in = nn.Linear(args.joint_attention_dim, dim)
        self.transformer_blocks = [TransformerBlock(dim, heads, head_dim) for _ in range(args.num_layers)]
        self.norm_out = AdaLayerNormContinuous(dim, dim)
        self.proj_out = nn.Linear(dim, args.patch_size * args.patch_size * (args.out_channels or args.in_channels))

    def rope(self, img_shapes, n_txt):
        """cos, sin (L_txt + N_img, head_dim) float32 for [text; image], computed once per (shapes, text length)."""
        shapes = image_shapes(img_shapes)
        key = (shapes, n_txt)
        cached = self.__dict__.get("_rope_cache")
        if cached is None or cached[0] != key:
            cached = (key, rope_tables(positions(shapes, n_txt), self.args.axes_dims_rope, ROPE_THETA))
            self.__dict__["_rope_cache"] = cached
        return cached[1]

    def __call__(self, hidden_states, encoder_hidden_states, timestep, img_shapes, encoder_hidden_states_mask=None,
                 after_block=None, step_cache=None, stream_dtype=None, controlnet_block_samples=None):
        dtype = self.compute_dtype
        stream = stream_dtype or dtype
        b, n_img = hidden_states.shape[:2]
        n_txt = encoder_hidden_states.shape[1]
        cos, sin = self.rope(img_shapes, n_txt)
        if cos.shape[0] != n_txt + n_img:
            raise MlxdiffError(f"img_shapes {list(image_shapes(img_shapes))} cover {cos.shape[0] - n_txt} image "
                               f"tokens but hidden_states has {n_img}")
        mask = key_mask(encoder_hidden_states_mask, b, n_txt, n_img)
        timestep = timestep if isinstance(timestep, mx.array) else mx.array(np.asarray(timestep, np.float32))
        temb = self.time_text_embed(timestep.reshape(-1).astype(dtype))
        block_args = (temb, cos, sin, mask)
        if self.args.zero_cond_t:    # the input images' tokens (after the output's grid) at timestep 0
            f, h, w = image_shapes(img_shapes)[0]
            cond_temb = self.time_text_embed(mx.zeros_like(timestep.reshape(-1)).astype(dtype))
            block_args += (cond_temb, (mx.arange(n_img) < f * h * w)[None, :, None])
        x = self.img_in(hidden_states.astype(dtype)).astype(stream)
        context = self.txt_in(self.txt_norm(encoder_hidden_states.astype(dtype))).astype(stream)
        samples = controlnet_block_samples
        residual = None if not samples else lambda i: samples[controlnet_index(i, len(self.transformer_blocks),
                                                                               len(samples))]
        context, x, x_head, reused = double_stream(self.transformer_blocks, x, context,
                                                   lambda i: block_args, after_block, step_cache, residual)
        if reused is not None:
            return self.proj_out(self.norm_out(x + reused, temb))
        if step_cache is not None:
            step_cache.remember(x - x_head)
        return self.proj_out(self.norm_out(x, temb))

    def quant_predicate(self, path, module) -> bool:
        """Which layers may be quantized: not the embedders, the modulations or the output layers."""
        return not FULL_PRECISION.fullmatch(path)

    def sanitize(self, weights: dict) -> dict:
        """diffusers names and layouts are this module's own (no convolutions): nothing to change."""
        return dict(weights)


# -- single files: diffusers' names (bare or under ComfyUI's prefix), the config read off the shapes -----------------

ORIGINAL_PREFIX = "model.diffusion_model."
# the files' names are diffusers' own (from_single_file's checkpoint_mapping_fn is the identity): nothing to rename
ORIGINAL_KEYMAP = [(r"(.+)", r"\1")]
_ORIGINAL_RULES = compile_rules(ORIGINAL_KEYMAP)
_P = r"(?:model\.diffusion_model\.)?"
# Qwen-Image's own tensors: the text features' RMSNorm before txt_in and a block's per-stream modulation
_QWEN_MARK = re.compile(_P + r"(txt_norm\.weight|transformer_blocks\.\d+\.img_mod\.1\.weight)")
# Qwen-Image 2.1's (QwenImage21Transformer2DModel: txt_in.text_norm, a SwiGLU img_mlp), another architecture
_QWEN21_MARK = re.compile(_P + r"(txt_in\.text_norm\..*|.*\.img_mlp\.(gate_up|gate_layer)\..*)")
# what the variants add (Qwen-Image-Layered's addition_t_embedding), which ModelArgs refuses
_LAYERED_MARK = re.compile(_P + r"time_text_embed\.addition_t_embedding\..*")
_BLOCK = re.compile(r"transformer_blocks\.(\d+)\.")
NOT_IN_WEIGHTS = {"patch_size": 2, "guidance_embeds": False}   # Qwen-Image's 2 x 2 packing (the pipeline's too)
FROM_BASE_CONFIG = ("axes_dims_rope", "patch_size")


def is_original(names) -> bool:
    """Whether tensor names are a Qwen-Image transformer file's (diffusers' names, with or without ComfyUI's
    prefix): txt_norm and img_mod tensors, none of Qwen-Image 2.1's."""
    names = list(names)
    marks = {m.group(1).split(".")[0] for n in names if (m := _QWEN_MARK.fullmatch(n))}
    return marks == {"txt_norm", "transformer_blocks"} and not any(_QWEN21_MARK.fullmatch(n) for n in names)


def is_qwen_image_21(names) -> bool:
    """Whether tensor names are Qwen-Image 2.1's (another architecture, not run here)."""
    return any(_QWEN21_MARK.fullmatch(n) for n in names)


def _check(weights):
    weights = under_prefix_if_present(weights, ORIGINAL_PREFIX)
    if not is_original(weights):
        raise MlxdiffError("not a Qwen-Image transformer checkpoint: no txt_norm.weight beside "
                           "transformer_blocks.N.img_mod.1.weight (or Qwen-Image 2.1's txt_in.text_norm / SwiGLU "
                           "img_mlp, another architecture)")
    return weights


def original_to_diffusers(weights: dict) -> dict:
    """A file's names -> diffusers' (the same: the prefix is stripped; lazy, nothing is read)."""
    return remap(_check(weights), _ORIGINAL_RULES)


def rope_axes(head_dim: int) -> list:
    """axes_dims_rope for a head size, split as Qwen-Image's (16, 56, 56) splits 128: an eighth for the frame axis,
    the rest in two equal parts (each even)."""
    frame = max(2, head_dim // 8 // 2 * 2)
    height = (head_dim - frame) // 4 * 2
    return [frame, height, head_dim - frame - height]


def config_from_original(weights: dict) -> dict:
    """The diffusers config of a Qwen-Image file from its shapes: the width and in_channels from img_in, the head
    size from attn.norm_q (heads = width / head size), joint_attention_dim from txt_in (txt_norm the same length),
    the block count from the indices, out_channels from proj_out's rows over the 2 x 2 patch; axes_dims_rope
    (not in the weights) as rope_axes splits the head. Each block's img_mod / txt_mod, attention and MLP shapes are
    checked against these, so that an inconsistent file is one line here, not a failed load."""
    weights = _check(weights)
    what = "Qwen-Image transformer"

    def shape(key, ndim=2):
        return required_shape(weights, key, what, ndim)

    def bad(message):
        return MlxdiffError(f"Qwen-Image transformer checkpoint: {message}; the file is damaged or another model's")
    if any(_LAYERED_MARK.fullmatch(n) for n in weights):
        raise bad("it has time_text_embed.addition_t_embedding (Qwen-Image-Layered), which mlxdiff does not run")
    indices = sorted({int(m.group(1)) for k in weights if (m := _BLOCK.match(k))})
    if not indices or indices != list(range(len(indices))):
        raise bad(f"transformer_blocks indices are not 0..n-1 ({indices[:8]}...)")
    dim, in_channels = shape("img_in.weight")
    txt_dim, joint = shape("txt_in.weight")
    head_dim = shape("transformer_blocks.0.attn.norm_q.weight", 1)[0]
    if txt_dim != dim:
        raise bad(f"img_in gives width {dim} but txt_in {txt_dim}")
    if shape("txt_norm.weight", 1)[0] != joint:
        raise bad(f"txt_norm has {shape('txt_norm.weight', 1)[0]} weights but txt_in takes {joint} features")
    if dim % head_dim or head_dim % 2:
        raise bad(f"width {dim} and attn.norm_q length {head_dim} do not give a whole number of heads of an even "
                  "size")
    p = NOT_IN_WEIGHTS["patch_size"]
    rows = shape("proj_out.weight")
    if rows[1] != dim or rows[0] % (p * p) or in_channels % (p * p):
        raise bad(f"proj_out {list(rows)} and img_in {[dim, in_channels]} are not {p} x {p} patches of width {dim}")
    expected = {}
    for i in indices:
        b = f"transformer_blocks.{i}."
        expected.update({b + f"{s}_mod.1.weight": (6 * dim, dim) for s in ("img", "txt")})
        expected.update({b + f"attn.{n}.weight": (dim, dim) for n in ("to_q", "to_k", "to_v", "add_q_proj",
                                                                       "add_k_proj", "add_v_proj", "to_add_out")})
        expected[b + "attn.to_out.0.weight"] = (dim, dim)
        expected.update({b + f"attn.{n}.weight": (head_dim,) for n in ("norm_q", "norm_k", "norm_added_q",
                                                                        "norm_added_k")})
        expected.update({b + f"{s}_mlp.net.0.proj.weight": (MLP_RATIO * dim, dim) for s in ("img", "txt")})
        expected.update({b + f"{s}_mlp.net.2.weight": (dim, MLP_RATIO * dim) for s in ("img", "txt")})
    for key, want in expected.items():
        if key not in weights:
            raise MlxdiffError(f"not a complete {what} checkpoint: {key!r} is missing; re-download the file")
        if tuple(weights[key].shape) != want:
            raise bad(f"tensor {key!r} has shape {list(weights[key].shape)}, expected {list(want)} for width {dim}, "
                      f"head size {head_dim}")
    return {**NOT_IN_WEIGHTS,
            "in_channels": in_channels,
            "out_channels": rows[0] // (p * p),
            "num_layers": len(indices),
            "attention_head_dim": head_dim,
            "num_attention_heads": dim // head_dim,
            "joint_attention_dim": joint,
            "axes_dims_rope": rope_axes(head_dim)}


# LoRAs (lora/, the protocol's LoRADenoiser): every naming people use (diffusers / PEFT, the Lightning / ComfyUI /
# musubi `diffusion_model.` names, kohya's lora_unet_) names diffusers' layers, which are mlxdiff's: no rules
LORA_NAME = "Qwen-Image transformer"
LORA_ARCHITECTURE = "Qwen-Image"     # its label in lora.ARCHITECTURES
LORA_ORDER = 90     # after Qwen-Image 2.1's (img_mlp)
# the layer names that tell a LoRA is for it: (pattern, labels) rows of lora.ARCHITECTURES (lora/names.py tries
# them in the modules' LORA_ORDER, the first that a name matches saying which architectures it fits).
# In diffusers' names, which all its LoRAs use: each block's per-stream modulation and MLP (its attention's to_q /
# add_q_proj / to_add_out are SD3's and FLUX.1's names too, BFL's img_mod / img_mlp sit under double_blocks, not
# transformer_blocks) and the text features' txt_norm
LORA_ARCHITECTURE_PATTERNS = (
    (re.compile(r"(^|[._])(transformer_blocks[._]\d+[._](img|txt)_(mod|mlp)|txt_norm)([._]|$)"),
     (LORA_ARCHITECTURE,)),)


def lora_original_rules(args) -> list:
    return []
