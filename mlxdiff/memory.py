"""Memory: what a process holds, read as each platform shows it, and the budget's decisions.

What the process holds (process_memory, sampled through a phase by PeakSampler) is the headline of every report;
MLX's own counters are its breakdown:
- macOS: phys_footprint through proc_pid_rusage, what Activity Monitor shows (GPU buffers included);
- CUDA: what the device holds for the process: while it is the only process on the device, the device's memory in use
  less the idle reading (NVML, nvidia-ml-py), which counts MLX's managed buffers too; NVML's per-process figure
  (what nvidia-smi lists per process: MLX's device arrays, its buffer cache and the CUDA context) misses those, and
  is the reading, named as such, only where other processes share the device;
- the CPU (Linux): VmRSS, anonymous plus file-backed pages (the mapped weights), with VmHWM for the peak;
- MLX: active (live arrays), peak (since the last reset) and cache (freed buffers kept for reuse).
"""

import ctypes
import functools
import os
import sys
import threading
from dataclasses import dataclass, field, replace

from . import backend  # noqa: F401
import mlx.core as mx

from .errors import MlxdiffError
from .formats import format_of
from .policy import RunPolicy

GB = 1024 ** 3


class _RusageInfoV2(ctypes.Structure):
    _fields_ = [("uuid", ctypes.c_uint8 * 16)] + [(n, ctypes.c_uint64) for n in (
        "user_time", "system_time", "pkg_idle_wkups", "interrupt_wkups", "pageins", "wired_size", "resident_size",
        "phys_footprint", "proc_start_abstime", "proc_exit_abstime", "child_user_time", "child_system_time",
        "child_pkg_idle_wkups", "child_interrupt_wkups", "child_pageins", "child_elapsed_abstime",
        "diskio_bytesread", "diskio_byteswritten")]


def _linux_status(pid) -> dict:
    """VmRSS (anonymous + file-backed + shared pages resident) and VmHWM (its peak) of a Linux process, in bytes."""
    vals = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(("VmRSS:", "VmHWM:")):
                    key, value = line.split(":", 1)
                    vals[key] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return vals


def phys_footprint(pid) -> int | None:
    """macOS: the process's phys_footprint (proc_pid_rusage, RUSAGE_INFO_V2): what Activity Monitor shows as its
    memory, GPU buffers included (unified memory)."""
    info = _RusageInfoV2()
    try:
        libc = ctypes.CDLL("/usr/lib/libSystem.dylib")
    except OSError:
        return None
    return info.phys_footprint if libc.proc_pid_rusage(int(pid), 2, ctypes.byref(info)) == 0 else None


@functools.cache
def _nvml():
    """pynvml (nvidia-ml-py), initialised, or None where there is no NVIDIA driver or no nvidia-ml-py."""
    try:
        import pynvml  # optional: nvidia-ml-py, only where there is an NVIDIA driver
        pynvml.nvmlInit()
        return pynvml
    except Exception:  # ImportError, or NVMLError of any kind: no NVML here
        return None


def gpu_bytes(pid) -> int | None:
    """The GPU memory NVML counts for a process, over every GPU (what nvidia-smi lists per process: its allocations,
    caches and CUDA context, not CUDA managed memory). None where NVML is missing or does not list the process (e.g.
    a container whose PID namespace NVML does not see: then `gpu_used_bytes` less a baseline is the fallback)."""
    listed = gpu_processes()
    if listed is None or pid not in listed:
        return None
    return listed[pid]


def gpu_processes() -> dict | None:
    """pid -> the GPU bytes NVML counts for it, summed over GPUs, for every process NVML lists as computing; None
    where NVML is missing or does not answer per process."""
    nvml = _nvml()
    if nvml is None:
        return None
    listed = {}
    try:
        for index in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            for proc in nvml.nvmlDeviceGetComputeRunningProcesses(handle):
                if proc.usedGpuMemory is not None:
                    listed[proc.pid] = listed.get(proc.pid, 0) + proc.usedGpuMemory
    except Exception:  # NVMLError: a driver that does not answer per process
        return None
    return listed


@functools.cache
def _listed_per_process() -> bool:
    """Whether NVML lists this process (MLX's import made its CUDA context): then a process it does not list holds
    no GPU memory, rather than living in a PID namespace NVML does not see."""
    return gpu_bytes(os.getpid()) is not None


