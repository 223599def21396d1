"""Z-Image transformer: diffusers' ZImageTransformer2DModel (models/transformers/transformer_z_image.py) in MLX.

Z-Image-Turbo and Z-Image share it: Tongyi-MAI's single-stream S3-DiT. The latents are cut into p x p patches
(p = 2) and embedded; the caption features (Qwen3's hidden states) are RMS-normed and embedded. Each sequence is
padded to a multiple of 32 tokens with a learned pad token (x_pad_token, cap_pad_token), and the padding takes part
in attention. Two refiner stacks run first: the noise refiner over the image tokens (modulated by the timestep) and
the context refiner over the caption tokens (no modulation). Then one stream [image; caption] runs through the main
blocks and the final layer reads the image tokens. Every block: RMSNorm sandwiches around attention and a SwiGLU
feed-forward (w2(silu(w1 x) * w3 x), hidden int(dim / 3 * 8)), qk RMSNorm, a 3-axis RoPE (theta 256, adjacent pairs
rotated, as FLUX's) and, in the modulated blocks, Linear(temb) -> (scale_msa, gate_msa, scale_mlp, gate_mlp): the
normed inputs times (1 + scale), the residuals gated by tanh(gate). temb is a 256-wide timestep MLP (no pooled text).

Position ids (diffusers' patchify_and_embed): caption token j of a row at (1 + j, 0, 0) for its padded length Lp;
image token (h, w) at (Lp + 1, h, w), its padding at (0, 0, 0). A row's image positions thus depend on its own
caption length: rows with captions of different padded lengths get their own RoPE tables.

Attribute names mirror diffusers (all_x_embedder / all_final_layer keyed "{patch}-{f_patch}", as its ModuleDicts),
so a diffusers checkpoint loads as it is. The original names (Tongyi-MAI's z_image_turbo_bf16.safetensors and
ComfyUI's, with or without `model.diffusion_model.`: fused attention.qkv, attention.out / q_norm / k_norm,
x_embedder, final_layer) go through ORIGINAL_KEYMAP (diffusers' convert_z_image_transformer_checkpoint_to_diffusers).
Not supported: Z-Image Omni's SigLIP conditioning and multi-image (omni) inputs (siglip_feat_dim must be null).
A ControlNet's block samples (models/controlnet_zimage.py) join the stream after their main layers.
"""

import re
from dataclasses import dataclass

import numpy as np

import mlx.core as mx
import mlx.nn as nn

from ..config_checks import (MAX_HEAD_DIM, MAX_HEADS, MAX_LAYERS, MAX_POSITIONS, MAX_WIDTH, CheckedArgs, Rule,
                             between, positive)
from ..errors import MlxdiffError
from ..formats.keymaps import compile_rules, remap, required_shape, under_prefix_if_present
from ..pacing import pace
from .embeddings import timestep_embedding
from .flux2 import apply_rope, attention, check_fused_rows, silu_gate
from .fused import compiled_block, gated_residual, norm_rope

ADALN_EMBED_DIM = 256    # the modulation input's width is min(dim, 256): fixed in diffusers
T_EMBED_MID = 1024       # TimestepEmbedder(mid_size=1024): fixed in diffusers
SEQ_MULTI_OF = 32        # every sequence is padded to a multiple of 32 tokens
QK_EPS = 1e-5            # Attention(eps=1e-5): the qk RMSNorms' eps, not norm_eps
FINAL_EPS = 1e-6         # FinalLayer's LayerNorm


class BlockWidths:
    """What a Z-Image block's widths derive from `dim` and `n_heads` (the transformer's and its ControlNet's
    configs)."""

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def ffn_dim(self) -> int:
        return int(self.dim / 3 * 8)

    @property
    def adaln_dim(self) -> int:
        return min(self.dim, ADALN_EMBED_DIM)


CLASS_NAMES = ("ZImageTransformer2DModel",)   # diffusers' class: its key in models/registry.ARCHITECTURES


