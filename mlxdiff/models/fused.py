"""Elementwise pieces of the transformer blocks, each compiled into one kernel (`mx.compile`).

Why: run op by op, MLX materialises every intermediate of a chain such as RoPE's float32 arithmetic or
SwiGLU's silu-times-value, and the lazy graph keeps several alive at once; compiled, a chain holds only its output
and reads its inputs once (figures: bench/RESULTS.md, "Memory floor"). Compiled and plain forms compute the same
ops in the same dtypes, so they give the same numbers (tests run both).

`fused(fn)` returns fn compiled, or fn itself where the installed run policy turns fusion off (`fuse=False`,
MLXDIFF_FUSE=0: the plain MLX-ops reference). With no policy installed the pieces are compiled.

`compiled_block(block, *args)`: a whole transformer block compiled for the shapes of a run, where the installed
policy says so (`compile_blocks`: memory.decide turns it on per phase where it pays and memory allows;
MLXDIFF_COMPILE_BLOCKS=0/1 fixes it). The pacing points inside the block are not scheduled while it is traced, so
the block's outputs, paced by the caller (after_block), are the unit of work.
"""

import functools
import weakref
from dataclasses import replace

import mlx.core as mx

from .. import pacing
from ..policy import cuda_kernels, current, installed  # noqa: F401 (cuda_kernels: models ask it here)


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
    policy = current()
    if policy is None or not policy.compile_blocks:
        return block(*args)
    flat, layout = _flatten(args)
    cache = block.__dict__.setdefault("_compiled", {})
    key = tuple(map(repr, layout))
    if key not in cache:
        owner = weakref.ref(block)    # no cycle block -> cache -> traced -> block

        def traced(*flat_args):
            with installed(replace(current(), paced=False)):
                return owner()(*_unflatten(list(flat_args), layout))
        cache[key] = mx.compile(traced)
    return cache[key](*flat)



def double_stream(blocks, x, context, args_of, after_block=None, step_cache=None, residual=None):
    """The double-stream blocks in order, `context, x = block(x, context, *args_of(i))` each through
    compiled_block (then x + residual(i), a ControlNet's, where given), with after_block(context, x) after each and
    the first-block cache's decision after the first
    (pipelines/step_cache.py). Returns (context, x, head, reused): `reused` is the cached residual of the rest of the
    model when the cache reuses it (x is then the first block's output and no later block ran), else None; `head`
    is the image stream after the first block, which step_cache.remember subtracts."""
    head = None
    for i, block in enumerate(blocks):
        x_in = x
        context, x = compiled_block(block, x, context, *args_of(i))
        if residual is not None:
            x = x + residual(i).astype(x.dtype)
        if after_block:
            after_block(context, x)
        if i == 0 and step_cache is not None:
            reused = step_cache.reuse(x - x_in)     # only the image stream reaches the output
            if reused is not None:
                return context, x, x, reused
            head = x
    return context, x, head, None


def through(block, fn, *args):
    """fn(block, *args), for a computation that reads a block's parts rather than calling it (text_llm's blind
    rows): a block the loader wraps (loading/streaming.StreamedBlock, whose weights are in memory only during a
    call) runs it through its `call_with`; any other block is just passed to fn."""
    call_with = getattr(block, "call_with", None)
    return call_with(fn, *args) if call_with is not None else fn(block, *args)


def fusion_on() -> bool:
    policy = current()
    return policy is None or policy.fuse


def fused(fn):
    compiled = mx.compile(fn)

    def call(*args):
        return compiled(*args) if fusion_on() else fn(*args)

    call.__name__, call.__doc__, call.plain = fn.__name__, fn.__doc__, fn
    return call


@fused
def gated_residual(x, gate, y):
    """x + gate * y (the residual of every modulated block), the product in x's dtype (a float32 stream under
    float16 compute: the product is where float16 would overflow)."""
    return x + gate.astype(x.dtype) * y


@fused
def scale_shift(x, scale, shift):
    """x * (1 + scale) + shift (adaLN modulation after the norm)."""
    return x * (1 + scale) + shift


CPU_SCORE_BYTES = 256 << 20   # on the CPU, attention runs in query chunks whose score matrix stays below this


