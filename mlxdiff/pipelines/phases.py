"""What every pipeline shares: phases that load a model, use it and free it; the Result; progress.

A run is encode -> free -> denoise -> free -> decode. Each model lives only inside `loaded(...)`, so the peak is
the largest phase, not the sum. On leaving, the module is emptied in place (a reference the caller still holds
becomes an empty shell) and MLX's buffer cache is returned, so the next phase starts from near zero.
"""

import gc
import os
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np

from .. import backend
import mlx.core as mx

from ..loading.matmul import use_strategy
from ..loading.quantize import materialize
from ..memory import check_fits, snapshot, fmt_gb, reset_footprint_peak


@dataclass
class Result:
    image: object                 # PIL.Image.Image (the first image of the batch)
    latents: np.ndarray           # final latents, diffusers layout (before the VAE's scaling is undone)
    timings: dict = field(default_factory=dict)   # phase -> seconds
    memory: dict = field(default_factory=dict)    # phase -> {"peak": bytes, "after": bytes, ...}
    images: list = field(default_factory=list)    # every image of the batch
    load_seconds: dict = field(default_factory=dict)  # component -> seconds to map and read its weights

    def summary(self) -> str:
        """Time and peak memory per phase (what the CLI prints)."""
        rows = [f"{'phase':<9} {'seconds':>8} {'MLX peak':>10} {'process peak':>13}"]
        for name, seconds in self.timings.items():
            m = self.memory.get(name, {})
            rows.append(f"{name:<9} {seconds:8.2f} {fmt_gb(m.get('peak')):>10} {fmt_gb(m.get('footprint_peak')):>13}")
        return "\n".join(rows)

    def memory_report(self) -> str:
        """The per-phase memory table (--report-memory): peaks during, and what remains after each phase."""
        rows = [f"{'phase':<9} {'load s':>7} {'MLX peak':>10} {'MLX after':>10} {'process peak':>13} "
                f"{'process after':>14}"]
        loads = {"denoise": self.load_seconds.get("transformer"), "decode": self.load_seconds.get("vae")}
        for name in self.timings:
            m = self.memory.get(name, {})
            load = loads.get(name)
            rows.append(f"{name:<9} {'-' if load is None else f'{load:.2f}':>7} {fmt_gb(m.get('peak')):>10} "
                        f"{fmt_gb(m.get('after')):>10} {fmt_gb(m.get('footprint_peak')):>13} "
                        f"{fmt_gb(m.get('footprint')):>14}")
        return "\n".join(rows)


class PhaseLog:
    """Records seconds and memory per phase into a Result."""

    def __init__(self, result: Result):
        self.result = result

    @contextmanager
    def __call__(self, name):
        mark_phase(name, "start")
        mx.reset_peak_memory()
        reset_footprint_peak()
        start = time.perf_counter()
        try:
            yield
        finally:
            mx.synchronize()
            peak = mx.get_peak_memory()
            footprint_peak = snapshot().footprint_peak
            release()
            snap = snapshot()
            self.result.timings[name] = time.perf_counter() - start
            self.result.memory[name] = {"peak": peak, "after": snap.active, "footprint": snap.footprint,
                                        "footprint_peak": footprint_peak}
            mark_phase(name, "end")


def mark_phase(name, event):
    """For `python -m mlxdiff.footprint`, which samples this process from outside: a marker line on stderr."""
    if os.environ.get("MLXDIFF_PHASE_MARKERS"):
        print(f"MLXDIFF_PHASE {name} {event} {time.time():.3f}", file=sys.stderr, flush=True)


def release():
    gc.collect()
    mx.clear_cache()


@contextmanager
def loaded(spec, compute_dtype, result: Result | None = None):
    """Build the model a ComponentSpec describes, evaluate its weights, and empty it on leaving."""
    check_fits(spec)  # refuse before loading anything that cannot fit
    start = time.perf_counter()
    model = spec.build(compute_dtype)
    use_strategy(model, getattr(spec, "matmul", None) or backend.default_matmul_strategy())
    materialize(model)  # one module at a time: bounded peak, also when quantizing while loading
    if result is not None:
        result.load_seconds[getattr(spec, "name", "text_encoder")] = time.perf_counter() - start
    try:
        yield model
    finally:
        model.clear()  # nn.Module is a dict: drop every parameter and child, even if the caller keeps `model`
        del model
        release()


def progress(iterable, total, desc, enabled=True):
    if not enabled:
        return iterable
    from tqdm.auto import tqdm
    return tqdm(iterable, total=total, desc=desc, leave=False)


def initial_latents(latents, shape, seed, layout=""):
    """Injected noise (numpy, in diffusers' `latents` layout) or seeded MLX noise; always float32."""
    from ..errors import MlxdiffError
    if latents is None:
        return mx.random.normal(shape, key=mx.random.key(seed)).astype(mx.float32)
    latents = np.asarray(latents)
    if tuple(latents.shape) != tuple(shape):
        raise MlxdiffError(f"latents have shape {tuple(latents.shape)}, expected {tuple(shape)} for this size"
                           + (f" ({layout})" if layout else ""))
    return mx.array(latents.astype(np.float32))
