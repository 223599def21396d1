"""How much lazily built work is queued at once, so that transient buffers are freed as a forward goes.

A buffer is released only when the queued work that reads it has completed. Evaluated as one lazy graph, a whole
transformer block (FLUX.2-dev single block, H200: 1.35 GB above its inputs for a 54 MB output), or every layer's
decoded weight in it, stayed alive until the block was done. `pace(y)` first waits until fewer than IN_FLIGHT
earlier paced results are still queued, then schedules y (`mx.async_eval`), so at most IN_FLIGHT pieces of work
hold their buffers at a time. 1 is the memory floor; 2 keeps the next piece queued while the device runs the
current one, faster at some memory (H200, 1024x1024: FLUX.2-dev Q4_K_M 21.46 GiB at 0.63 s per step with 1, 21.84
GiB at 0.57 s with 2; a bf16 klein-4B forward 0.102 s / +0.94 GiB with 1, 0.074 s / +0.70-1.36 GiB with 2, torch
0.086 s / +0.60 GiB). The depth is the budget's choice (memory.in_flight_for, set per phase by the pipelines: 2 on a
GPU with room to spare, else 1); MLXDIFF_IN_FLIGHT=N fixes it. Figures: bench/RESULTS.md, "Memory floor".

This module imports only mlxdiff.errors, so every floor (formats, models, pipelines) can use it.
"""

import os
from collections import deque

import mlx.core as mx

from .errors import MlxdiffError


def _setting(name, default) -> int:
    value = os.environ.get(name, str(default))
    if not value.isdigit() or not 1 <= int(value) <= 64:
        raise MlxdiffError(f"{name}={value!r}: expected a whole number from 1 to 64 (default {default})")
    return int(value)


FIXED = "MLXDIFF_IN_FLIGHT" in os.environ     # a measurement's setting wins over the budget's choice
IN_FLIGHT = _setting("MLXDIFF_IN_FLIGHT", 1)
_queued = deque()


def set_in_flight(depth: int) -> int:
    """The depth for the work that follows (unless MLXDIFF_IN_FLIGHT fixes it); returns the depth in force."""
    global IN_FLIGHT
    if not FIXED:
        settle()
        IN_FLIGHT = max(1, int(depth))
    return IN_FLIGHT


_suspended = [0]    # > 0 while a compiled function is traced (models/fused.compiled_block): nothing is scheduled


def pace(*arrays):
    """Schedule `arrays` once fewer than IN_FLIGHT earlier paced results are queued; returns its argument(s)."""
    if _suspended[0]:
        return arrays[0] if len(arrays) == 1 else arrays
    while len(_queued) >= IN_FLIGHT:
        mx.eval(_queued.popleft())
    mx.async_eval(*arrays)
    _queued.append(list(arrays))
    return arrays[0] if len(arrays) == 1 else arrays


def settle():
    """Wait for everything paced and let go of it (end of a forward or a step)."""
    while _queued:
        mx.eval(_queued.popleft())
