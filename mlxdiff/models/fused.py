"""Elementwise pieces of the transformer blocks, each compiled into one kernel (`mx.compile`).

Why: run op by op, MLX materialises every intermediate of a chain such as RoPE's float32 arithmetic or
SwiGLU's silu-times-value, and the lazy graph keeps several alive at once; compiled, a chain holds only its output
and reads its inputs once (figures: bench/RESULTS.md, "Memory floor"). Compiled and plain forms compute the same
ops in the same dtypes, so they give the same numbers (tests run both).

`fused(fn)` returns fn compiled, or fn itself while fusion is off: `set_fusion(False)` or MLXDIFF_FUSE=0 (the plain
MLX-ops reference).

`compiled_block(block, *args)`: a whole transformer block compiled for the shapes of a run. The pacing points inside
the block are not scheduled while it is traced, so the block's outputs, paced by the caller (after_block), are the
unit of work. The pipelines turn it on per phase where it pays and memory allows (memory.compile_blocks_for);
MLXDIFF_COMPILE_BLOCKS=0/1 fixes it.
"""

import os
import weakref

import mlx.core as mx

from .. import pacing

_enabled = os.environ.get("MLXDIFF_FUSE", "1") != "0"
_COMPILE_FIXED = os.environ.get("MLXDIFF_COMPILE_BLOCKS")
_compile_blocks = _COMPILE_FIXED == "1"


def set_block_compilation(enabled: bool, policy=False) -> bool:
    """Compile whole blocks (compiled_block) or not; returns the previous setting. `policy`: a pipeline's
    choice, which MLXDIFF_COMPILE_BLOCKS overrides when set."""
    global _compile_blocks
    previous = _compile_blocks
    if not (policy and _COMPILE_FIXED is not None):
        _compile_blocks = bool(enabled)
    return previous


def forget_compiled(model):
    """Drop the compiled blocks of `model` (their graphs hold the weights of the time they were traced): after a
    change of its layers, e.g. a LoRA added in place."""
    for _, module in model.named_modules():
        module.__dict__.pop("_compiled", None)


def _flatten(args):
    """Arrays out of args that are arrays, None or (named) tuples of arrays, and how to put them back."""
    flat, layout = [], []
    for a in args:
        if isinstance(a, tuple):
            layout.append((type(a), len(a)))
            flat.extend(a)
        else:
            layout.append(None if a is None else "array")
            if a is not None:
                flat.append(a)
    return flat, layout


def _unflatten(flat, layout):
    args, i = [], 0
    for kind in layout:
        if kind is None:
            args.append(None)
        elif kind == "array":
            args.append(flat[i])
            i += 1
        else:
            cls, n = kind
            items = flat[i:i + n]
            args.append(cls(*items) if hasattr(cls, "_fields") else cls(items))
            i += n
    return args


def compiled_block(block, *args):
    """block(*args), through one mx.compile per block object when block compilation is on. The compiled function
    lives on the block, so it (and the weights its graph holds as constants) goes when the model does."""
    if not _compile_blocks:
        return block(*args)
    flat, layout = _flatten(args)
    cache = block.__dict__.setdefault("_compiled", {})
    key = tuple(map(repr, layout))
    if key not in cache:
        owner = weakref.ref(block)    # no cycle block -> cache -> traced -> block

        def traced(*flat_args):
            pacing._suspended[0] += 1
            try:
                return owner()(*_unflatten(list(flat_args), layout))
            finally:
                pacing._suspended[0] -= 1
        cache[key] = mx.compile(traced)
    return cache[key](*flat)


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


CPU_SCORE_BYTES = 256 << 20   # on the CPU, attention runs in query chunks whose score matrix stays below this


def attention(q, k, v, scale):
    """mx.fast.scaled_dot_product_attention(q, k, v, scale), (B, H, S, hd), no mask. On the CPU MLX's SDPA holds
    the whole B x H x S x S float32 score matrix (klein-4B at 1024x1024: 2 GB; a FLUX.2 reference image doubles S),
    so there the queries go in chunks of rows whose scores stay under CPU_SCORE_BYTES, each chunk paced
    (mlxdiff/pacing.py) so that only about one chunk's scores are alive (chained with mx.depends instead, 83 of
    the 128 MiB stayed alive in one evaluation). Each query row's softmax is its own, so the chunks give the same
    numbers. GPU kernels do not hold the matrix: one call."""
    b, h, s, _ = q.shape
    rows = max(1, CPU_SCORE_BYTES // max(1, b * h * k.shape[2] * 4))
    if mx.default_device() != mx.cpu or rows >= s:
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale)
    parts = [pacing.pace(mx.fast.scaled_dot_product_attention(q[:, :, r:r + rows], k, v, scale=scale))
             for r in range(0, s, rows)]
    return mx.concatenate(parts, axis=2)

