"""What a run reports: the Result (images, latents, seconds, memory per phase, what was reused, the budget's notes)
and the PhaseLog that fills it in as each phase runs."""

import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np

from .. import backend  # noqa: F401  (OpenBLAS preload before mlx)
import mlx.core as mx

from ..memory import fmt_gb, reset_footprint_peak, snapshot

# the size columns of Result.memory_report, in order
MEMORY_COLUMNS = ("weights", "MLX peak", "overhead", "MLX after", "process peak", "process after")


@dataclass
class Result:
    image: object                 # PIL.Image.Image (the first image of the batch)
    latents: np.ndarray           # final latents, diffusers layout (before the VAE's scaling is undone)
    timings: dict = field(default_factory=dict)   # phase -> seconds
    memory: dict = field(default_factory=dict)    # phase -> {"peak": bytes, "after": bytes, ...}
    images: list = field(default_factory=list)    # every image of the batch
    load_seconds: dict = field(default_factory=dict)  # component -> seconds to map and read its weights
    reused: list = field(default_factory=list)    # what came from an earlier call: components kept loaded
                                                  # (keep=), "conditioning" (the prompt cache)
    notes: list = field(default_factory=list)     # choices the memory budget made (e.g. a GGUF layout)
    phase: str | None = field(default=None, repr=False)       # the phase running now (PhaseLog)
    floors: dict = field(default_factory=dict, repr=False)    # phase -> the largest weights it loaded

    def summary(self) -> str:
        """Time and peak memory per phase (what the CLI prints)."""
        rows = [f"{'phase':<9} {'seconds':>8} {'MLX peak':>10} {'process peak':>13}"]
        for name, seconds in self.timings.items():
            m = self.memory.get(name, {})
            rows.append(f"{name:<9} {seconds:8.2f} {fmt_gb(m.get('peak')):>10} {fmt_gb(m.get('footprint_peak')):>13}")
        return "\n".join(rows + [f"note: {n}" for n in self.notes])

    def memory_report(self) -> str:
        """The per-phase memory table (--report-memory): the phase's weights (its floor: the largest model it
        held), its MLX peak, the overhead above the floor, and what remains after it. Its size columns are
        MEMORY_COLUMNS, in that order (mlxdiff.footprint reads them by name)."""
        widths = [max(10, len(c) + 1) for c in MEMORY_COLUMNS]
        rows = [f"{'phase':<9} {'load s':>7} " + " ".join(f"{c:>{w}}" for c, w in zip(MEMORY_COLUMNS, widths))]
        loads = {"denoise": self.load_seconds.get("transformer"), "decode": self.load_seconds.get("vae")}
        for name in self.timings:
            m = self.memory.get(name, {})
            load = loads.get(name)
            floor, peak = m.get("floor"), m.get("peak")
            overhead = None if floor is None or peak is None else max(peak - floor, 0)
            sizes = (floor, peak, overhead, m.get("after"), m.get("footprint_peak"), m.get("footprint"))
            rows.append(f"{name:<9} {'-' if load is None else f'{load:.2f}':>7} "
                        + " ".join(f"{fmt_gb(v):>{w}}" for v, w in zip(sizes, widths)))
        return "\n".join(rows + [f"note: {n}" for n in self.notes])

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
        reset_footprint_peak()
        start = time.perf_counter()
        try:
            yield
        finally:
            mx.synchronize()
            peak = mx.get_peak_memory()
            footprint_peak = snapshot().footprint_peak
            mx.clear_cache()   # a freed model was collected where it was freed (Residency.use); gc.collect here
                               # cost ~66 ms per phase on this CPU and found nothing
            snap = snapshot()
            self.result.phase = None
            self.result.timings[name] = time.perf_counter() - start
            self.result.memory[name] = {"peak": peak, "after": snap.active, "footprint": snap.footprint,
                                        "footprint_peak": footprint_peak, "floor": self.result.floors.get(name, 0)}
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