def attention(q, k, v, scale, mask=None):
    """mx.fast.scaled_dot_product_attention(q, k, v, scale, mask), (B, H, S, hd); mask None or a key mask that
    broadcasts to (B, 1, 1, S_k) (boolean: True attends), so query chunks share it. On the CPU MLX's SDPA holds
    the whole B x H x S x S float32 score matrix (klein-4B at 1024x1024: 2 GB; a FLUX.2 reference image doubles S),
    so there the queries go in chunks of rows whose scores stay under CPU_SCORE_BYTES, each chunk paced
    (mlxdiff/pacing.py) so that only about one chunk's scores are alive (chained with mx.depends instead, 83 of
    the 128 MiB stayed alive in one evaluation). Each query row's softmax is its own, so the chunks give the same
    numbers. GPU kernels do not hold the matrix: one call."""
    b, h, s, _ = q.shape
    rows = max(1, CPU_SCORE_BYTES // max(1, b * h * k.shape[2] * 4))
    if mx.default_device() != mx.cpu or rows >= s:
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
    parts = [pacing.pace(mx.fast.scaled_dot_product_attention(q[:, :, r:r + rows], k, v, scale=scale, mask=mask))
             for r in range(0, s, rows)]
    return mx.concatenate(parts, axis=2)


# -- qk RMSNorm + RoPE in one pass (CUDA) ----------------------------------------------------------------------------
#
# Why: on CUDA, per FLUX.2 block, mx.fast.rms_norm on (tokens x heads) rows of 128 and the RoPE chain (a stack of the
# swapped pairs, then the float32 rotation broadcast over heads) cost a seventh of a klein-4B forward (H200,
# bench/block_ops_gpu.py; figures in bench/RESULTS.md, "Speed"). One warp per row does the norm, the rotation and the
# transpose to SDPA's (B, H, S, hd) layout in registers, and joins the text and image parts of a double block without
# a concatenation. It rounds where the MLX-ops path rounds (the norm's output to the input dtype, then times the
# weight, then the float32 rotation cast back), so the two agree to within a rounding of the input dtype (checked on
# the GPU by bench/block_ops_gpu.py). Every other backend, and a policy without fusion or CUDA kernels
# (MLXDIFF_FUSE=0, MLXDIFF_CUDA_KERNELS=0), takes the MLX-ops path.

_NORM_ROPE_SOURCE = """
    constexpr int PER = HD / 32;              // consecutive values per lane: whole rotated pairs
    constexpr long S = ST + SI;
    const long row = (long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    if (row >= (long)NB * S * NH) return;
    const int h = row % NH;
    const long s = (row / NH) % S;
    const long b = row / NH / S;
    const bool text = s < ST;
    const T* src = text ? xt + ((b * ST + s) * NH + h) * HD : xi + ((b * SI + s - ST) * NH + h) * HD;
    const T* w = text ? wt : wi;
    float v[PER];
    float ss = 0.f;
    for (int i = 0; i < PER; i++) {
        v[i] = static_cast<float>(src[lane * PER + i]);
        ss += v[i] * v[i];
    }
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffff, ss, o);
    const float inv = rsqrtf(ss / HD + eps[0]);
    const float* c = ROPE ? cos + s * HD + lane * PER : nullptr;     // without RoPE, cos and sin are placeholders
    const float* sn = ROPE ? sin + s * HD + lane * PER : nullptr;
    T* dst = out + ((b * NH + h) * S + s) * HD + lane * PER;
    for (int i = 0; i < PER; i += 2) {
        // as mx.fast.rms_norm: normalised value rounded to T, then times the weight in T
        const T m0 = w[lane * PER + i] * static_cast<T>(v[i] * inv);
        const T m1 = w[lane * PER + i + 1] * static_cast<T>(v[i + 1] * inv);
        if (!ROPE) {
            dst[i] = m0;
            dst[i + 1] = m1;
            continue;
        }
        const float n0 = static_cast<float>(m0), n1 = static_cast<float>(m1);
        dst[i] = static_cast<T>(n0 * c[i] + (-n1) * sn[i]);
        dst[i + 1] = static_cast<T>(n1 * c[i + 1] + n0 * sn[i + 1]);
    }
"""


@functools.cache
def _norm_rope_kernel():
    return mx.fast.cuda_kernel(name="mlxdiff_norm_rope", input_names=["xt", "xi", "wt", "wi", "cos", "sin", "eps"],
                               output_names=["out"], source=_NORM_ROPE_SOURCE)


@functools.cache
def _eps_array(eps):
    """The kernel's eps input, made once per value (not a new device scalar per block call)."""
    return mx.array(eps, mx.float32)


def norm_rope(parts, cos, sin, rope):
    """parts: [(x (B, S_i, H, hd), RMSNorm), ...], joined along the tokens in this order -> each part RMS-normed by
    its own norm, RoPE'd with cos/sin (S, hd) float32 of the joined sequence -> (B, H, S, hd). `rope(x, cos, sin)` is
    the model's MLX-ops rotation, for the reference path; rope None: no rotation (SD3's joint attention)."""
    x0, norm0 = parts[0]
    b, _, h, hd = x0.shape
    same = all(x.shape[0] == b and x.shape[2:] == x0.shape[2:] and x.dtype == x0.dtype and n.eps == norm0.eps
               for x, n in parts)
    if len(parts) > 2 or not same or hd % 64 or x0.dtype not in (mx.bfloat16, mx.float16, mx.float32) \
            or not cuda_kernels():
        normed = [n(x) for x, n in parts]
        joined = normed[0] if len(normed) == 1 else mx.concatenate(normed, axis=1)
        joined = joined.transpose(0, 2, 1, 3)
        return joined if rope is None else rope(joined, cos, sin)
    (xt, nt), (xi, ni) = parts if len(parts) == 2 else ((x0, norm0), (x0, norm0))
    st = xt.shape[1] if len(parts) == 2 else 0
    si = xi.shape[1]
    rows = b * (st + si) * h
    eps = _eps_array(norm0.eps)
    return _norm_rope_kernel()(
        inputs=[xt, xi, nt.weight.astype(x0.dtype), ni.weight.astype(x0.dtype),
                eps if rope is None else cos, eps if rope is None else sin, eps],
        template=[("T", x0.dtype), ("HD", hd), ("NH", h), ("ST", st), ("SI", si), ("NB", b),
                  ("ROPE", rope is not None)],
        grid=(rows * 32, 1, 1), threadgroup=(256, 1, 1), output_shapes=[(b, h, st + si, hd)],
        output_dtypes=[x0.dtype])[0]


# -- LayerNorm + adaLN modulation in one pass (CUDA) -----------------------------------------------------------------
#
# Why: every modulated block norms its stream (mx.fast.layer_norm, no affine) and then modulates it
# (x * (1 + scale) + shift), two passes over the tokens; on the H200 the pair costs 2.5-3.3x this one pass
# (bench/RESULTS.md, "Speed, second round"). One block of threads per token row: mean and variance in float32 (two
# passes over registers), the normalised value rounded to T as mx.fast.layer_norm rounds it, then the modulation in
# T op by op as the fused MLX ops do it. In bfloat16 / float16 the two paths differ in 2e-6 / 2e-5 of the values, by
# at most 1.3 ulps (a float32 sum's order moving a rounding); float32 differed more (up to 289 ulps of the terms in
# 16% of the values, the variance's arithmetic) and keeps the MLX ops. Other backends and a policy without fusion
# or CUDA kernels take the MLX ops.

_NORM_MODULATE_SOURCE = """
    constexpr int PER = D / THREADS;
    const long row = blockIdx.x;
    const int t = threadIdx.x;
    const long b = row / S;
    const auto* src = x + row * D;       // T, or float32 (a wider stream: WIDE)
    float v[PER];
    float sum = 0.f;
    for (int i = 0; i < PER; i++) {
        v[i] = static_cast<float>(src[t + i * THREADS]);
        sum += v[i];
    }
    __shared__ float partial[THREADS / 32];
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffff, sum, o);
    if (t % 32 == 0) partial[t / 32] = sum;
    __syncthreads();
    float total = 0.f;
    for (int i = 0; i < THREADS / 32; i++) total += partial[i];
    const float mean = total / D;
    __syncthreads();
    float sq = 0.f;
    for (int i = 0; i < PER; i++) {
        const float d = v[i] - mean;
        sq += d * d;
    }
    for (int o = 16; o > 0; o >>= 1) sq += __shfl_xor_sync(0xffffffff, sq, o);
    if (t % 32 == 0) partial[t / 32] = sq;
    __syncthreads();
    float var = 0.f;
    for (int i = 0; i < THREADS / 32; i++) var += partial[i];
    const float inv = rsqrtf(var / D + eps[0]);
    const T* sc = scale + b * D;
    const T* sh = shift + b * D;
    T* dst = out + row * D;
    const T one = static_cast<T>(1.0f);
    for (int i = 0; i < PER; i++) {
        const int c = t + i * THREADS;
        if (WIDE) {      // as the MLX ops: the norm and the modulation in float32, (1 + scale) in T, one rounding
            dst[c] = static_cast<T>((v[i] - mean) * inv * static_cast<float>(one + sc[c]) + static_cast<float>(sh[c]));
        } else {
            const T n = static_cast<T>((v[i] - mean) * inv);
            dst[c] = n * (one + sc[c]) + sh[c];
        }
    }
"""


@functools.cache
def _norm_modulate_kernel():
    return mx.fast.cuda_kernel(name="mlxdiff_norm_modulate", input_names=["x", "scale", "shift", "eps"],
                               output_names=["out"], source=_NORM_MODULATE_SOURCE)


NORM_THREADS = 256


def norm_modulate(x, scale, shift, eps):
    """scale_shift(LayerNorm(x) without affine, scale, shift) in the modulation's dtype: x (B, S, D), the stream
    (the modulation's dtype, or float32 when the stream is kept wider); scale, shift (B, 1, D), adaLN's modulation
    of each batch row. On CUDA one kernel (above); the MLX ops are the reference path."""
    b, d = x.shape[0], x.shape[-1]
    dtype = scale.dtype
    wide = x.dtype == mx.float32 and dtype != mx.float32
    if (x.ndim != 3 or d % NORM_THREADS or d // NORM_THREADS > 32 or not x.size or scale.size != b * d
            or shift.size != b * d or shift.dtype != dtype or not (x.dtype == dtype or wide)
            or dtype not in (mx.bfloat16, mx.float16) or not cuda_kernels()):
        return scale_shift(mx.fast.layer_norm(x, None, None, eps), scale, shift).astype(dtype)
    return _norm_modulate_kernel()(
        inputs=[x, scale.reshape(b, d), shift.reshape(b, d), _eps_array(eps)],
        template=[("T", dtype), ("D", d), ("S", x.shape[1]), ("THREADS", NORM_THREADS), ("WIDE", wide)],
        grid=(x.shape[0] * x.shape[1] * NORM_THREADS, 1, 1), threadgroup=(NORM_THREADS, 1, 1),
        output_shapes=[x.shape], output_dtypes=[dtype])[0]
