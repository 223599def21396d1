"""Where a FLUX.2 block's transient memory goes: each piece of a double and a single block measured alone (peak
above its inputs against the bytes of its output), then whole blocks, then the quantized forms.

    python bench/block_memory.py [--dim 6144 --heads 48 --img 4096 --txt 512 --dtype bfloat16] [--bits 4]

Random weights at FLUX.2-dev's widths by default; prints one RESULT json line per measurement (MB above what was
live before the call; "out" is the output's own size). Used for bench/RESULTS.md, "Memory floor". The blocks run
under the policy a run would have (policy.from_switches: MLXDIFF_IN_FLIGHT / _FUSE / _CUDA_KERNELS apply), the
quantized forms at the depths they name.
"""

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import mlxdiff  # noqa: F401,E402
import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402

from mlxdiff.models import flux2  # noqa: E402
from mlxdiff.policy import current, from_switches, installed  # noqa: E402

MB = 1 << 20


def nbytes(tree):
    return sum(a.nbytes for a in (tree if isinstance(tree, (list, tuple)) else [tree]) if isinstance(a, mx.array))


def measure(name, fn, *inputs, repeat=3):
    mx.eval(inputs)
    mx.synchronize()
    best, peak = None, 0
    for _ in range(repeat):
        base = mx.get_active_memory()
        mx.reset_peak_memory()
        t = time.perf_counter()
        out = fn(*inputs)
        mx.eval(out)
        mx.synchronize()
        dt = time.perf_counter() - t
        peak = max(peak, mx.get_peak_memory() - base)
        best = dt if best is None else min(best, dt)
        size = nbytes(out)
        del out
    print("RESULT" + json.dumps({"piece": name, "peak_above_mb": round(peak / MB, 1), "out_mb": round(size / MB, 1),
                                 "ms": round(best * 1e3, 2)}), flush=True)


def main():
    with installed(from_switches()):    # as a run's phase: paced, MLXDIFF_* switches applied
        measure_all()


def measure_all():
    p = argparse.ArgumentParser()
    p.add_argument("--dim", type=int, default=6144)
    p.add_argument("--heads", type=int, default=48)
    p.add_argument("--img", type=int, default=4096)
    p.add_argument("--txt", type=int, default=512)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--bits", type=int, default=4)
    args = p.parse_args()
    dtype = getattr(mx, args.dtype)
    dim, heads = args.dim, args.heads
    hd = dim // heads
    mlp = 3 * dim
    n = args.img + args.txt
    print("RESULT" + json.dumps({"backend": f"mlx {mx.__version__} {mx.default_device()}", "dim": dim,
                                 "tokens": n, "dtype": args.dtype}), flush=True)
    mx.random.seed(0)
    single = flux2.SingleTransformerBlock(dim, heads, hd, mlp, 1e-6)
    double = flux2.TransformerBlock(dim, heads, hd, mlp, 1e-6)
    for block in (single, double):
        block.update(nn.utils.tree_map(lambda a: (a * 0.02).astype(dtype) if a.ndim > 1 else a.astype(dtype),
                                       block.parameters()))
    mx.eval(single.parameters(), double.parameters())
    x = mx.random.normal((1, n, dim)).astype(dtype)
    ximg, xtxt = x[:, args.txt:], x[:, :args.txt]
    ids = mx.arange(n)
    cos, sin = flux2.rope_tables(mx.stack([ids * 0, ids // 64, ids % 64, ids * 0], axis=1), (32, 32, 32, 32), 2000) \
        if hd == 128 else flux2.rope_tables(mx.stack([ids] * 4, axis=1), (hd // 4,) * 4, 2000)
    mod = lambda k: flux2.ModulationOut(*(mx.random.normal((1, 1, dim)).astype(dtype) * 0.1 for _ in range(3)))  # noqa
    m1, m2, m3, m4, ms = (mod(i) for i in range(5))

    att = single.attn
    inner = dim
    proj = att.to_qkv_mlp_proj(x)
    mx.eval(proj)
    qkv = proj[..., :3 * inner]
    mlp_in = proj[..., 3 * inner:]
    q, k, v = (t.reshape(1, n, heads, hd) for t in mx.split(qkv, 3, axis=-1))
    qn, kn = att.norm_q(q), att.norm_k(k)
    mx.eval(q, k, v, qn, kn)
    measure("modulate (layer_norm*(1+s)+b)", lambda a: flux2.modulate(a, ms, 1e-6), x)
    measure("single: to_qkv_mlp_proj (matmul)", att.to_qkv_mlp_proj, x)
    measure("single: split+reshape+norm q", lambda a: att.norm_q(mx.split(a[..., :3 * inner], 3, axis=-1)[0]
                                                                 .reshape(1, n, heads, hd)), proj)
    measure("rope on q (transposed)", lambda a: flux2.apply_rope(a.transpose(0, 2, 1, 3), cos, sin), qn)
    measure("sdpa (roped q,k,v)", lambda a, b, c: mx.fast.scaled_dot_product_attention(
        a.transpose(0, 2, 1, 3), b.transpose(0, 2, 1, 3), c.transpose(0, 2, 1, 3), scale=hd ** -0.5), qn, kn, v)
    rope = lambda a: flux2.apply_rope(a.transpose(0, 2, 1, 3), cos, sin)
    measure("attention() incl. rope", lambda a, b, c: flux2.attention(rope(a), rope(b), c), qn, kn, v)
    measure("swiglu", flux2.swiglu, mlp_in)
    att_out = flux2.attention(rope(qn), rope(kn), v)
    act = flux2.swiglu(mlp_in)
    mx.eval(att_out, act)
    measure("concat [attn; mlp]", lambda a, b: mx.concatenate([a, b], axis=-1), att_out, act)
    cat = mx.concatenate([att_out, act], axis=-1)
    measure("single: to_out (matmul)", att.to_out, cat)
    del proj, qkv, mlp_in, q, k, v, qn, kn, att_out, act, cat
    measure("single block, whole", lambda a: single(a, ms, cos, sin), x)
    measure("double: ff (img)", lambda a: double.ff(a), ximg)
    measure("double: attn", lambda a, b: double.attn(a, b, cos, sin), ximg, xtxt)
    measure("double block, whole", lambda a, b: double(a, b, (m1, m2), (m3, m4), cos, sin), ximg, xtxt)

    from dataclasses import replace
    from mlxdiff.loading.matmul import use_strategy
    from mlxdiff.pacing import settle
    base = current()
    for strategy, in_flight in (("qmm", 2), ("dequantize", 1), ("dequantize", 2), ("dequantize", 4)):
        settle()
        with installed(replace(base, in_flight=in_flight)):
            for block in (single, double):
                if strategy == "qmm" and not isinstance(block.attn.to_out if block is single else
                                                        block.ff.linear_in, nn.QuantizedLinear):
                    nn.quantize(block, group_size=32, bits=args.bits)
                use_strategy(block, strategy)
            mx.eval(single.parameters(), double.parameters())
            name = f"{args.bits}-bit {strategy}, in flight {in_flight}"
            measure(f"single block, {name}", lambda a: single(a, ms, cos, sin), x)
            measure(f"double block, {name}", lambda a, b: double(a, b, (m1, m2), (m3, m4), cos, sin), ximg, xtxt)


if __name__ == "__main__":
    main()