def gpu_used_bytes() -> int | None:
    """Memory in use on every GPU, whoever holds it (NVML), or None."""
    nvml = _nvml()
    if nvml is None:
        return None
    try:
        return sum(nvml.nvmlDeviceGetMemoryInfo(nvml.nvmlDeviceGetHandleByIndex(i)).used
                   for i in range(nvml.nvmlDeviceGetCount()))
    except Exception:  # NVMLError
        return None


def process_memory(pid=None, device=None, gpu_baseline=None) -> dict:
    """What a process (this one by default) holds, as the platform shows it:
    {"footprint": the headline bytes, "kind": what it measured, "host": host RSS, "host_peak": VmHWM, "gpu": GPU
    bytes}. The headline is phys_footprint on macOS (unified memory: GPU buffers included); for a process on an
    NVIDIA GPU (`device` "gpu"; None: this process's MLX device) what the device holds for it: with `gpu_baseline`
    (the device's idle reading) and no other process on the device, the memory in use less that baseline (managed
    buffers included), or NVML's per-process figure where that is larger; with others on the device, NVML's
    per-process figure (its kind says managed buffers are not counted); where NVML does not list the process, the
    memory in use less the baseline; otherwise (the CPU) VmRSS, anonymous plus file-backed pages: mlxdiff maps
    safetensors weights into memory, and those mapped pages are file-backed, so anonymous memory alone would miss
    the weights."""
    pid = pid or os.getpid()
    if sys.platform == "darwin":
        footprint = phys_footprint(pid)
        return {"footprint": footprint, "kind": "phys_footprint", "host": footprint, "host_peak": None, "gpu": None}
    status = _linux_status(pid)
    out = {"footprint": status.get("VmRSS"), "kind": "RSS", "host": status.get("VmRSS"),
           "host_peak": status.get("VmHWM"), "gpu": None}
    if (device or ("cpu" if backend.on_cpu() else "gpu")) == "gpu":
        gpu, kind = device_bytes(pid, gpu_baseline)
        if gpu is not None:
            out.update(footprint=gpu, kind=kind, gpu=gpu)
    return out


@dataclass(frozen=True)
class GpuBaseline:
    """The device before a measured process held anything: memory in use (`used`) and what NVML then counted for
    each process already there (`others`, pid -> bytes), whose later growth is theirs, not the measured one's."""
    used: int
    others: dict = field(default_factory=dict)


def gpu_snapshot(without=None) -> GpuBaseline | None:
    """The device now, as a baseline: in use (less what NVML counts for `without`, a process measuring itself, whose
    CUDA context is its own), and every other listed process's bytes. None without NVML."""
    used = gpu_used_bytes()
    if used is None:
        return None
    listed = gpu_processes() or {}
    own = listed.pop(without, 0) if without is not None else 0
    return GpuBaseline(used - own, listed)


def device_bytes(pid, gpu_baseline=None) -> tuple:
    """(bytes, kind): what the GPUs hold for `pid`, as process_memory says, or (None, "") where nothing is read.
    With a baseline: the memory in use less it, less what the other processes' NVML figures grew by since (their
    managed buffers, which NVML does not show, would count here: the kind says so where others are there)."""
    listed = gpu_processes()
    own = None if listed is None else listed.get(pid)
    base = GpuBaseline(gpu_baseline) if isinstance(gpu_baseline, int) else gpu_baseline
    used = gpu_used_bytes() if base is not None else None
    if own is None:
        if listed is not None and _listed_per_process():
            return 0, "GPU (NVML, this process)"    # NVML lists processes here, and not this one: it holds nothing
        return ((max(0, used - base.used), "GPU (in use less the idle baseline)") if used is not None
                else (None, ""))
    if used is None:
        return own, "GPU (NVML, this process; no idle baseline: managed buffers not counted)"
    others = {p: b for p, b in listed.items() if p != pid}
    grown = sum(max(0, b - base.others.get(p, 0)) for p, b in others.items())
    whole = max(own, used - base.used - grown)
    changed = sum(1 for p, b in others.items() if b != base.others.get(p, 0))
    return whole, ("GPU (device in use less idle: managed buffers included)" if not changed else
                   f"GPU (device in use less idle and the NVML growth of {changed} other process(es): managed "
                   "buffers included, theirs too)")


@functools.cache
def _libc_trim():
    """glibc's malloc_trim, or None (macOS, musl, Windows)."""
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


