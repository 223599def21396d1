"""How fast torch's bf16 and float32 matmuls, and MLX's float32 matmul, run on this CPU (GFLOP/s): whether
diffusers' bf16 CPU runs can finish here, and which BLAS MLX's CPU device has (bench/RESULTS.md, "SD3.5 Medium
with a quantized T5-XXL").

    python bench/torch_cpu_bf16.py [--size 512] [--mlx]

--mlx adds MLX's float32 matmul on its CPU device (mlxdiff imported first, so that mlx-cpu gets OpenBLAS where
mlxdiff/backend.py finds it; the mlx-cuda wheel links its own BLAS).
"""

import argparse
import time

import torch


def rate(fn, n):
    fn()
    start = time.perf_counter()
    fn()
    return 2 * n ** 3 / (time.perf_counter() - start) / 1e9


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--size", type=int, default=512)
    p.add_argument("--mlx", action="store_true")
    args = p.parse_args()
    n = args.size
    a, b = torch.randn(n, n, dtype=torch.bfloat16), torch.randn(n, n, dtype=torch.bfloat16)
    linear = torch.nn.Linear(n, n, bias=False).bfloat16()
    rows = {"bf16 a @ b": rate(lambda: a @ b, n), "bf16 nn.Linear": rate(lambda: linear(a), n)}
    af, bf = a.float(), b.float()
    rows["float32 a @ b"] = rate(lambda: af @ bf, n)
    if args.mlx:
        import mlxdiff  # noqa: F401  (before mlx.core: it picks mlx-cpu's BLAS)
        import mlx.core as mx
        x = mx.random.normal((n, n), stream=mx.cpu)
        mx.eval(x)
        rows["MLX float32 a @ b (CPU device)"] = rate(lambda: mx.eval(mx.matmul(x, x, stream=mx.cpu)), n)
    for name, gflops in rows.items():
        print(f"{name} ({n}^3): {gflops:.2f} GFLOP/s")