@dataclass
class ModelArgs(BlockWidths, CheckedArgs):
    # defaults: Tongyi-MAI/Z-Image-Turbo transformer/config.json (diffusers' class defaults, except axes_lens: the
    # class says (1024, 512, 512), the released config (1536, 512, 512))
    all_patch_size: tuple[int, ...] = (2,)
    all_f_patch_size: tuple[int, ...] = (1,)
    in_channels: int = 16
    dim: int = 3840
    n_layers: int = 30
    n_refiner_layers: int = 2
    n_heads: int = 30
    n_kv_heads: int = 30                     # read by diffusers' config only: its attention has n_heads k/v heads
    norm_eps: float = 1e-5
    qk_norm: bool = True
    cap_feat_dim: int = 2560
    siglip_feat_dim: int | None = None       # Z-Image Omni's SigLIP features: not supported (null)
    rope_theta: float = 256.0
    t_scale: float = 1000.0
    axes_dims: tuple[int, ...] = (32, 48, 48)
    axes_lens: tuple[int, ...] = (1536, 512, 512)

    WHAT = "Z-Image transformer config"
    LIMITS = {
        "all_patch_size": between(1, 16, items=(1, 8)),
        "all_f_patch_size": between(1, 1, items=(1, 8)),      # images are one frame
        "in_channels": between(1, MAX_WIDTH),
        "dim": between(1, MAX_WIDTH),
        "n_layers": between(0, MAX_LAYERS),
        "n_refiner_layers": between(0, MAX_LAYERS),
        "n_heads": between(1, MAX_HEADS),
        "n_kv_heads": between(1, MAX_HEADS),
        "norm_eps": positive(1.0),
        "cap_feat_dim": between(1, MAX_WIDTH),
        "rope_theta": positive(),
        "t_scale": positive(1e6),
        "axes_dims": between(2, MAX_HEAD_DIM, items=(1, 8)),
        "axes_lens": between(1, MAX_POSITIONS, items=(1, 8)),
    }
    RULES = (
        Rule("all_f_patch_size", lambda a: len(a.all_f_patch_size) == len(a.all_patch_size),
             lambda a: f"expected one per all_patch_size entry ({len(a.all_patch_size)})"),
        Rule("n_heads", lambda a: a.dim % a.n_heads == 0,
             lambda a: f"expected a divisor of dim {a.dim} (head_dim = dim / n_heads)"),
        Rule("axes_dims", lambda a: sum(a.axes_dims) == a.head_dim and not any(d % 2 for d in a.axes_dims),
             lambda a: f"expected even numbers summing to the head size dim / n_heads = {a.head_dim}"),
        Rule("axes_lens", lambda a: len(a.axes_lens) == len(a.axes_dims),
             lambda a: f"expected one per axes_dims entry ({len(a.axes_dims)})"),
        Rule("siglip_feat_dim", lambda a: a.siglip_feat_dim is None,
             lambda a: "expected null: Z-Image Omni's SigLIP conditioning is not supported"),
    )

    def __post_init__(self):
        for key in ("all_patch_size", "all_f_patch_size", "axes_dims", "axes_lens"):
            setattr(self, key, tuple(getattr(self, key)))



# -- position and time -------------------------------------------------------------------------------------------

def rope_tables(ids, axes_dims, theta) -> tuple:
    """(..., n_axes) integer position ids -> (cos, sin), each (..., sum(axes_dims)) float32, as diffusers'
    RopeEmbedder: per axis, frequencies 1 / theta^(2j / d) in float64, the angles pos * freq rounded to float32
    (`.float()` before torch.polar), every cos / sin value twice (the rotated pairs are adjacent channels)."""
    pos = np.asarray(ids, dtype=np.float64)
    cos, sin = [], []
    for i, dim in enumerate(axes_dims):
        freqs = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
        angles = (pos[..., i, None] * freqs).astype(np.float32).astype(np.float64)
        cos.append(np.repeat(np.cos(angles), 2, axis=-1))
        sin.append(np.repeat(np.sin(angles), 2, axis=-1))
    return (np.concatenate(cos, axis=-1).astype(np.float32), np.concatenate(sin, axis=-1).astype(np.float32))


def padded(n: int) -> int:
    """n tokens padded to a multiple of SEQ_MULTI_OF."""
    return n + (-n) % SEQ_MULTI_OF


class TimestepEmbedder(nn.Module):
    """diffusers' TimestepEmbedder: sinusoid_256(t) ([cos, sin], frequencies exp(-ln(10000) i / 128)) -> Linear ->
    SiLU -> Linear, the sinusoid cast to the compute dtype (the weights' dtype in diffusers)."""

    def __init__(self, out_size: int, mid_size: int):
        super().__init__()
        self.mlp = [nn.Linear(256, mid_size), nn.SiLU(), nn.Linear(mid_size, out_size)]

    def __call__(self, t, dtype):
        x = timestep_embedding(t, 256, flip_sin_to_cos=True, downscale_freq_shift=0).astype(dtype)
        for layer in self.mlp:
            x = layer(x)
        return x


# -- blocks ----------------------------------------------------------------------------------------------------------

