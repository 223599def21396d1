"""What a run reports: the Result (images, latents, seconds, memory per phase, what was reused, the budget's notes)
and the PhaseLog that fills it in as each phase runs."""

import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np

from .. import backend  # noqa: F401  (OpenBLAS preload before mlx)
import mlx.core as mx

from ..memory import PeakSampler, fmt_gb, gpu_baseline, process_memory, release_host_memory

# the size columns of Result.memory_report, in order: what the process held first, MLX's breakdown after it
MEMORY_COLUMNS = ("process peak", "weights", "MLX peak", "MLX cache", "overhead", "MLX after", "process after")


@dataclass
class Result:
    image: object                 # PIL.Image.Image (the first image of the batch)
    latents: np.ndarray           # final latents, diffusers layout (before the VAE's scaling is undone)
    timings: dict = field(default_factory=dict)   # phase -> seconds
    memory: dict = field(default_factory=dict)    # phase -> {"footprint_peak": what the process held at most
                                                  # (memory.process_memory, sampled through the phase), "kind":
                                                  # what that measured, "floor": weights, "peak": MLX active peak,
                                                  # "cache": MLX cache peak, "after", "footprint": after the phase}
    images: list = field(default_factory=list)    # every image of the batch
    load_seconds: dict = field(default_factory=dict)  # component -> seconds to map and read its weights
    reused: list = field(default_factory=list)    # what came from an earlier call: components kept loaded
                                                  # (keep=), "conditioning" (the prompt cache)
    notes: list = field(default_factory=list)     # choices the memory budget made (e.g. a GGUF layout)
    cached_steps: dict = field(default_factory=dict)  # generate(cache=...): {context: forwards that skipped the
                                                      # blocks after the first} (pipelines/step_cache.py)
    cache_changes: dict = field(default_factory=dict)  # and {context: the first block's relative change at each
                                                       # forward after the first}, what the threshold was held to
    phase: str | None = field(default=None, repr=False)       # the phase running now (PhaseLog)
    floors: dict = field(default_factory=dict, repr=False)    # phase -> the largest weights it loaded

    def summary(self) -> str:
        """Time and peak memory per phase (what the CLI prints): what the process held, then MLX's peak."""
        rows = [f"{'phase':<9} {'seconds':>8} {'process peak':>13} {'MLX peak':>10}"]
        for name, seconds in self.timings.items():
            m = self.memory.get(name, {})
            rows.append(f"{name:<9} {seconds:8.2f} {fmt_gb(m.get('footprint_peak')):>13} {fmt_gb(m.get('peak')):>10}")
        return "\n".join(rows + self.measured() + [f"note: {n}" for n in self.notes])

    def measured(self) -> list:
        """The line that says what "process" measured (memory.process_memory)."""
        kinds = sorted({m["kind"] for m in self.memory.values() if m.get("kind")})
        return [f"process memory: {', '.join(kinds)}, sampled through each phase"] if kinds else []

    def memory_report(self) -> str:
        """The per-phase memory table (--report-memory): what the process held at most (the headline), then the
        breakdown: the phase's weights (its floor: the largest model it held), MLX's active peak, MLX's buffer cache
        at most, the active overhead above the floor, and what remains after it. Its size columns are
        MEMORY_COLUMNS, in that order (mlxdiff.footprint reads them by name)."""
        widths = [max(10, len(c) + 1) for c in MEMORY_COLUMNS]
        rows = [f"{'phase':<9} {'load s':>7} " + " ".join(f"{c:>{w}}" for c, w in zip(MEMORY_COLUMNS, widths))]
        loads = {"denoise": self.load_seconds.get("transformer"), "decode": self.load_seconds.get("vae")}
        for name in self.timings:
            m = self.memory.get(name, {})
            load = loads.get(name)
            floor, peak = m.get("floor"), m.get("peak")
            overhead = None if floor is None or peak is None else max(peak - floor, 0)
            sizes = (m.get("footprint_peak"), floor, peak, m.get("cache"), overhead, m.get("after"), m.get("footprint"))
            rows.append(f"{name:<9} {'-' if load is None else f'{load:.2f}':>7} "
                        + " ".join(f"{fmt_gb(v):>{w}}" for v, w in zip(sizes, widths)))
        return "\n".join(rows + self.measured() + [f"note: {n}" for n in self.notes])

    def count_weights(self, nbytes: int):
        """A component loaded in the running phase: the phase's floor is the largest one it loaded."""
        if self.phase is not None:
            self.floors[self.phase] = max(self.floors.get(self.phase, 0), nbytes)


class PhaseLog:
    """Records seconds and memory per phase into a Result; `markers`: a marker line on stderr at each phase's start
    and end, for `python -m mlxdiff.footprint`, which samples this process from outside."""

    def __init__(self, result: Result, markers=False):
        self.result = result
        self.markers = markers

    def mark(self, name, event):
        if self.markers:
            print(f"MLXDIFF_PHASE {name} {event} {time.time():.3f}", file=sys.stderr, flush=True)

    @contextmanager
    def __call__(self, name):
        self.mark(name, "start")
        self.result.phase = name
        mx.reset_peak_memory()
        start = time.perf_counter()
        sampler = PeakSampler(gpu_baseline=gpu_baseline())
        try:
            with sampler:
                yield
                mx.synchronize()
        finally:
            peak = mx.get_peak_memory()
            # a freed model was collected where it was freed (Residency.use): no gc.collect here, which cost time
            # per phase and found nothing
            mx.clear_cache()
            release_host_memory()
            self.result.phase = None
            self.result.timings[name] = time.perf_counter() - start
            self.result.memory[name] = {"footprint_peak": sampler.peak, "kind": sampler.kind, "peak": peak,
                                        "cache": sampler.cache_peak, "after": mx.get_active_memory(),
                                        "footprint": process_memory()["footprint"],
                                        "floor": self.result.floors.get(name, 0)}
            self.mark(name, "end")


def new_run(markers=False):
    """(Result, PhaseLog) for one generate() call."""
    result = Result(image=None, latents=None)
    return result, PhaseLog(result, markers)


def finish(result: Result, images: list, latents) -> Result:
    result.latents = np.array(latents)
    result.images = images
    result.image = images[0]
    return result
