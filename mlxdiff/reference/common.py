"""What every reference run shares: the device and dtype policy, memory freeing, and the markers that
mlxdiff.footprint reads from stderr:

    MLXDIFF_PHASE <phase> start|end <unix time>
    MLXDIFF_RSS <phase> <peak RSS bytes>                                           (Linux, before the end)
    MLXDIFF_GPU <phase> <max_memory_allocated bytes> <max_memory_reserved bytes>   (CUDA only, before the end)

An outside sampler misses the peak of a phase shorter than its interval, so on Linux each phase also reports its
own peak RSS (VmHWM, reset when the phase starts, as mlxdiff's phases do). Process RSS misses what lives on a CUDA
device, so on CUDA each phase also reports the peaks of torch's caching allocator over that phase (the peak
statistics are reset when the phase starts).
"""

import gc
import sys
import time
from contextlib import contextmanager

import numpy as np

from mlxdiff import switches


def mark(phase, event):
    print(f"MLXDIFF_PHASE {phase} {event} {time.time():.3f}", file=sys.stderr, flush=True)


def device() -> str:
    import torch  # optional: the reference extra
    if switches.read().get("MLXDIFF_DEVICE") == "cpu":    # as mlxdiff/backend.py: the CPU on a machine with a GPU
        return "cpu"
    if torch.cuda.is_available():
        return "cuda"
    if torch.backends.mps.is_available():
        return "mps"
    return "cpu"


def free(device):
    import torch  # optional: the reference extra
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    elif device == "mps":
        torch.mps.empty_cache()


def loaded_two_ways(pipeline_class, model, mode, device, dtype, encode, encoders, denoiser=None, ):
    """The pipeline to denoise with and `encode(pipe)`'s result, the two ways the references run (their docstrings):
    as_is loads everything and encodes; sequential encodes with a pipeline of the encoders alone (transformer and
    VAE left out), frees it, then loads one without `encoders` (component names) to denoise and decode.
    `denoiser()`: from_pretrained keywords replacing the denoiser (a transformer file)."""
    kwargs = denoiser() if denoiser else {}
    if mode == "as_is":
        with phase("load", device):
            pipe = pipeline_class.from_pretrained(model, torch_dtype=dtype, **kwargs).to(device)
        with phase("encode", device):
            return pipe, encode(pipe)
    if mode == "sequential":
        with phase("encode", device):
            enc = pipeline_class.from_pretrained(model, transformer=None, vae=None, torch_dtype=dtype).to(device)
            cond = encode(enc)
            enc.remove_all_hooks()
            del enc
            free(device)
        with phase("load", device):
            pipe = pipeline_class.from_pretrained(model, torch_dtype=dtype, **{name: None for name in encoders},
                                                  **kwargs).to(device)
        return pipe, cond
    raise SystemExit(f"{pipeline_class.__name__} reference: unknown mode {mode!r}; expected as_is or sequential")


def synchronize(device):
    import torch  # optional: the reference extra
    if device == "cuda":
        torch.cuda.synchronize()
    elif device == "mps":
        torch.mps.synchronize()


def _reset_rss_peak() -> bool:
    """Linux: VmHWM back to the current RSS (5 to clear_refs); False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _rss_peak():
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


@contextmanager
def phase(name, device):
    """Markers around a phase; on Linux, the phase's peak RSS; on CUDA, the allocator's peaks over the phase."""
    import torch  # optional: the reference extra
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    rss = sys.platform.startswith("linux") and _reset_rss_peak()
    mark(name, "start")
    try:
        yield
    finally:
        synchronize(device)
        peak = _rss_peak() if rss else None
        if peak is not None:
            print(f"MLXDIFF_RSS {name} {peak}", file=sys.stderr, flush=True)
        if device == "cuda":
            print(f"MLXDIFF_GPU {name} {torch.cuda.max_memory_allocated()} {torch.cuda.max_memory_reserved()}",
                  file=sys.stderr, flush=True)
        mark(name, "end")


def noise(shape, seed, dtype):
    """Seeded float noise in diffusers' `latents` layout (numpy, so that it is the same on every device)."""
    import torch  # optional: the reference extra
    return torch.from_numpy(np.random.default_rng(seed).standard_normal(shape).astype(np.float32)).to(dtype)
