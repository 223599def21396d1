"""How much lazily built work is queued at once, so that transient buffers are freed as a forward goes.

A buffer is released only when the queued work that reads it has completed. Evaluated as one lazy graph, a whole
transformer block (FLUX.2-dev single block, H200: 1.35 GB above its inputs for a 54 MB output), or every layer's
decoded weight in it, stayed alive until the block was done. `pace(y)` first waits until fewer than IN_FLIGHT
earlier paced results are still queued, then schedules y (`mx.async_eval`), so at most IN_FLIGHT pieces of work
hold their buffers at a time. IN_FLIGHT = 1 (the default) is the memory floor; 2 keeps the next piece queued while
the device runs the current one: FLUX.2-dev Q4_K_M at 1024x1024 on the H200 peaks 21.46 GiB at 0.63 s per step with
1, 21.84 GiB at 0.57 s with 2 (MLXDIFF_IN_FLIGHT=2). Figures: bench/RESULTS.md, "Memory floor".

This module imports only mlxdiff.errors, so every floor (formats, models, pipelines) can use it.
"""

import os
from collections import deque

import mlx.core as mx

from .errors import MlxdiffError



def _in_flight_setting() -> int:
    value = os.environ.get("MLXDIFF_IN_FLIGHT", "1")
    if not value.isdigit() or not 1 <= int(value) <= 64:
        raise MlxdiffError(f"MLXDIFF_IN_FLIGHT={value!r}: expected a whole number from 1 to 64 (default 1)")
    return int(value)


IN_FLIGHT = _in_flight_setting()
_queued = deque()


def pace(*arrays):
    """Schedule `arrays` once fewer than IN_FLIGHT earlier paced results are queued; returns its argument(s)."""
    while len(_queued) >= IN_FLIGHT:
        mx.eval(_queued.popleft())
    mx.async_eval(*arrays)
    _queued.append(list(arrays))
    return arrays[0] if len(arrays) == 1 else arrays


def settle():
    """Wait for everything paced and let go of it (end of a forward or a step)."""
    while _queued:
        mx.eval(_queued.popleft())