def rope_heads(x, norm, cos, sin):
    """x (B, S, H, hd) -> qk-normed (norm None: not), RoPE'd, (B, H, S, hd). cos / sin (S, hd) shared by the batch
    (the fused CUDA norm+RoPE where it applies), or (B, 1, S, hd): each row its own positions."""
    if norm is not None and cos.ndim == 2:
        return norm_rope([(x, norm)], cos, sin, apply_rope)
    return apply_rope((x if norm is None else norm(x)).transpose(0, 2, 1, 3), cos, sin)


class Attention(nn.Module):
    """diffusers' Attention with ZSingleStreamAttnProcessor: q / k / v without bias, per-head RMSNorm of q and k
    (qk_norm), RoPE, SDPA with a key mask, to_out without bias."""

    def __init__(self, dim: int, heads: int, qk_norm: bool):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.to_q = nn.Linear(dim, dim, bias=False)
        self.to_k = nn.Linear(dim, dim, bias=False)
        self.to_v = nn.Linear(dim, dim, bias=False)
        if qk_norm:
            self.norm_q = nn.RMSNorm(self.head_dim, eps=QK_EPS)
            self.norm_k = nn.RMSNorm(self.head_dim, eps=QK_EPS)
        self.to_out = [nn.Linear(dim, dim, bias=False)]

    def _heads(self, x):
        return x.reshape(*x.shape[:2], self.heads, self.head_dim)

    def __call__(self, x, cos, sin, mask):
        q, k, v = (self._heads(f(x)) for f in (self.to_q, self.to_k, self.to_v))
        q = rope_heads(q, self.get("norm_q"), cos, sin)
        k = rope_heads(k, self.get("norm_k"), cos, sin)
        return self.to_out[0](pace(attention(q, k, v, mask)))


class FeedForward(nn.Module):
    """w2(silu(w1 x) * w3 x), no biases."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def __call__(self, x):
        return self.w2(pace(silu_gate(self.w1(x), self.w3(x))))


class TransformerBlock(nn.Module):
    """ZImageTransformerBlock. Modulated (noise refiner, main layers): x + tanh(g_msa) * norm2(attn(norm1(x) *
    (1 + s_msa))), then x + tanh(g_mlp) * ffn_norm2(ff(ffn_norm1(x) * (1 + s_mlp))); without modulation (context
    refiner) the same with no scales and gates."""

    def __init__(self, args: ModelArgs, modulation: bool):
        super().__init__()
        dim, eps = args.dim, args.norm_eps
        self.attention = Attention(dim, args.n_heads, args.qk_norm)
        self.feed_forward = FeedForward(dim, args.ffn_dim)
        self.attention_norm1 = nn.RMSNorm(dim, eps=eps)
        self.ffn_norm1 = nn.RMSNorm(dim, eps=eps)
        self.attention_norm2 = nn.RMSNorm(dim, eps=eps)
        self.ffn_norm2 = nn.RMSNorm(dim, eps=eps)
        if modulation:
            self.adaLN_modulation = [nn.Linear(args.adaln_dim, 4 * dim)]

    def __call__(self, x, cos, sin, mask, temb):
        """x (B, S, D) the stream (the compute dtype, or wider); temb (B, adaln_dim) in the compute dtype: the
        modulation's input (an unmodulated block reads only its dtype)."""
        dtype = temb.dtype
        if "adaLN_modulation" not in self:
            attn = self.attention(self.attention_norm1(x).astype(dtype), cos, sin, mask)
            x = x + self.attention_norm2(attn).astype(x.dtype)
            return pace(x + self.ffn_norm2(self.feed_forward(self.ffn_norm1(x).astype(dtype))).astype(x.dtype))
        scale_msa, gate_msa, scale_mlp, gate_mlp = mx.split(self.adaLN_modulation[0](temb)[:, None], 4, axis=-1)
        attn = self.attention((self.attention_norm1(x) * (1 + scale_msa)).astype(dtype), cos, sin, mask)
        x = gated_residual(x, mx.tanh(gate_msa), self.attention_norm2(attn))
        ff = self.feed_forward((self.ffn_norm1(x) * (1 + scale_mlp)).astype(dtype))
        return pace(gated_residual(x, mx.tanh(gate_mlp), self.ffn_norm2(ff)))


