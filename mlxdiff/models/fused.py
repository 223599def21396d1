"""Elementwise pieces of the transformer blocks, each compiled into one kernel (`mx.compile`).

Why: run op by op, MLX materialises every intermediate of a chain such as RoPE's float32 arithmetic or
SwiGLU's silu-times-value, and the lazy graph keeps several alive at once; compiled, a chain holds only its output
and reads its inputs once (figures: bench/RESULTS.md, "Memory floor"). Compiled and plain forms compute the same
ops in the same dtypes, so they give the same numbers (tests run both).

`fused(fn)` returns fn compiled, or fn itself while fusion is off: `set_fusion(False)` or MLXDIFF_FUSE=0 (the plain
MLX-ops reference).
"""

import os

import mlx.core as mx

_enabled = os.environ.get("MLXDIFF_FUSE", "1") != "0"


def set_fusion(enabled: bool) -> bool:
    """Turn compiled elementwise pieces on or off; returns the previous setting."""
    global _enabled
    previous, _enabled = _enabled, bool(enabled)
    return previous


def fusion_enabled() -> bool:
    return _enabled


def fused(fn):
    compiled = mx.compile(fn)

    def call(*args):
        return compiled(*args) if _enabled else fn(*args)

    call.__name__, call.__doc__, call.plain = fn.__name__, fn.__doc__, fn
    return call


@fused
def gated_residual(x, gate, y):
    """x + gate * y (the residual of every modulated block)."""
    return x + gate * y


@fused
def scale_shift(x, scale, shift):
    """x * (1 + scale) + shift (adaLN modulation after the norm)."""
    return x * (1 + scale) + shift
