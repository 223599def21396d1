"""What holds the GPU memory that MLX's counters do not show, after a GGUF transformer's load (issue "The footprint
the user sees"): the CUDA runtime's default memory pool (cudaMallocAsync, which MLX's CUDA allocator uses for device
buffers), read through the same libcudart MLX loaded, beside NVML's per-process figure and MLX's active / cache bytes.

    python bench/footprint_pool_probe.py F.gguf

After the load and after a forward: NVML, MLX active, MLX cache, the pool's reserved and used bytes; then the pool
trimmed (cudaMemPoolTrimTo 0) and read again. Prints one RESULT json line.
"""

import ctypes
import glob
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
GB = 1024 ** 3
RESERVED_CURRENT, USED_CURRENT = 5, 7     # cudaMemPoolAttrReservedMemCurrent, cudaMemPoolAttrUsedMemCurrent


def cudart():
    for d in os.environ.get("LD_LIBRARY_PATH", "").split(":") + ["/usr/local/cuda/lib64"]:
        for f in sorted(glob.glob(os.path.join(d, "libcudart.so*"))):
            return ctypes.CDLL(f)
    return ctypes.CDLL("libcudart.so")


def main(path):
    import mlxdiff  # noqa: F401
    import mlx.core as mx
    from flux2_dev_gpu import inputs
    from mlxdiff import memory
    from mlxdiff.loading.component import load_component
    from mlxdiff.loading.sources import transformer_from_file
    from mlxdiff.models import flux2
    from mlxdiff.pacing import pace, settle
    from mlxdiff.policy import RunPolicy, installed

    lib = cudart()
    rows = []

    def pool_attr(attr):
        pool, value = ctypes.c_void_p(), ctypes.c_uint64()
        if lib.cudaDeviceGetDefaultMemPool(ctypes.byref(pool), 0) != 0:
            return None
        if lib.cudaMemPoolGetAttribute(pool, attr, ctypes.byref(value)) != 0:
            return None
        return value.value / GB

    def read(step):
        mx.synchronize()
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        lib.cudaMemGetInfo(ctypes.byref(free), ctypes.byref(total))
        rows.append({"step": step, "nvml": (memory.gpu_bytes(os.getpid()) or 0) / GB,
                     "active": mx.get_active_memory() / GB, "cache": mx.get_cache_memory() / GB,
                     "pool_reserved": pool_attr(RESERVED_CURRENT), "pool_used": pool_attr(USED_CURRENT),
                     "device_used": (total.value - free.value) / GB})
        print(rows[-1], flush=True)

    def trim(step):
        pool = ctypes.c_void_p()
        lib.cudaDeviceGetDefaultMemPool(ctypes.byref(pool), 0)
        rc = lib.cudaMemPoolTrimTo(pool, ctypes.c_size_t(0))
        read(f"{step} (pool trimmed, rc {rc})")

    read("start")
    policy = RunPolicy(compute_dtype=mx.bfloat16)
    spec = transformer_from_file(path, flux2)
    loading = policy.refined(cache_limit=memory.cache_limit_for(policy))     # as Residency.use loads
    with installed(loading):
        model = load_component(spec, loading).model
    read("loaded (load_component)")
    trim("loaded")
    img, txt, img_ids, txt_ids = (mx.array(a) for a in inputs(1024))
    with installed(memory.decide(policy, model)):
        out = model(img.astype(mx.bfloat16), txt.astype(mx.bfloat16), mx.array([0.5]), img_ids, txt_ids,
                    guidance=mx.array([4.0]), after_block=lambda *o: pace(*o))
        mx.eval(out)
        settle()
    read("forward")
    trim("forward")
    mx.clear_cache()
    read("cache cleared")
    trim("cache cleared")
    print("RESULT" + json.dumps(rows), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
