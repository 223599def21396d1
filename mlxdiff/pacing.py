"""How much lazily built work is queued at once, so that transient buffers are freed as a forward goes.

A buffer is released only when the queued work that reads it has completed. Evaluated as one lazy graph, a whole
transformer block, or every layer's decoded weight in it, stays alive until the block is done (figures:
bench/RESULTS.md, "Memory floor"). `pace(y)` first waits until fewer than `in_flight` earlier paced results are still
queued, then schedules y (`mx.async_eval`), so at most that many pieces of work hold their buffers at a time. The
depth is the installed run policy's (mlxdiff/policy.py: 1, the floor, unless the phase's budget allows 2). With no
policy installed `pace` is the identity: a model called on its own is plain MLX and its caller evaluates.

This module imports only mlxdiff.policy, so every floor (formats, models, pipelines) can use it.
"""

from collections import deque

from . import backend  # noqa: F401  (OpenBLAS preload before mlx)
import mlx.core as mx

from .policy import current

_queued = deque()   # the running phase's scheduled work, oldest first


def pace(*arrays):
    """Schedule `arrays` once fewer than the policy's `in_flight` earlier paced results are queued; returns its
    argument(s). The identity with no policy installed, or while a compiled block is traced."""
    policy = current()
    if policy is not None and policy.paced:
        while len(_queued) >= policy.in_flight:
            mx.eval(_queued.popleft())
        mx.async_eval(*arrays)
        _queued.append(list(arrays))
    return arrays[0] if len(arrays) == 1 else arrays


def settle():
    """Wait for everything paced and let go of it (end of a forward, a step or a phase)."""
    while _queued:
        mx.eval(_queued.popleft())