class FinalLayer(nn.Module):
    """LayerNorm(x) (no affine, eps 1e-6) * (1 + Linear(silu(temb))) -> Linear."""

    def __init__(self, dim: int, adaln_dim: int, out_channels: int):
        super().__init__()
        self.linear = nn.Linear(dim, out_channels)
        self.adaLN_modulation = [nn.SiLU(), nn.Linear(adaln_dim, dim)]

    def __call__(self, x, temb):
        scale = 1 + self.adaLN_modulation[1](nn.silu(temb))[:, None]
        return self.linear((mx.fast.layer_norm(x, None, None, FINAL_EPS) * scale).astype(scale.dtype))


def patchify(latents, p):
    """(B, C, H, W) -> (B, (H/p) * (W/p), p * p * C) tokens, diffusers' "c f pf h ph w pw -> (f h w) (pf ph pw c)"."""
    b, c, h, w = latents.shape
    return latents.reshape(b, c, h // p, p, w // p, p).transpose(0, 2, 4, 3, 5, 1).reshape(b, (h // p) * (w // p),
                                                                                        p * p * c)


@dataclass
class Tokens:
    """Model.tokens' output: what every block of a forward reads besides its stream."""
    x: mx.array            # (B, n_img padded, D) embedded image tokens, before the noise refiner
    cap: mx.array          # (B, L padded, D) embedded caption tokens, before the context refiner
    temb: mx.array         # (B, adaln_dim) the modulation input
    x_rope: tuple          # (cos, sin) of the image tokens
    cap_rope: tuple        # of the caption tokens
    u_rope: tuple          # of [image; caption]
    cap_mask: object       # the caption's and [image; caption]'s key masks (None: every row alike)
    u_mask: object
    key: str               # "{patch}-{f_patch}": the embedder and final layer
    patch: int
    shape: tuple           # the latents' (B, C, H, W)


# the embedders, the modulations and the final layer stay in full precision (loading/quantize.py)
FULL_PRECISION = re.compile(r"(all_x_embedder\..*|cap_embedder\..*|t_embedder\..*|.*adaLN_modulation\.\d+|"
                            r"all_final_layer\..*)")


