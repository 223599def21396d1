"""Device and dtype policy, and the BLAS fix for mlx-cpu on Linux.

Import this module before `mlx.core` anywhere else: mlx-cpu links a slow reference BLAS (about 4 GFLOP/s), and
Debian's OpenBLAS only takes over when it is loaded into the global symbol namespace before libmlx.
"""

import ctypes
import functools
from contextlib import contextmanager
import os
import re
import sys
import warnings

from . import switches
from .errors import MlxdiffError

OPENBLAS_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib64/libopenblasp.so.0",
    "/usr/lib/libopenblas.so.0",
)

_EARLY = {name: value for name, value in switches.read().items() if name in switches.EARLY}


def _preload_openblas():
    """The OpenBLAS library loaded, or None."""
    if not sys.platform.startswith("linux") or "MLXDIFF_NO_OPENBLAS" in _EARLY:
        return None
    for path in OPENBLAS_CANDIDATES:
        if os.path.exists(path):
            if "mlx.core" in sys.modules:
                warnings.warn("mlx.core was imported before mlxdiff; OpenBLAS cannot take over mlx-cpu's BLAS. "
                              "Import mlxdiff first.", stacklevel=3)
                return None
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            return path
    return None


openblas_path = _preload_openblas()  # the OpenBLAS library in use, or None

import mlx.core as mx  # noqa: E402  (after the preload on purpose)

# MLXDIFF_DEVICE=cpu runs MLX on the CPU on a machine with a GPU (and the PyTorch references too:
# mlxdiff/reference/common.py), e.g. for CPU footprint comparisons on a GPU host. It acts here, at import, because
# MLX's default device is process state that every array made afterwards lives on; a bad value is reported as one
# line when a pipeline or command starts (policy.from_switches).
if _EARLY.get("MLXDIFF_DEVICE") in ("cpu", "gpu"):
    mx.set_default_device(mx.cpu if _EARLY["MLXDIFF_DEVICE"] == "cpu" else mx.gpu)

def on_cpu() -> bool:
    return mx.default_device() == mx.cpu


def warn_if_slow_blas():
    """On Linux CPU without OpenBLAS, say (once per process) how to get the 50x faster BLAS."""
    if not openblas_path and sys.platform.startswith("linux") and on_cpu():
        _warn_slow_blas()


@functools.cache
def _warn_slow_blas():
    print("mlxdiff: warning: OpenBLAS not found; mlx-cpu's built-in BLAS is about 50x slower. "
          "Install it with: sudo apt-get install libopenblas0-pthread", file=sys.stderr)


DTYPES = {"float32": mx.float32, "fp32": mx.float32, "float16": mx.float16, "fp16": mx.float16,
          "bfloat16": mx.bfloat16, "bf16": mx.bfloat16}
# float16 weights and arithmetic with the transformers' residual streams kept in float32: FLUX.2's streams reach
# ~1e5, past float16's 65504 (pure float16 clips them, as diffusers does); for machines without bf16 arithmetic
MIXED = {"float16-mixed": mx.float16, "fp16-mixed": mx.float16}


def compute_dtype(requested=None) -> mx.Dtype:
    """The dtype activations are computed in. Weights keep their stored dtype; only the arithmetic uses this.

    On the CPU the default is float32: bf16 matmuls there accumulate in bf16 and quantized bf16 matmuls lose
    up to 11% at K=4096 (see bench/). On Metal and CUDA the default is bfloat16.
    """
    if requested is None:
        return mx.float32 if on_cpu() else mx.bfloat16
    if isinstance(requested, mx.Dtype):
        return requested
    name = str(requested).lower()
    if name in DTYPES or name in MIXED:
        return DTYPES.get(name) or MIXED[name]
    raise MlxdiffError(f"unknown dtype {requested!r}; use one of float32, float16, bfloat16, float16-mixed")


def stream_dtype(requested=None):
    """The dtype of a transformer's residual streams when it differs from the compute dtype: float32 for
    "float16-mixed" (attention, feed-forward and the weights in float16; the streams, and the gated residual sums into
    them, in float32), else None (the streams are in the compute dtype)."""
    return mx.float32 if isinstance(requested, str) and requested.lower() in MIXED else None


def default_matmul_strategy() -> str:
    """How layers kept quantized multiply (mlxdiff/loading/matmul.py), chosen from measurements (bench/RESULTS.md):
    "dequantize" (one layer dequantized just before an ordinary matmul) on CUDA, where MLX's quantized_matmul is
    about ten times slower at prompt-like sizes, and on the CPU, where the matmul then runs in OpenBLAS; "qmm", MLX's
    quantized kernels, on Metal (the design point; not measurable here). MLXDIFF_MATMUL (the run policy) overrides."""
    if on_cpu() or (hasattr(mx, "cuda") and mx.cuda.is_available()):
        return "dequantize"
    return "qmm"


def physical_memory(working_set=False) -> int:
    """The machine's memory in bytes; `working_set`: on Metal the recommended working set instead (what the GPU may
    use), for keep="auto" without a memory limit."""
    try:
        info = mx.device_info()
        size = (working_set and info.get("max_recommended_working_set_size")) or info.get("memory_size")
        if size:
            return int(size)
    except Exception:  # device_info is backend specific
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


# mx.compile on the CPU builds each fused kernel with the system's C++ compiler into a cache folder under the temp
# folder ($TMPDIR/mlx/<version>/cpu; mlx/backend/cpu/compiled.cpp). What the compiler's output says -> why it failed.
_KERNEL_BUILD_FAILURES = (
    ("No space left on device", "no space left on its device"),
    ("File too large", "a file-size limit stopped the compiler's write"),
    ("Read-only file system", "it is on a read-only file system"),
    ("Permission denied", "permission denied"),
    ("temp_directory_path", "the temp folder does not exist"),
)


def kernel_build_mistake(error: RuntimeError):
    """The MlxdiffError (one line: what failed, what to do) for a RuntimeError of MLX's CPU kernel build that the
    machine's set-up caused (a missing, unwritable or full temp folder; no C++ compiler), else None: any other
    RuntimeError is not a user's mistake and stays as it is."""
    text = str(error)
    if "temp_directory_path" not in text and "Failed to compile function" not in text:
        return None
    if "g++: not found" in text or "return code 127" in text:
        return MlxdiffError("MLX's CPU backend builds its fused kernels with g++, which was not found: install it "
                            "(apt-get install g++)")
    why = next((why for needle, why in _KERNEL_BUILD_FAILURES if needle in text), None)
    if why is None:
        return None      # the compiler failed on the kernel itself: MLX's bug, with its output
    cache = re.search(r"(/[^\s\"']*/mlx)/[^\s\"']*/cpu/", text)     # the compiler's command names the folder
    return MlxdiffError(f"MLX's CPU backend could not build a kernel in its cache {cache[1] if cache else '$TMPDIR/mlx'} "
                        f"({why}): point TMPDIR at a writable folder with free space")


@contextmanager
def kernel_build_errors():
    """The block's MLX CPU kernel-build failures that the machine's set-up caused raised as their MlxdiffError
    line (kernel_build_mistake); every other exception as it is. Around a pipeline phase's work
    (pipelines/residency.py) and a command's (cli.run)."""
    try:
        yield
    except RuntimeError as e:
        mistake = kernel_build_mistake(e)
        if mistake is None:
            raise
        raise mistake from None
