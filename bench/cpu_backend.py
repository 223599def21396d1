"""The effect of mlxdiff's two CPU policies, measured on this machine:

1. OpenBLAS preloaded before MLX (default) vs mlx-cpu's bundled reference BLAS (MLXDIFF_NO_OPENBLAS=1).
2. float32 compute with bf16 weights kept bf16 in memory (default) vs bf16 compute: speed, accuracy against float64,
   and memory (the weights are not copied to float32 as a whole).

Usage: python bench/cpu_backend.py            (prints a markdown table; runs each BLAS setting in a subprocess)
"""

import json
import os
import platform
import subprocess
import sys

CHILD = r"""
import json, sys, time
import numpy as np
import mlxdiff, mlxdiff.backend as backend
import mlx.core as mx
import mlx.nn as nn

def timeit(fn, reps=3):
    fn()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) / reps

out = {"openblas": backend.openblas_path}
a = mx.random.normal((2048, 2048)); b = mx.random.normal((2048, 2048)); mx.eval(a, b)
out["matmul_f32_gflops"] = 2 * 2048 ** 3 / timeit(lambda: mx.eval(a @ b)) / 1e9
x = mx.random.normal((1, 128, 128, 128)); w = mx.random.normal((128, 3, 3, 128)); mx.eval(x, w)
flops = 2 * 128 * 128 * 128 * 128 * 9
out["conv3x3_f32_gflops"] = flops / timeit(lambda: mx.eval(mx.conv2d(x, w, padding=1))) / 1e9

# A linear layer at SD3.5-Medium size: 1357 tokens x 1536 -> 6144, bf16 weights
rng = np.random.default_rng(0)
xw = rng.standard_normal((1357, 1536)).astype(np.float32)
ww = (rng.standard_normal((6144, 1536)) * 0.02).astype(np.float32)
w_bf16 = mx.array(ww).astype(mx.bfloat16); mx.eval(w_bf16)
ref = xw.astype(np.float64) @ np.array(w_bf16.astype(mx.float32)).astype(np.float64).T
x32 = mx.array(xw); x16 = x32.astype(mx.bfloat16); mx.eval(x32, x16)
flops = 2 * 1357 * 1536 * 6144
mx.reset_peak_memory(); base = mx.get_active_memory()
t32 = timeit(lambda: mx.eval(x32 @ w_bf16.T))
out["linear_f32_compute_bf16_weights_gflops"] = flops / t32 / 1e9
out["linear_f32_compute_peak_extra_MB"] = (mx.get_peak_memory() - base) / 1e6
y32 = np.array(x32 @ w_bf16.T)
out["linear_f32_compute_max_rel_err"] = float(np.abs(y32 - ref).max() / np.abs(ref).max())
t16 = timeit(lambda: mx.eval(x16 @ w_bf16.T))
out["linear_bf16_compute_gflops"] = flops / t16 / 1e9
y16 = np.array((x16 @ w_bf16.T).astype(mx.float32))
out["linear_bf16_compute_max_rel_err"] = float(np.abs(y16 - ref).max() / np.abs(ref).max())
out["weight_bytes_bf16_MB"] = w_bf16.nbytes / 1e6
print("RESULT" + json.dumps(out))
"""


def run(no_openblas):
    env = dict(os.environ)
    if no_openblas:
        env["MLXDIFF_NO_OPENBLAS"] = "1"
    p = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, env=env, timeout=1800)
    line = [l for l in p.stdout.splitlines() if l.startswith("RESULT")]
    if not line:
        sys.exit(p.stderr)
    return json.loads(line[0][6:])


def main():
    import mlx.core as mx
    rows = {"OpenBLAS (default)": run(False), "mlx-cpu reference BLAS": run(True)}
    print(f"machine: {platform.node()} {platform.machine()}, {os.cpu_count()} cores; backend: mlx "
          f"{mx.__version__} CPU\n")
    keys = list(next(iter(rows.values())).keys())
    print("| metric | " + " | ".join(rows) + " |")
    print("|---|" + "---|" * len(rows))
    for k in keys:
        vals = [rows[r][k] for r in rows]
        fmt = lambda v: f"{v:.3g}" if isinstance(v, float) else str(v)
        print(f"| {k} | " + " | ".join(fmt(v) for v in vals) + " |")


if __name__ == "__main__":
    main()
