"""How fast torch's bf16 and float32 matmuls run on this CPU (GFLOP/s), to tell whether diffusers' bf16 CPU runs
can finish here (bench/RESULTS.md, "SD3.5 Medium with a quantized T5-XXL").

    python bench/torch_cpu_bf16.py [--size 512]
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
    n = p.parse_args().size
    a, b = torch.randn(n, n, dtype=torch.bfloat16), torch.randn(n, n, dtype=torch.bfloat16)
    linear = torch.nn.Linear(n, n, bias=False).bfloat16()
    rows = {"bf16 a @ b": rate(lambda: a @ b, n), "bf16 nn.Linear": rate(lambda: linear(a), n)}
    af, bf = a.float(), b.float()
    rows["float32 a @ b"] = rate(lambda: af @ bf, n)
    for name, gflops in rows.items():
        print(f"{name} ({n}^3): {gflops:.2f} GFLOP/s")
