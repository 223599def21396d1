"""Where a klein-4B transformer forward spends its time: each op of one block, MLX beside torch, at the real shapes.

    python bench/block_ops_gpu.py [--size 1024]

klein-4B at 1024x1024: 4096 image + 512 text tokens, width 3072, 24 heads of 128, SwiGLU hidden 9216; 5 double
and 20 single blocks. Each row is the median over 5 rounds of 10 calls, each call evaluated (so launch costs are
in it), after warm-up calls (MLX's CUDA kernels compile on first use). Random bf16 weights. Prints one RESULT json
line; used for bench/RESULTS.md (issue 12, "klein-4B forward"). MLX runs under the policy a run would have
(policy.from_switches: MLXDIFF_IN_FLIGHT / _FUSE apply); the kernel and block-compilation rows set their own.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

D, H, HD, M, TXT = 3072, 24, 128, 9216, 512


QUICK = "--quick" in sys.argv     # a smoke run of the script itself: one call per row


def clock(fn, sync, calls=10, rounds=5):
    if QUICK:
        calls = rounds = 1
    for _ in range(1 if QUICK else 3):
        fn()
    sync()
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        times.append((time.perf_counter() - t) / calls * 1e3)
    return round(statistics.median(times), 3)


def run_mlx(size):
    import mlxdiff  # noqa: F401  (first: it picks mlx-cpu's BLAS)
    from mlxdiff.policy import from_switches, installed
    with installed(from_switches()):    # as a run's phase: paced, MLXDIFF_* switches applied
        return _run_mlx(size)


def _run_mlx(size):
    from dataclasses import replace
    import mlx.core as mx
    import mlx.nn as nn
    from mlxdiff.models import flux2, fused
    from mlxdiff.pacing import settle
    from mlxdiff.policy import current, installed
    base = current()
    S = (size // 16) ** 2 + TXT
    r = lambda *shape: (mx.random.normal(shape, key=mx.random.key(hash(shape) % 1000)) * 0.02).astype(mx.bfloat16)
    x = r(1, S, D)
    w = {n: r(o, i) for n, (o, i) in {"qkv": (3 * D, D), "mlp_in": (2 * M, D), "fused_in": (3 * D + 2 * M, D),
                                       "out": (D, D + M), "q": (D, D)}.items()}
    q4 = r(1, S, H, HD)
    qt = q4.transpose(0, 2, 1, 3)
    qc = mx.contiguous(qt)
    cat = r(1, S, D + M)
    half = r(1, S, 2 * M)
    cos = mx.random.uniform(shape=(S, HD)).astype(mx.float32)
    sin = mx.random.uniform(shape=(S, HD)).astype(mx.float32)
    norm = nn.RMSNorm(HD)
    norm.update({"weight": mx.ones((HD,), mx.bfloat16)})
    wt = {n: mx.contiguous(v.T) for n, v in w.items()}
    cos2 = cos.reshape(S, HD // 2, 2)
    sin2 = (sin.reshape(S, HD // 2, 2) * mx.array([-1.0, 1.0]))

    @mx.compile
    def rope_pairs(x, cos2, sin2):
        pairs = x.reshape(*x.shape[:-1], -1, 2)
        out = pairs.astype(mx.float32) * cos2 + pairs[..., ::-1].astype(mx.float32) * sin2
        return out.reshape(x.shape).astype(x.dtype)

    mx.eval(x, w, wt, q4, qc, cat, half, cos, sin, cos2, sin2)
    scale = HD ** -0.5
    ops = {
        "matmul x@Wqkv.T (S,3072)->(S,9216)": lambda: x @ w["qkv"].T,
        "matmul x@Wq.T (S,3072)->(S,3072), x3 separate": lambda: [x @ w["q"].T for _ in range(3)],
        "matmul x@Wmlp_in.T ->(S,18432)": lambda: x @ w["mlp_in"].T,
        "matmul x@Wfused.T ->(S,27648)": lambda: x @ w["fused_in"].T,
        "matmul cat@Wout.T (S,12288)->(S,3072)": lambda: cat @ w["out"].T,
        "matmul x@Wqkv (pre-transposed weight)": lambda: x @ wt["qkv"],
        "matmul x@Wfused (pre-transposed weight)": lambda: x @ wt["fused_in"],
        "matmul attn@Wa.T + addmm(mlp, Wb.T) (no concat)": lambda: mx.addmm(x @ w["out"][:, :D].T, half[..., :M],
                                                                             w["out"][:, D:].T),
        "sdpa contiguous (1,24,S,128)": lambda: mx.fast.scaled_dot_product_attention(qc, qc, qc, scale=scale),
        "sdpa transposed views": lambda: mx.fast.scaled_dot_product_attention(qt, qt, qt, scale=scale),
        "rope (fused) on (1,24,S,128)": lambda: flux2.apply_rope(qc, cos, sin),
        "rope as pairs, swapped by a strided view": lambda: rope_pairs(qc, cos2, sin2),
        "rope as pairs on the transposed view": lambda: rope_pairs(qt, cos2, sin2),
        "rms_norm heads (1,S,24,128)": lambda: norm(q4),
        "swiglu (S,18432)->(S,9216)": lambda: flux2.swiglu(half),
        "concatenate [attn; mlp] (S,12288)": lambda: mx.concatenate([x, half[..., :M]], axis=-1),
        "layer_norm + scale_shift (S,3072)": lambda: fused.scale_shift(flux2.layer_norm(x, 1e-6), x[:, :1], x[:, 1:2]),
    }
    # scheduled, not waited for, call by call (as torch's launches are): the device's time, not the round trips
    rows = {name: clock(lambda f=f: mx.async_eval(f()), mx.synchronize) for name, f in ops.items()}

    # qk RMSNorm + RoPE (+ the transpose, + the text/image join): the CUDA kernel against the MLX-ops path
    norm.update({"weight": (1 + r(HD) * 20).astype(mx.bfloat16)})
    norm2 = nn.RMSNorm(HD)
    norm2.update({"weight": (1 + r(HD, 1)[:, 0] * 20).astype(mx.bfloat16)})
    cases = {"single (1,S,24,128)": [(q4, norm)], "double parts 512 + S-512": [(q4[:, :TXT], norm2),
                                                                               (q4[:, TXT:], norm)]}

    def norm_rope(parts, kernel):
        with installed(replace(base, cuda_kernels=kernel)):
            return fused.norm_rope(parts, cos, sin, flux2.apply_rope)

    for case, parts in cases.items():
        for kernel in (True, False):
            rows[f"norm+rope {case}, {'kernel' if kernel else 'MLX ops'}"] = clock(
                lambda: mx.async_eval(norm_rope(parts, kernel)), mx.synchronize)
        a, b = (norm_rope(parts, k).astype(mx.float32) for k in (True, False))
        ulp = mx.power(2.0, mx.floor(mx.log2(mx.maximum(mx.abs(b), 1e-30))) - 7)   # bf16 spacing at b
        rows[f"norm+rope {case}, kernel vs MLX ops, max diff in bf16 ulps"] = (mx.abs(a - b) / ulp).max().item()
        rows[f"norm+rope {case}, share of values not identical"] = (a != b).mean().item()

    cfg = flux2.ModelArgs(num_layers=1, num_single_layers=1, attention_head_dim=HD, num_attention_heads=H,
                          joint_attention_dim=7680, in_channels=128, mlp_ratio=3.0, axes_dims_rope=(32, 32, 32, 32),
                          rope_theta=2000, eps=1e-6, guidance_embeds=False)
    model = flux2.Model(cfg)
    model.update(nn.utils.tree_map(lambda a: (a * 0.02).astype(mx.bfloat16), model.parameters()))
    mx.eval(model.parameters())
    single, double = model.single_transformer_blocks[0], model.transformer_blocks[0]
    mod = flux2.ModulationOut(*(r(1, 1, D) for _ in range(3)))
    img, txt = x[:, TXT:], x[:, :TXT]
    mods = [mod, mod]
    for compiled in (False, True):
        tag = "compiled" if compiled else "eager"
        with installed(replace(base, compile_blocks=compiled)):
            for name, call in ((f"single block, {tag}", lambda: fused.compiled_block(single, x, mod, cos, sin)),
                               (f"double block, {tag}", lambda: fused.compiled_block(double, img, txt, mods, mods,
                                                                                      cos, sin))):
                rows[name] = clock(lambda: mx.async_eval(call()), lambda: (mx.synchronize(), settle()))
                settle()
                before = mx.get_active_memory()
                mx.reset_peak_memory()
                mx.eval(call())
                settle()
                rows[name + ", peak above inputs GiB"] = round((mx.get_peak_memory() - before) / 2 ** 30, 3)
    return rows


def run_torch(size):
    import torch
    import torch.nn.functional as F
    from diffusers.models.transformers.transformer_flux2 import (Flux2SingleTransformerBlock,
                                                                  Flux2TransformerBlock)
    S = (size // 16) ** 2 + TXT
    r = lambda *shape: torch.randn(*shape, device="cuda", dtype=torch.bfloat16) * 0.02
    x, cat = r(1, S, D), r(1, S, D + M)
    w = {n: r(o, i) for n, (o, i) in {"qkv": (3 * D, D), "mlp_in": (2 * M, D), "fused_in": (3 * D + 2 * M, D),
                                       "out": (D, D + M)}.items()}
    q = r(1, H, S, HD)
    ops = {
        "matmul x@Wqkv.T (S,3072)->(S,9216)": lambda: F.linear(x, w["qkv"]),
        "matmul x@Wmlp_in.T ->(S,18432)": lambda: F.linear(x, w["mlp_in"]),
        "matmul x@Wfused.T ->(S,27648)": lambda: F.linear(x, w["fused_in"]),
        "matmul cat@Wout.T (S,12288)->(S,3072)": lambda: F.linear(cat, w["out"]),
        "sdpa contiguous (1,24,S,128)": lambda: F.scaled_dot_product_attention(q, q, q),
    }
    rows = {}
    with torch.no_grad():
        rows = {name: clock(f, torch.cuda.synchronize) for name, f in ops.items()}
        single = Flux2SingleTransformerBlock(D, H, HD, mlp_ratio=3.0, eps=1e-6, bias=False).cuda().bfloat16()
        double = Flux2TransformerBlock(D, H, HD, mlp_ratio=3.0, eps=1e-6, bias=False).cuda().bfloat16()
        rot = (torch.rand(S, HD, device="cuda"), torch.rand(S, HD, device="cuda"))
        mod = r(1, 1, 3 * D)
        rows["single block, eager"] = clock(lambda: single(x, None, mod, rot, split_hidden_states=False,
                                                           text_seq_len=TXT), torch.cuda.synchronize)
        mod2 = r(1, 1, 6 * D)
        rows["double block, eager"] = clock(lambda: double(x[:, TXT:], x[:, :TXT], mod2, mod2, rot),
                                            torch.cuda.synchronize)
    return rows


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("side", choices=("mlx", "torch"))
    p.add_argument("--size", type=int, default=1024)
    p.add_argument("--quick", action="store_true")
    a = p.parse_args()
    rows = (run_mlx if a.side == "mlx" else run_torch)(a.size)
    print("RESULT" + json.dumps({"side": a.side, "size": a.size, "ms": rows}), flush=True)
