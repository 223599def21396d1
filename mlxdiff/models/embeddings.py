"""Embeddings shared by the diffusion transformers: timestep sinusoids, 2D sin-cos position tables, and the small
MLPs that project timesteps and pooled text (diffusers/models/embeddings.py, re-implemented in MLX).

Tables are built with mx ops, so they stay lazy: a table that a checkpoint then replaces is never computed.
"""

import math

import numpy as np

import mlx.core as mx
import mlx.nn as nn


def timestep_embedding(timesteps: mx.array, dim: int, flip_sin_to_cos: bool = False,
                       downscale_freq_shift: float = 1.0, scale: float = 1.0, max_period: float = 10000.0) -> mx.array:
    """Sinusoidal embedding of (N,) timesteps -> (N, dim) float32, as diffusers' `get_timestep_embedding`.

    frequencies exp(-ln(max_period) * i / (dim/2 - downscale_freq_shift)), i < dim/2; output [sin, cos]
    ([cos, sin] with flip_sin_to_cos); an odd dim gets one zero column at the end.
    """
    if timesteps.ndim != 1:
        raise ValueError(f"timesteps must be 1-D, got shape {timesteps.shape}")
    half = dim // 2
    # diffusers: float32 exponent, then exp. The exp is taken in float64 and rounded: MLX's float32 exp is a few
    # ulp off, which at t ~ 1000 moves sin/cos by ~5e-5; rounded, the table equals torch's in 125 of 128 entries.
    exponent = np.float32(-math.log(max_period)) * np.arange(half, dtype=np.float32) / np.float32(
        half - downscale_freq_shift)
    freqs = mx.array(np.exp(exponent.astype(np.float64)).astype(np.float32))
    args = scale * (timesteps.astype(mx.float32)[:, None] * freqs[None, :])
    parts = [mx.cos(args), mx.sin(args)] if flip_sin_to_cos else [mx.sin(args), mx.cos(args)]
    if dim % 2:
        parts.append(mx.zeros((timesteps.shape[0], 1), dtype=mx.float32))
    return mx.concatenate(parts, axis=-1)


def sincos_1d(dim: int, positions: mx.array) -> mx.array:
    """(M,) positions -> (M, dim): [sin(pos * w), cos(pos * w)] with w_i = 1 / 10000^(i / (dim/2))."""
    if dim % 2:
        raise ValueError(f"sin-cos embedding dim must be even, got {dim}")
    omega = 1.0 / (10000.0 ** (mx.arange(dim // 2, dtype=mx.float32) / (dim / 2.0)))
    out = positions.reshape(-1)[:, None] * omega[None, :]
    return mx.concatenate([mx.sin(out), mx.cos(out)], axis=1)


def sincos_2d(dim: int, grid_size: int, base_size: float = 16, interpolation_scale: float = 1.0) -> mx.array:
    """The (G*G, dim) table of diffusers' `get_2d_sincos_pos_embed` for a square G x G grid, rows in (h, w) order.

    Coordinates are arange(G) / (G / base_size) / interpolation_scale. The first dim/2 channels encode the column
    (x) coordinate, the last dim/2 the row (y): diffusers' meshgrid puts w first.
    (diffusers computes the frequencies in float64; float32 here differs by ~1e-6, and checkpoints carry the table.)
    """
    if dim % 4:
        raise ValueError(f"2D sin-cos embedding dim must be divisible by 4, got {dim}")
    coords = mx.arange(grid_size, dtype=mx.float32) / (grid_size / base_size) / interpolation_scale
    cols = mx.broadcast_to(coords[None, :], (grid_size, grid_size))  # [h, w] -> w coordinate
    rows = mx.broadcast_to(coords[:, None], (grid_size, grid_size))  # [h, w] -> h coordinate
    return mx.concatenate([sincos_1d(dim // 2, cols), sincos_1d(dim // 2, rows)], axis=1)


ACTIVATIONS = {"silu": nn.silu, "gelu_tanh": nn.gelu_approx, "gelu": nn.gelu}


class TimestepEmbedding(nn.Module):
    """diffusers' TimestepEmbedding (without cond_proj / post_act): linear_1 -> act -> linear_2."""

    def __init__(self, in_channels: int, time_embed_dim: int, out_dim: int | None = None, act_fn: str = "silu",
                 bias: bool = True):
        super().__init__()
        self.linear_1 = nn.Linear(in_channels, time_embed_dim, bias=bias)
        self.linear_2 = nn.Linear(time_embed_dim, out_dim or time_embed_dim, bias=bias)
        self.act = ACTIVATIONS[act_fn]

    def __call__(self, x):
        return self.linear_2(self.act(self.linear_1(x)))


class TextProjection(nn.Module):
    """diffusers' PixArtAlphaTextProjection: linear_1 -> act -> linear_2 (both with bias)."""

    def __init__(self, in_features: int, hidden_size: int, out_features: int | None = None, act_fn: str = "gelu_tanh"):
        super().__init__()
        self.linear_1 = nn.Linear(in_features, hidden_size)
        self.linear_2 = nn.Linear(hidden_size, out_features or hidden_size)
        self.act = ACTIVATIONS[act_fn]

    def __call__(self, x):
        return self.linear_2(self.act(self.linear_1(x)))


class CombinedTimestepTextProjEmbeddings(nn.Module):
    """SD3's conditioning vector: embed(sinusoid_256(t)) + project(pooled text)."""

    def __init__(self, embedding_dim: int, pooled_projection_dim: int):
        super().__init__()
        self.timestep_embedder = TimestepEmbedding(256, embedding_dim)
        self.text_embedder = TextProjection(pooled_projection_dim, embedding_dim, act_fn="silu")

    def __call__(self, timestep, pooled_projection):
        t = timestep_embedding(timestep, 256, flip_sin_to_cos=True, downscale_freq_shift=0)
        return self.timestep_embedder(t.astype(pooled_projection.dtype)) + self.text_embedder(pooled_projection)
