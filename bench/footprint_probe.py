"""Where the process's GPU memory goes around a GGUF transformer's load and first forward (issue "The footprint the
user sees"): the FLUX.2-dev Q4_K_M random GGUF loaded step by step as a phase loads it, the process's GPU memory
(NVML, memory.gpu_bytes), MLX's active and cache bytes read after each step.

    python bench/footprint_probe.py F.gguf old    # MLX's own buffer cache (95% of the device), no clear after loading
    python bench/footprint_probe.py F.gguf new    # as mlxdiff now loads: cache capped (memory.cache_limit_for), cleared

Prints one RESULT json line: [step, NVML process GiB, MLX active GiB, MLX cache GiB] for each step.
"""

import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
GB = 1024 ** 3


def main(path, mode):
    import mlxdiff  # noqa: F401  (OpenBLAS / device set-up first)
    import mlx.core as mx
    from flux2_dev_gpu import inputs
    from mlxdiff import memory
    from mlxdiff.loading.matmul import use_strategy
    from mlxdiff.loading.quantize import materialize
    from mlxdiff.loading.sources import transformer_from_file
    from mlxdiff.models import flux2
    from mlxdiff.pacing import pace, settle
    from mlxdiff.policy import RunPolicy, installed

    rows = []

    def read(step):
        mx.synchronize()
        rows.append([step, (memory.gpu_bytes(os.getpid()) or 0) / GB, mx.get_active_memory() / GB,
                     mx.get_cache_memory() / GB, round(time.time(), 2)])
        print(rows[-1], flush=True)

    read("start")
    spec = transformer_from_file(path, flux2)
    policy = RunPolicy(compute_dtype=mx.bfloat16)
    if mode == "new":
        policy = policy.refined(cache_limit=memory.cache_limit_for(policy))
    with installed(policy):
        model = spec.build()
        read("built (lazy)")
        use_strategy(model, "dequantize")
        materialize(model)
        read("materialized")
        if mode == "new":
            mx.clear_cache()
            read("cache cleared")
        img, txt, img_ids, txt_ids = (mx.array(a) for a in inputs(1024))
        phase = memory.decide(policy, model) if mode == "new" else policy.refined(in_flight=2)
        with installed(phase):
            for i in range(2):
                out = model(img.astype(mx.bfloat16), txt.astype(mx.bfloat16), mx.array([0.5]), img_ids, txt_ids,
                            guidance=mx.array([4.0]), after_block=lambda *o: pace(*o))
                mx.eval(out)
                settle()
                read(f"forward {i + 1}")
    mx.clear_cache()
    read("after clear_cache")
    print("RESULT" + json.dumps({"mode": mode, "rows": rows, "peak_mlx_gb": mx.get_peak_memory() / GB}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
