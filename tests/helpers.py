"""Shared test helpers: the error measure used by every parity test, seeded randomisation of torch models, the round
trip of a tiny torch model through a save_pretrained folder into mlxdiff (saved_model_fixture, load_ours), and the
MLX peak of a block of work above what was live before it (mlx_peak_above_live), measured in a fresh process
(in_fresh_process); where the real tokenizer files are (ASSETS, FIXTURES)."""

import base64
import functools
import gc
import json
import os
import pickle
import subprocess
import sys
import threading
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

import mlxdiff  # noqa: F401  (OpenBLAS preload before mlx)
import mlx.core as mx

from mlxdiff.policy import RunPolicy, installed

# the real CLIP and T5 tokenizer files the tiny twins tokenize with: mlxdiff's bundled copies, and the same files in
# the shared fixtures folder beside the checkout where a machine has it
ASSETS = Path(mlxdiff.__file__).parent / "assets" / "tokenizers"
FIXTURES = Path(__file__).resolve().parents[2] / "shared" / "fixtures" / "tokenizers"


class Peak:
    bytes = None


def computing_in(dtype):
    """A model built or run on its own in `dtype` (None: float32): a policy with just that compute dtype installed,
    as a pipeline installs its own (mlxdiff/policy.py)."""
    return installed(RunPolicy(compute_dtype=dtype or mx.float32))


STALL_SECONDS = 240     # mlx_peak_above_live's blocks take at most ~45 s on the 2-core CI machine
_CHILD = "MLXDIFF_TEST_FRESH_PROCESS"


def in_fresh_process(test):
    """Runs the test in a new Python process (its arguments pickled), failing with the child's last lines.

    For the tests that measure with mlx_peak_above_live: after other tests in the same pytest-xdist worker, MLX's
    eval over the 1-byte limit waited forever in two CI runs (a task of an earlier test still counted in flight);
    a fresh process holds no earlier test's tasks, threads or cached buffers, so the peak is the block's alone."""
    @functools.wraps(test)
    def run(*args, **kwargs):
        if os.environ.get(_CHILD):
            return test(*args, **kwargs)
        payload = base64.b64encode(pickle.dumps((args, kwargs))).decode()
        # mlxdiff first, as conftest does: it preloads OpenBLAS before mlx loads (without it mlx-cpu's matmuls
        # are ~50x slower and a block can outlast the watchdog)
        code = (f"import sys, pickle, base64; sys.path.insert(0, {str(Path(__file__).parent)!r}); import mlxdiff; "
                f"import {test.__module__} as m; a, k = pickle.loads(base64.b64decode({payload!r})); "
                f"m.{test.__name__}(*a, **k)")
        proc = subprocess.run([sys.executable, "-c", code], env={**os.environ, _CHILD: "1"}, capture_output=True,
                              text=True, timeout=STALL_SECONDS + 300)
        sys.stdout.write(proc.stdout)
        if proc.returncode:
            tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-25:])
            pytest.fail(f"{test.__name__} failed in its fresh process (exit {proc.returncode}):\n{tail}",
                        pytrace=False)
    return run


@contextmanager
def mlx_peak_above_live():
    """MLX's peak memory during the block above what is live when it starts, in bytes (`.bytes` after the block).
    Garbage from earlier tests is collected first and the collector held off inside: a cycle freed mid-block would
    lower the active memory below the base and the peak with it (the likely cause of a CI run whose one-tile
    decode read 1.3 MB under every local run, failing test_vae_tiling's bound).

    The block also runs under a 1-byte MLX memory limit: over its limit, MLX's eval waits for the running tasks
    after every op instead of letting the graph builder run up to ten ops ahead of the CPU worker with their
    outputs allocated. That run-ahead depends on thread timing: test_vae_tiling's one-tile decode read 16.42 MB in
    CI's failing run and 17.7-18.2 MB in runs here without the limit, 6.31 MiB in every run under it (`python -m
    pytest -n 0 -s tests/test_vae_tiling.py -k bounded_by_the_tile` prints it). The peak measured is the graph's.
    Policies installed inside the block that set no limit of their own keep it. Only in a test marked
    in_fresh_process."""
    assert os.environ.get(_CHILD), "mlx_peak_above_live measures only in a test decorated with @in_fresh_process"
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    limit = mx.set_memory_limit(1)
    # A watchdog: over its limit MLX's eval waits while any task is in flight, and one run of the suite stalled
    # there for 15 minutes at full CPU after other tests in the same worker (gdb: eval_impl's wait loop). MLX
    # releases the GIL in eval, so this thread can lift the limit, which ends the wait; the block then fails in
    # one line instead of hanging the suite.
    stalled = threading.Event()
    watchdog = threading.Timer(STALL_SECONDS, lambda: (stalled.set(), mx.set_memory_limit(limit)))
    watchdog.daemon = True
    watchdog.start()
    try:
        mx.synchronize()
        mx.clear_cache()
        base = mx.get_active_memory()
        mx.reset_peak_memory()
        peak = Peak()
        yield peak
        mx.synchronize()
        peak.bytes = mx.get_peak_memory() - base
    finally:
        watchdog.cancel()
        mx.set_memory_limit(limit)
        if was_enabled:
            gc.enable()
    if stalled.is_set():
        pytest.fail(f"MLX's eval stalled over the 1-byte memory limit for {STALL_SECONDS} s (a task of an earlier "
                    "test still counted in flight?); the peak was not measured op by op")


def max_rel_err(ours, ref) -> float:
    """max |ours - ref| / max |ref|: the maximum error relative to the reference's magnitude.

    Element-wise relative error is meaningless where the reference crosses zero, so the scale is the reference's
    largest magnitude. Shapes must match exactly (no broadcasting).
    """
    ours = np.asarray(ours, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    assert ours.shape == ref.shape, f"shape {ours.shape} != reference {ref.shape}"
    assert np.isfinite(ours).all(), "non-finite values in our output"
    return float(np.abs(ours - ref).max() / max(np.abs(ref).max(), 1e-30))


def randomize_(module, seed=0, scale=0.2):
    """Fill every parameter (not buffers) of a torch module with seeded noise, so that zero-initialised
    gates and identity norms cannot hide a wrong mapping."""
    import torch
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * scale + (1.0 if name.endswith("norm.weight") else 0.0))
    return module


def saved_model_fixture(make_model, names, prefix):
    """A module-scoped fixture parametrized over `names`, giving (name, torch model, its save_pretrained folder): the
    model is make_model(name, seed=len(name)), saved in a fresh tmp folder "{prefix}_{name}". Assign it to the
    fixture's name in the test module: `saved = saved_model_fixture(make_torch_model, CONFIGS, "flux2")`."""
    @pytest.fixture(scope="module", params=list(names))
    def saved(request, tmp_path_factory):
        name = request.param
        model = make_model(name, seed=len(name))
        folder = tmp_path_factory.mktemp(f"{prefix}_{name}")
        model.save_pretrained(str(folder))
        return name, model, folder
    return saved


def load_ours(folder, arch, dtype=mx.float32):
    """mlxdiff's `arch` model (an mlxdiff.models module) from a save_pretrained folder: its config.json and
    safetensors, through our loader. dtype is the compute dtype handed to build; None leaves it to build's default."""
    from mlxdiff.formats.safetensors import load_folder
    from mlxdiff.loading.build import build
    config = json.loads((Path(folder) / "config.json").read_text())
    with computing_in(dtype):
        return build(arch, config, load_folder(folder), str(folder))