class Model(nn.Module):
    """ZImageTransformer2DModel, in diffusers' basic (non-omni) mode.

    __call__(hidden_states (B, C, H, W) latents, timestep (B,), encoder_hidden_states (B, L, cap_feat_dim) caption
    features, text_mask (B, L) of 0 / 1 or None (all L tokens), patch_size None (the config's first))
    -> (B, C, H, W), the model's own output.

    How it maps to diffusers' forward(x, t, cap_feats): x = [hidden_states[i][:, None] (C, 1, H, W) per row]; t =
    timestep, the pipeline's (1000 - scheduler t) / 1000 = 1 - sigma (scaled by t_scale here, as diffusers);
    cap_feats = [encoder_hidden_states[i][text_mask[i] > 0] per row] (ZImagePipeline's prompt_embeds[i][mask[i]]: the
    valid tokens of a padded batch, which may differ in number per row); the output is diffusers' list stacked with
    its frame axis squeezed. ZImagePipeline takes the velocity as minus this output. The text mask is read on the
    host (the per-row lengths decide the sequence layout).
    `after_block(*outputs)`: the caller's memory policy, called after every block (refiners included).
    stream_dtype: the residual streams' dtype when wider than the compute dtype (backend.stream_dtype).
    """

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.compute_dtype = mx.float32
        dim = args.dim
        self.all_x_embedder = {f"{p}-{f}": nn.Linear(f * p * p * args.in_channels, dim)
                               for p, f in zip(args.all_patch_size, args.all_f_patch_size)}
        self.all_final_layer = {f"{p}-{f}": FinalLayer(dim, args.adaln_dim, f * p * p * args.in_channels)
                                for p, f in zip(args.all_patch_size, args.all_f_patch_size)}
        self.noise_refiner = [TransformerBlock(args, modulation=True) for _ in range(args.n_refiner_layers)]
        self.context_refiner = [TransformerBlock(args, modulation=False) for _ in range(args.n_refiner_layers)]
        self.t_embedder = TimestepEmbedder(args.adaln_dim, T_EMBED_MID)
        self.cap_embedder = [nn.RMSNorm(args.cap_feat_dim, eps=args.norm_eps), nn.Linear(args.cap_feat_dim, dim)]
        self.x_pad_token = mx.zeros((1, dim))
        self.cap_pad_token = mx.zeros((1, dim))
        self.layers = [TransformerBlock(args, modulation=True) for _ in range(args.n_layers)]

    # -- the sequence layout -----------------------------------------------------------------------------------------

    def _caption_rows(self, text_mask, b: int, length: int):
        """Per row, the indices of its valid caption tokens (text_mask > 0; all without a mask)."""
        if text_mask is None:
            return [np.arange(length)] * b
        mask = np.asarray(text_mask.astype(mx.float32) if isinstance(text_mask, mx.array) else text_mask)
        if mask.shape != (b, length):
            raise MlxdiffError(f"text_mask has shape {list(mask.shape)}; expected [{b}, {length}] (batch, caption "
                               "tokens) as encoder_hidden_states")
        rows = [np.flatnonzero(row > 0) for row in mask]
        if any(len(r) == 0 for r in rows):
            raise MlxdiffError("text_mask: a batch row has no caption token; every row needs at least one")
        return rows

    def layout(self, cap_lens: tuple, grid: tuple):
        """For caption lengths (one per row) and the (H, W) token grid: the RoPE tables of the image tokens, of the
        caption tokens and of [image; caption], each (cos, sin) of (S, hd) when every row has the same positions,
        else (B, 1, S, hd); cached on the model (the same at every step of a run)."""
        key = (cap_lens, grid)
        cached = self.__dict__.get("_layout")
        if cached is not None and cached[0] == key:
            return cached[1]
        a = self.args
        ht, wt = grid
        n_img, cap_pad = ht * wt, [padded(n) for n in cap_lens]
        width = max(cap_pad)
        for axis, (top, what) in enumerate(((width + 1, "caption tokens (padded)"), (ht - 1, "token rows"),
                                            (wt - 1, "token columns"))):
            if top >= a.axes_lens[axis]:
                raise MlxdiffError(f"Z-Image transformer: position {top} on RoPE axis {axis} ({what}) is past the "
                                   f"config's axes_lens {list(a.axes_lens)}")
        img_ids = np.zeros((len(cap_lens), padded(n_img), 3), dtype=np.int64)
        hh, ww = np.meshgrid(np.arange(ht), np.arange(wt), indexing="ij")
        for i, lp in enumerate(cap_pad):
            img_ids[i, :n_img] = np.stack([np.full(n_img, lp + 1), hh.reshape(-1), ww.reshape(-1)], axis=-1)
        cap_ids = np.zeros((1, width, 3), dtype=np.int64)
        cap_ids[0, :, 0] = 1 + np.arange(width)
        tables = []
        for ids in (img_ids, cap_ids, np.concatenate([img_ids, np.broadcast_to(cap_ids, (len(cap_lens),
                                                                                           width, 3))], axis=1)):
            if (ids == ids[:1]).all():
                ids = ids[0]
            cos, sin = rope_tables(ids, a.axes_dims, a.rope_theta)
            tables.append(tuple(mx.array(t if t.ndim == 2 else t[:, None]) for t in (cos, sin)))
        self.__dict__["_layout"] = (key, tables)
        return tables

    # -- the forward ---------------------------------------------------------------------------------------------------

    def tokens(self, hidden_states, timestep, encoder_hidden_states, text_mask=None, patch_size=None,
               stream_dtype=None) -> Tokens:
        """The inputs checked and embedded, before any block: the padded image and caption tokens, temb, the RoPE
        tables and key masks (what a ControlNet shares with the transformer: diffusers' from_transformer)."""
        a = self.args
        dtype = self.compute_dtype
        stream = stream_dtype or dtype
        p = patch_size or a.all_patch_size[0]
        if p not in a.all_patch_size:
            raise MlxdiffError(f"patch_size {p} is not one of the model's {list(a.all_patch_size)}")
        key = f"{p}-{a.all_f_patch_size[a.all_patch_size.index(p)]}"
        if hidden_states.ndim != 4 or hidden_states.shape[1] != a.in_channels:
            raise MlxdiffError(f"hidden_states has shape {list(hidden_states.shape)}; expected [batch, "
                               f"{a.in_channels}, height, width] latents")
        b, c, h, w = hidden_states.shape
        if h % p or w % p:
            raise MlxdiffError(f"latents {h} x {w} are not a multiple of the patch size {p}")
        if encoder_hidden_states.ndim != 3 or encoder_hidden_states.shape[0] != b \
                or encoder_hidden_states.shape[2] != a.cap_feat_dim:
            raise MlxdiffError(f"encoder_hidden_states has shape {list(encoder_hidden_states.shape)}; expected "
                               f"[{b}, tokens, {a.cap_feat_dim}]")
        rows = self._caption_rows(text_mask, b, encoder_hidden_states.shape[1])
        cap_lens = tuple(len(r) for r in rows)
        x_rope, cap_rope, u_rope = self.layout(cap_lens, (h // p, w // p))
        cap_pad = [padded(n) for n in cap_lens]
        width = max(cap_pad)

        timestep = timestep if isinstance(timestep, mx.array) else mx.array(np.asarray(timestep, np.float32))
        temb = self.t_embedder(mx.broadcast_to(timestep.reshape(-1).astype(mx.float32), (b,)) * a.t_scale, dtype)

        # image tokens: patches (H_t, W_t, p, p, C) -> embedded, then x_pad_token up to a multiple of 32
        x = self.pad_image(self.all_x_embedder[key](patchify(hidden_states, p).astype(dtype))).astype(stream)

        # caption tokens: each row's valid tokens first, then cap_pad_token (its padding to 32 and the batch's)
        index = np.zeros((b, width), dtype=np.int32)
        valid = np.zeros((b, width), dtype=bool)
        for i, r in enumerate(rows):
            index[i, :len(r)], valid[i, :len(r)] = r, True
        feats = mx.take_along_axis(encoder_hidden_states, mx.array(index)[:, :, None], axis=1)
        cap = self.cap_embedder[1](self.cap_embedder[0](feats.astype(dtype)))
        cap = mx.where(mx.array(valid)[:, :, None], cap, self.cap_pad_token.astype(dtype)).astype(stream)
        cap_mask = None if len(set(cap_pad)) == 1 else \
            mx.array(np.arange(width)[None] < np.array(cap_pad)[:, None])[:, None, None, :]
        # [image; caption]: a row's tokens past its own padded caption are masked as keys (their outputs unread)
        u_mask = None if cap_mask is None else mx.concatenate(
            [mx.ones((b, 1, 1, x.shape[1]), dtype=mx.bool_), cap_mask], axis=-1)
        return Tokens(x, cap, temb, x_rope, cap_rope, u_rope, cap_mask, u_mask, key, p, (b, c, h, w))

    def pad_image(self, x):
        """Embedded image tokens (B, n, D) -> x_pad_token appended up to a multiple of 32."""
        pad = padded(x.shape[1]) - x.shape[1]
        if not pad:
            return x
        return mx.concatenate([x, mx.broadcast_to(self.x_pad_token.astype(x.dtype), (x.shape[0], pad, x.shape[2]))],
                              axis=1)

    def refine_image(self, t: Tokens, x, hints=None, after_block=None):
        """The noise refiner over image tokens x; hints {i: (B, n, D)} added after block i (a ControlNet's)."""
        for i, block in enumerate(self.noise_refiner):
            x = compiled_block(block, x, *t.x_rope, None, t.temb)
            if hints and i in hints:
                x = x + hints[i].astype(x.dtype)
            if after_block:
                after_block(x)
        return x

    def refine_caption(self, t: Tokens, after_block=None):
        cap = t.cap
        for block in self.context_refiner:
            cap = compiled_block(block, cap, *t.cap_rope, t.cap_mask, t.temb)
            if after_block:
                after_block(cap)
        return cap

    def __call__(self, hidden_states, timestep, encoder_hidden_states, text_mask=None, patch_size=None,
                 after_block=None, stream_dtype=None, controlnet_block_samples=None):
        """controlnet_block_samples: {main layer index: (B, S, D)} added to the stream after that layer, as
        diffusers' (a ZImageControlNetModel's output, models/controlnet_zimage.py)."""
        t = self.tokens(hidden_states, timestep, encoder_hidden_states, text_mask, patch_size, stream_dtype)
        x = self.refine_image(t, t.x, after_block=after_block)
        u = mx.concatenate([x, self.refine_caption(t, after_block)], axis=1)
        samples = controlnet_block_samples or {}
        for i, block in enumerate(self.layers):
            u = compiled_block(block, u, *t.u_rope, t.u_mask, t.temb)
            if i in samples:
                u = u + samples[i].astype(u.dtype)
            if after_block:
                after_block(u)
        b, c, h, w = t.shape
        p = t.patch
        ht, wt = h // p, w // p
        out = self.all_final_layer[t.key](u[:, :ht * wt], t.temb)
        return out.reshape(b, ht, wt, p, p, c).transpose(0, 5, 1, 3, 2, 4).reshape(b, c, h, w)

    def quant_predicate(self, path, module) -> bool:
        """Which layers may be quantized: not the embedders, the modulations or the final layer."""
        return not FULL_PRECISION.fullmatch(path)

    def sanitize(self, weights: dict) -> dict:
        """diffusers names and layouts are this module's own (no convolutions): nothing to change."""
        return dict(weights)


# -- original names: Tongyi-MAI's single files (z_image_turbo_bf16.safetensors) and ComfyUI's ------------------------

ORIGINAL_PREFIX = "model.diffusion_model."
_P = r"(?:model\.diffusion_model\.)?"      # accepted with or without the prefix (ComfyUI files have it)
_A = r"((?:noise_refiner|context_refiner|layers)\.\d+)\.attention\."
# original name -> diffusers name (diffusers' convert_z_image_transformer_checkpoint_to_diffusers: the files hold the
# 2-1 patch embedder and final layer only; a tuple target splits the fused qkv into q, k, v along axis 0; a stray
# norm_final.weight, which diffusers' LayerNorm has not, is dropped). Every other name is diffusers' own.
ORIGINAL_KEYMAP = [
    (_P + r"x_embedder\.(weight|bias)", r"all_x_embedder.2-1.\1"),
    (_P + r"final_layer\.(.+)", r"all_final_layer.2-1.\1"),
    (_P + r"norm_final\.weight", None),
    (_P + _A + r"qkv\.weight", (r"\1.attention.to_q.weight", r"\1.attention.to_k.weight", r"\1.attention.to_v.weight")),
    (_P + _A + r"out\.(weight|bias)", r"\1.attention.to_out.0.\2"),
    (_P + _A + r"q_norm\.weight", r"\1.attention.norm_q.weight"),
    (_P + _A + r"k_norm\.weight", r"\1.attention.norm_k.weight"),
]
_ORIGINAL_RULES = compile_rules(ORIGINAL_KEYMAP)

# LoRAs (lora/, the protocol's LoRADenoiser)
LORA_NAME = "Z-Image transformer"
LORA_ARCHITECTURE = "Z-Image"     # its label in lora.ARCHITECTURES
LORA_ORDER = 70     # its names match no earlier row
# the layer names that tell a LoRA is for it: (pattern, labels) rows of lora.ARCHITECTURES (lora/names.py tries
# them in the modules' LORA_ORDER, the first that a name matches saying which architectures it fits).
# In diffusers' and the original names: its refiners, caption / patch embedders, and the main blocks' attention,
# SwiGLU and modulation under layers.N (SD3's t_embedder / final_layer and FLUX's x_embedder are not telling)
LORA_ARCHITECTURE_PATTERNS = (
    (re.compile(r"(^|[._])(noise_refiner|context_refiner|cap_embedder|all_x_embedder|all_final_layer|"
                r"layers[._]\d+[._](attention[._](qkv|out|to_[qkv]|to_out|q_norm|k_norm|norm_[qk])|"
                r"feed_forward[._]w[123]|adaLN_modulation))([._]|$)"), (LORA_ARCHITECTURE,)),)
# original-named LoRA layers (musubi-tuner / kohya / ComfyUI: attention.qkv fused, attention.out, x_embedder,
# final_layer) -> mlxdiff's, as ORIGINAL_KEYMAP maps the base weights: a fused qkv's lora_B rows split into to_q,
# to_k, to_v (its lora_A shared). The block name and index are separate groups, so that kohya's underscore-folded
# names (layers_0_attention_qkv) expand to dotted paths too. Every other name is diffusers' own.
_B = r"(noise_refiner|context_refiner|layers)\.(\d+)\."
_LORA_RULES = compile_rules([
    (_P + r"x_embedder\.weight", "all_x_embedder.2-1.weight"),
    (_P + r"final_layer\.linear\.weight", "all_final_layer.2-1.linear.weight"),
    (_P + r"final_layer\.adaLN_modulation\.1\.weight", "all_final_layer.2-1.adaLN_modulation.1.weight"),
    (_P + _B + r"attention\.qkv\.weight", tuple(rf"\1.\2.attention.to_{c}.weight" for c in "qkv")),
    (_P + _B + r"attention\.out\.weight", r"\1.\2.attention.to_out.0.weight"),
])


def lora_original_rules(args) -> list:
    return _LORA_RULES

# Z-Image's own tensors (its pad tokens, the modulation without a SiLU before it: Lumina 2's is adaLN_modulation.1),
# and what only the original naming has
_ZIMAGE_MARK = re.compile(_P + r"(x_pad_token|cap_pad_token|(layers|noise_refiner)\.\d+\.adaLN_modulation\.0\.weight)")
_ORIGINAL_MARK = re.compile(_P + r"(x_embedder\.|final_layer\.|.*\.attention\.qkv\.weight$)")
_LAYER_KEY = {name: re.compile(name + r"\.(\d+)\.") for name in ("layers", "noise_refiner", "context_refiner")}
NOT_IN_WEIGHTS = {"all_patch_size": [2], "all_f_patch_size": [1], "norm_eps": 1e-5, "siglip_feat_dim": None,
                  "rope_theta": 256.0, "t_scale": 1000.0, "axes_lens": [1536, 512, 512]}
FROM_BASE_CONFIG = ("axes_dims", "axes_lens", "rope_theta", "t_scale", "norm_eps")


def is_original(names) -> bool:
    """Whether tensor names are a Z-Image file's original names (with or without ComfyUI's prefix)."""
    names = list(names)
    return any(_ZIMAGE_MARK.fullmatch(n) for n in names) and any(_ORIGINAL_MARK.match(n) for n in names)


def _check(weights):
    weights = under_prefix_if_present(weights, ORIGINAL_PREFIX)
    if not is_original(weights):
        raise MlxdiffError("not a Z-Image original checkpoint: no x_pad_token / cap_pad_token / layers.N."
                           "adaLN_modulation.0 keys beside x_embedder / final_layer / attention.qkv ones")
    return weights


def original_to_diffusers(weights: dict) -> dict:
    """Original names -> diffusers names (lazy: nothing is read)."""
    return remap(_check(weights), _ORIGINAL_RULES)


def _count(weights, name) -> int:
    indices = sorted({int(m.group(1)) for k in weights if (m := _LAYER_KEY[name].match(k))})
    if indices != list(range(len(indices))):
        raise MlxdiffError(f"Z-Image original checkpoint: {name} indices are not 0..n-1 ({indices[:8]}...); the "
                           "file is incomplete")
    return len(indices)


def config_from_original(weights: dict) -> dict:
    """The diffusers config of an original Z-Image file from its names and shapes: dim and p^2 x in_channels from
    x_embedder (patch 2, the converter's), the block counts from the indices, the head size from the qk norms,
    cap_feat_dim from cap_embedder. What the shapes cannot give is the released model's (NOT_IN_WEIGHTS), and
    axes_dims the head size split as Z-Image's (32, 48, 48) splits 128: a quarter, then two equal parts."""
    weights = _check(weights)
    shape = lambda key, ndim=2: required_shape(weights, key, "Z-Image", ndim)   # noqa: E731
    dim, patch_in = shape("x_embedder.weight")
    p = NOT_IN_WEIGHTS["all_patch_size"][0]
    if patch_in % (p * p):
        raise MlxdiffError(f"Z-Image original checkpoint: x_embedder takes {patch_in} inputs; expected "
                           f"{p} x {p} x the latent channels")
    n_layers, n_refiner = _count(weights, "layers"), _count(weights, "noise_refiner")
    if _count(weights, "context_refiner") != n_refiner:
        raise MlxdiffError("Z-Image original checkpoint: noise_refiner and context_refiner have different block "
                           "counts; the file is incomplete")
    first = next((f"{name}.0.attention." for name in ("layers", "noise_refiner", "context_refiner")
                  if f"{name}.0.attention.qkv.weight" in weights), None)
    if first is None:
        raise MlxdiffError("Z-Image original checkpoint has no attention blocks")
    if first + "q_norm.weight" not in weights:
        raise MlxdiffError("Z-Image original checkpoint without qk norms: its head count cannot be read from the "
                           "shapes")
    head_dim = shape(first + "q_norm.weight", 1)[0]
    if dim % head_dim or head_dim % 2:
        raise MlxdiffError(f"Z-Image original checkpoint: hidden size {dim} and qk-norm length {head_dim} do not give "
                           "a whole number of heads of an even size")
    blocks = [f"{name}.{i}.attention.qkv.weight" for name, n in (("layers", n_layers), ("noise_refiner", n_refiner),
                                                                 ("context_refiner", n_refiner)) for i in range(n)]
    check_fused_rows(weights, {k: ((3 * dim, dim), f"3 x {dim} rows (q, k, v)") for k in blocks}, "Z-Image")
    half = (head_dim - head_dim // 4) // 4 * 2
    return {**NOT_IN_WEIGHTS,
            "in_channels": patch_in // (p * p),
            "dim": dim,
            "n_layers": n_layers,
            "n_refiner_layers": n_refiner,
            "n_heads": dim // head_dim,
            "n_kv_heads": dim // head_dim,
            "qk_norm": True,
            "cap_feat_dim": shape("cap_embedder.1.weight")[1],
            "axes_dims": [head_dim - 2 * half, half, half]}