def release_host_memory():
    """Give the C heap's free memory back to the system (glibc malloc_trim). Why: buffers freed by MLX on the CPU
    and by numpy while a file is converted stay in glibc's heap once its mmap threshold has grown, so a phase's
    transients would stay in the process's RSS after the phase (a GGUF load: bench/RESULTS.md, "The footprint the
    user sees"). Elsewhere nothing to do."""
    trim = _libc_trim()
    if trim is not None:
        trim(0)


def reset_footprint_peak():
    """Linux: reset VmHWM so that the next reading is the peak of the coming phase (writes 5 to clear_refs)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


class PeakSampler:
    """Reads process_memory (and MLX's cache bytes) every `interval` s on a background thread while it is entered,
    keeping the largest of each: a phase's real peak, not its reading at the end. On Linux CPU runs the process's own
    VmHWM (reset when entered) also counts, so an RSS spike between two readings is not missed."""

    def __init__(self, interval=0.02, device=None, gpu_baseline=None):
        self.interval, self.device, self.gpu_baseline = interval, device, gpu_baseline
        self.peak, self.cache_peak, self.kind, self.last = None, 0, None, None
        self._stop = threading.Event()
        self._thread = None

    def read(self):
        now = process_memory(device=self.device, gpu_baseline=self.gpu_baseline)
        self.kind, self.last = now["kind"], now["footprint"]
        values = [v for v in (now["footprint"], self.peak, now["host_peak"] if now["kind"] == "RSS" else None)
                  if v is not None]
        self.peak = max(values) if values else None
        self.cache_peak = max(self.cache_peak, mx.get_cache_memory())
        return now

    def _run(self):
        while not self._stop.wait(self.interval):
            self.read()

    def __enter__(self):
        reset_footprint_peak()
        self.read()
        self._thread = threading.Thread(target=self._run, daemon=True, name="mlxdiff-memory-sampler")
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.read()
        return False


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
    if getattr(model, "eager_is_faster", lambda: False)() or getattr(model, "streamed_blocks", 0):
        return False      # (a streamed block's weights change at every call: nothing to compile them into)
    return not any(getattr(m, "decodes_per_call", False) for _, m in model.named_modules())


CPU_CONV_BAND = 256 << 20   # mlx-cpu unfolds a convolution's input: band it above this working buffer


def conv_band_bytes(policy: RunPolicy):
    """The largest convolution working buffer a VAE may build before it runs in row bands: on the CPU, where the
    convolution unfolds its input, CPU_CONV_BAND (or a sixteenth of a smaller memory limit); on Metal only under a
    memory limit; on CUDA never (cuDNN does not unfold: at 1024x1024 the banded decode peaked at what the whole one
    did, and its other algorithms moved the image by 1-4 levels; bench/RESULTS.md, "Streaming, third GPU job").
    None: no bands."""
    limit = policy.memory_limit
    if mx.default_device() == mx.cpu:
        return min(CPU_CONV_BAND, limit // 16) if limit else CPU_CONV_BAND
    cuda = getattr(mx, "cuda", None)
    if cuda is not None and cuda.is_available():
        return None
    return limit // 16 if limit else None


GPU_CACHE_BYTES = 1 << 30   # MLX's buffer cache in a GPU phase: enough for a piece of work's buffers to be reused


def cache_limit_for(policy: RunPolicy):
    """How much MLX's buffer cache may keep in a phase: on a GPU, GPU_CACHE_BYTES (MLX's own limit there is 95% of
    the device, so freed buffers, e.g. a GGUF load's converted chunks, stayed held: bench/RESULTS.md, "The footprint
    the user sees"); on the CPU MLX's own (mlx-cpu keeps only small buffers)."""
    return None if mx.default_device() == mx.cpu else GPU_CACHE_BYTES


def decide(policy: RunPolicy, model) -> RunPolicy:
    """The policy of a phase whose weights (`model`) are loaded: pieces in flight, block compilation, convolution
    bands and the buffer cache from the budget; what a switch fixed (policy.fixed) stays."""
    depth = in_flight_for(policy)
    return policy.refined(in_flight=depth, compile_blocks=compile_blocks_for(model, depth),
                          conv_band=conv_band_bytes(policy), cache_limit=cache_limit_for(policy))


def outside_mlx_bytes() -> int:
    """On a GPU, what this process holds beyond MLX's buffers (the CUDA context, the libraries' workspaces; on Metal
    the interpreter's heap too): its device memory (process_memory) less MLX's active and cached bytes, now. 0 on the
    CPU, where a memory limit bounds MLX's bytes, and where the process's memory cannot be read."""
    if mx.default_device() == mx.cpu:
        return 0
    held = process_memory()
    held = held["gpu"] if held["gpu"] is not None else held["footprint"] if sys.platform == "darwin" else None
    return max(0, held - mx.get_active_memory() - mx.get_cache_memory()) if held else 0


def device_cache_bytes() -> int:
    """The buffer cache a GPU phase keeps (cache_limit_for: GPU_CACHE_BYTES), which a memory limit must leave room
    for; 0 on the CPU (mlx-cpu keeps only small buffers)."""
    return 0 if mx.default_device() == mx.cpu else GPU_CACHE_BYTES


# kept free of weights in a phase, for the activations, MLX's cache and the CUDA context: half the budget, at most
# RESERVE_BYTES (FLUX.2-dev at 1024x1024 on the H200: 1.84 GiB of activations, a cache capped at 1 GiB and a 0.51 GiB
# context: bench/RESULTS.md, "The footprint the user sees"); a streamed component's (loading/streaming.py) and, on a
# GPU, a whole one's (whole_load_reserve)
RESERVE_SHARE, RESERVE_BYTES = 0.5, 3 << 30


def whole_load_reserve(budget) -> int:
    """On a GPU, the room a component loaded whole must leave in the budget for its phase's activations and the
    buffer cache: what a streamed one keeps (RESERVE_SHARE of the budget, at most RESERVE_BYTES): without it a GGUF
    that just fits the limit ran over it (bench/RESULTS.md, "FLUX.1-dev streamed and as GGUF"). 0 on the CPU, where
    the limit bounds the weights and activations MLX holds."""
    return 0 if mx.default_device() == mx.cpu else int(min(RESERVE_SHARE * budget, RESERVE_BYTES))


def check_fits(spec, policy: RunPolicy):
    """Before a component loads: the spec to load. A GGUF component whose default layout does not fit the budget
    (the memory limit, else the free memory) but whose raw blocks do (formats/gguf.py: the file's own size, decoded a
    layer at a time) gets the raw layout, unless the spec (or MLXDIFF_GGUF_LAYOUT, through the policy) fixes one. One
    that does not fit at all gets `stream_budget`: its blocks are then streamed from the file
    (loading/streaming.py), which refuses, in one line saying what would fit, a budget too small even for that.
    On a GPU the limit is the whole process's: what it holds outside MLX is taken off the budget first, and a
    component loaded whole leaves whole_load_reserve for its phase."""
    budget = [b for b in (policy.memory_limit, available_bytes()) if b]
    if not budget:
        return spec
    budget = min(budget)
    if policy.memory_limit is not None and budget == policy.memory_limit:
        budget -= outside_mlx_bytes()
    need = spec.loaded_nbytes(compute_dtype=policy.compute_dtype)
    if need + whole_load_reserve(budget) <= budget:
        return spec
    if any(_kept_quantized(f) for f in spec.files) and spec.gguf_layout is None:
        raw = replace(spec, gguf_layout="raw")
        if raw.loaded_nbytes(compute_dtype=policy.compute_dtype) + whole_load_reserve(budget) <= budget:
            return raw
    return replace(spec, stream_budget=int(budget))


def _kept_quantized(path) -> bool:
    """Its format's quantized tensors load as stored, in a layout a spec may choose (a GGUF: formats/table.py)."""
    return format_of(path, header=False).kept_quantized


def fit_hint(spec, budget) -> str:
    """What would make `spec` fit `budget` bytes, for a refusal's line."""
    smaller = next((hint for f in spec.files if (hint := format_of(f, header=False).smaller)), None)
    if smaller:   # its weights load as stored (a GGUF): quantize= does not shrink them
        return f"{smaller} or a machine with more memory"
    for bits in (8, 4):
        estimate = spec.loaded_nbytes(quantize=bits)
        if estimate <= budget:
            return f"quantize it: --quantize {spec.name}={bits} (about {fmt_gb(estimate)})"
    return "no quantization makes it fit; use a machine with more memory"


@functools.cache
def gpu_baseline() -> GpuBaseline | None:
    """The device's idle reading for this process's own measurements, taken when it first measured (nothing is
    allocated yet when the first phase starts): in use less this process's CUDA context, and the processes already
    there. None without NVML."""
    return gpu_snapshot(without=os.getpid())
