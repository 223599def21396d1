"""Device and dtype policy, and the BLAS fix for mlx-cpu on Linux.

Import this module before `mlx.core` anywhere else: mlx-cpu links a slow reference BLAS (about 4 GFLOP/s), and
Debian's OpenBLAS only takes over when it is loaded into the global symbol namespace before libmlx.
"""

import ctypes
import os
import sys
import warnings

OPENBLAS_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib64/libopenblasp.so.0",
    "/usr/lib/libopenblas.so.0",
)

openblas_path = None  # the OpenBLAS library in use, or None


def _preload_openblas():
    global openblas_path
    if not sys.platform.startswith("linux") or os.environ.get("MLXDIFF_NO_OPENBLAS"):
        return
    for path in OPENBLAS_CANDIDATES:
        if os.path.exists(path):
            if "mlx.core" in sys.modules:
                warnings.warn("mlx.core was imported before mlxdiff; OpenBLAS cannot take over mlx-cpu's BLAS. "
                              "Import mlxdiff first.", stacklevel=3)
                return
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            openblas_path = path
            return


_preload_openblas()

import mlx.core as mx  # noqa: E402  (after the preload on purpose)

# MLXDIFF_DEVICE=cpu runs MLX on the CPU on a machine with a GPU (and the PyTorch references too:
# mlxdiff/reference/common.py), e.g. for CPU footprint comparisons on a GPU host.
# A bad value is reported by check_settings() (the CLI's first step, and compute_dtype()), as one line.
_DEVICE = os.environ.get("MLXDIFF_DEVICE")
if _DEVICE in ("cpu", "gpu"):
    mx.set_default_device(mx.cpu if _DEVICE == "cpu" else mx.gpu)


def check_settings():
    if _DEVICE not in (None, "", "cpu", "gpu"):
        from .errors import MlxdiffError
        raise MlxdiffError(f"MLXDIFF_DEVICE={_DEVICE!r:.40}: expected cpu or gpu (or leave it unset)")

_warned_blas = False


def on_cpu() -> bool:
    return mx.default_device() == mx.cpu


def warn_if_slow_blas():
    """Once per process: on Linux CPU without OpenBLAS, say how to get the 50x faster BLAS."""
    global _warned_blas
    if _warned_blas or openblas_path or not sys.platform.startswith("linux") or not on_cpu():
        return
    _warned_blas = True
    print("mlxdiff: warning: OpenBLAS not found; mlx-cpu's built-in BLAS is about 50x slower. "
          "Install it with: sudo apt-get install libopenblas0-pthread", file=sys.stderr)


DTYPES = {"float32": mx.float32, "fp32": mx.float32, "float16": mx.float16, "fp16": mx.float16,
          "bfloat16": mx.bfloat16, "bf16": mx.bfloat16}


def compute_dtype(requested=None) -> mx.Dtype:
    """The dtype activations are computed in. Weights keep their stored dtype; only the arithmetic uses this.

    On the CPU the default is float32: bf16 matmuls there accumulate in bf16 and quantized bf16 matmuls lose
    up to 11% at K=4096 (see bench/). On Metal and CUDA the default is bfloat16.
    """
    check_settings()
    if requested is None:
        return mx.float32 if on_cpu() else mx.bfloat16
    if isinstance(requested, mx.Dtype):
        return requested
    from .errors import MlxdiffError
    try:
        return DTYPES[str(requested).lower()]
    except KeyError:
        raise MlxdiffError(f"unknown dtype {requested!r}; use one of float32, float16, bfloat16") from None


def default_matmul_strategy() -> str:
    """How layers kept quantized multiply (mlxdiff.pipelines.matmul), chosen from measurements (bench/RESULTS.md):
    "dequantize" (one layer dequantized just before an ordinary matmul) on CUDA, where MLX's quantized_matmul is
    about ten times slower at prompt-like sizes, and on the CPU, where the matmul then runs in OpenBLAS; "qmm", MLX's
    quantized kernels, on Metal (the design point; not measurable here). MLXDIFF_MATMUL=qmm|dequantize overrides."""
    forced = os.environ.get("MLXDIFF_MATMUL")
    if forced:
        return forced
    if on_cpu() or (hasattr(mx, "cuda") and mx.cuda.is_available()):
        return "dequantize"
    return "qmm"
