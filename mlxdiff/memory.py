"""Memory probes: MLX's own counters and the process footprint, per platform.

- MLX: active (live arrays), peak (since the last reset) and cache (freed buffers kept for reuse).
- Linux: VmRSS and VmHWM from /proc/self/status.
- macOS: phys_footprint through proc_pid_rusage, which is what Activity Monitor shows (RSS misses GPU memory).
"""

import ctypes
import os
import sys
from dataclasses import dataclass, replace

from . import backend  # noqa: F401
import mlx.core as mx

from .errors import MlxdiffError
from .formats import is_gguf
from .policy import RunPolicy

GB = 1024 ** 3


class _RusageInfoV2(ctypes.Structure):
    _fields_ = [("uuid", ctypes.c_uint8 * 16)] + [(n, ctypes.c_uint64) for n in (
        "user_time", "system_time", "pkg_idle_wkups", "interrupt_wkups", "pageins", "wired_size", "resident_size",
        "phys_footprint", "proc_start_abstime", "proc_exit_abstime", "child_user_time", "child_system_time",
        "child_pkg_idle_wkups", "child_interrupt_wkups", "child_pageins", "child_elapsed_abstime",
        "diskio_bytesread", "diskio_byteswritten")]


def process_footprint(pid=None) -> dict:
    """{'footprint': bytes, 'peak': bytes or None} for a process (this one by default)."""
    pid = pid or os.getpid()
    if sys.platform == "darwin":
        info = _RusageInfoV2()
        libc = ctypes.CDLL("/usr/lib/libSystem.dylib")
        if libc.proc_pid_rusage(pid, 2, ctypes.byref(info)) == 0:  # RUSAGE_INFO_V2
            return {"footprint": info.phys_footprint, "peak": None}
        return {"footprint": None, "peak": None}
    path = "/proc/self/status" if pid == os.getpid() else f"/proc/{pid}/status"
    vals = {}
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(("VmRSS:", "VmHWM:")):
                    key, value = line.split(":", 1)
                    vals[key] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return {"footprint": vals.get("VmRSS"), "peak": vals.get("VmHWM")}


def reset_footprint_peak():
    """Linux: reset VmHWM so that the next reading is the peak of the coming phase (writes 5 to clear_refs)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


@dataclass
class Snapshot:
    active: int
    peak: int
    cache: int
    footprint: int | None
    footprint_peak: int | None


def snapshot() -> Snapshot:
    proc = process_footprint()
    return Snapshot(mx.get_active_memory(), mx.get_peak_memory(), mx.get_cache_memory(),
                    proc["footprint"], proc["peak"])


def fmt_gb(n) -> str:
    if n is None:
        return "-"
    return f"{n / GB:.2f} GB" if n >= GB / 10 else f"{n / 2**20:.1f} MB"


# -- the budget's decisions (each reads the run policy it is given: mlxdiff/policy.py) ----------------------------

def available_bytes():
    """Memory the next phase may use: MemAvailable on Linux, the recommended working set on Metal, else None."""
    if sys.platform.startswith("linux"):
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024 + mx.get_active_memory()
        except OSError:
            return None
    try:
        info = mx.device_info()
        return info.get("max_recommended_working_set_size") or info.get("memory_size")
    except Exception:  # device_info is backend specific
        return None


def budget_bytes(policy: RunPolicy):
    """What a phase may use: the policy's memory limit, else the free memory, else unbounded."""
    budget = [b for b in (policy.memory_limit, available_bytes()) if b]
    return min(budget) if budget else float("inf")


IN_FLIGHT_ROOM = 4 * GB   # free memory above a loaded phase that buys a second piece of work in flight


def in_flight_for(policy: RunPolicy) -> int:
    """How many paced pieces of work (mlxdiff/pacing.py) a phase may queue, decided once its weights are loaded: 2 on
    a GPU while the budget keeps IN_FLIGHT_ROOM free above what is loaded (a second piece costs about one piece's
    transient, bench/RESULTS.md), else 1, the floor (where FLUX.2's SwiGLU also runs in two ranges of its hidden
    axis, flux2.swiglu_rows). On the CPU 1: graph building and compute share the same cores there, so queueing
    more buys little."""
    if mx.default_device() == mx.cpu:
        return 1
    return 2 if budget_bytes(policy) - mx.get_active_memory() >= IN_FLIGHT_ROOM else 1


def compile_blocks_for(model, in_flight: int) -> bool:
    """Whether a phase runs its transformer blocks compiled whole (models/fused.compiled_block): on a GPU with room
    to spare (two pieces in flight), and only for models with no layer that decodes its weight per call (GGUF raw,
    fp8, the dequantize strategy): compiled, a block's decoded weights are no longer paced one at a time, and not
    for a model whose eager blocks are faster (`eager_is_faster()`: FLUX.2 with its fused CUDA norm+RoPE kernel).
    Where it runs, it pays (SD3.5 on the H200: bench/RESULTS.md, "Speed"). Not on the CPU, where the time is in the
    matmuls."""
    if mx.default_device() == mx.cpu or in_flight < 2:
        return False
    if getattr(model, "eager_is_faster", lambda: False)():
        return False
    return not any(getattr(m, "decodes_per_call", False) for _, m in model.named_modules())


CPU_CONV_BAND = 256 << 20   # mlx-cpu unfolds a convolution's input: band it above this working buffer


def conv_band_bytes(policy: RunPolicy):
    """The largest convolution working buffer a VAE may build before it runs in row bands: on the CPU, where the
    convolution unfolds its input, CPU_CONV_BAND (or a sixteenth of a smaller memory limit); on GPUs only under a
    memory limit. None: no bands."""
    limit = policy.memory_limit
    if mx.default_device() == mx.cpu:
        return min(CPU_CONV_BAND, limit // 16) if limit else CPU_CONV_BAND
    return limit // 16 if limit else None


def decide(policy: RunPolicy, model) -> RunPolicy:
    """The policy of a phase whose weights (`model`) are loaded: pieces in flight, block compilation and convolution
    bands from the budget; what a switch fixed (policy.fixed) stays."""
    depth = in_flight_for(policy)
    return policy.refined(in_flight=depth, compile_blocks=compile_blocks_for(model, depth),
                          conv_band=conv_band_bytes(policy))


def check_fits(spec, policy: RunPolicy, compute_dtype=None):
    """Before a component loads: the spec to load, or a refusal, with a line saying what would fit, if its weights
    exceed the budget (the memory limit, else the free memory). A GGUF component whose default layout does not
    fit but whose raw blocks do (formats/gguf.py: the file's own size, decoded a layer at a time) gets the raw
    layout, unless the spec (or MLXDIFF_GGUF_LAYOUT, through the policy) fixes one."""
    budget = [b for b in (policy.memory_limit, available_bytes()) if b]
    if not budget:
        return spec
    need, budget = spec.loaded_nbytes(compute_dtype=compute_dtype), min(budget)
    if need <= budget:
        return spec
    gguf = any(is_gguf(f) for f in spec.files)
    if gguf:
        hint = "use a GGUF file of a smaller quantization type (e.g. Q3_K_M or Q2_K) or a machine with more memory"
        if spec.gguf_layout is None:
            raw = replace(spec, gguf_layout="raw")
            if raw.loaded_nbytes(compute_dtype=compute_dtype) <= budget:
                return raw
    else:
        hint = "no quantization makes it fit; use a machine with more memory"
        for bits in (8, 4):
            estimate = spec.loaded_nbytes(quantize=bits)
            if estimate <= budget:
                hint = f"quantize it: --quantize {spec.name}={bits} (about {fmt_gb(estimate)})"
                break
    limit = "the memory limit" if policy.memory_limit and budget == policy.memory_limit else "the free memory"
    raise MlxdiffError(f"{spec.name} needs {fmt_gb(need)} of weights but {limit} is {fmt_gb(budget)}; {hint}")
