"""The run policy (mlxdiff/policy.py): built once per pipeline from memory_limit= and the MLXDIFF_* switches, installed
for a phase in a scoped way; models called outside any policy are plain MLX; no ambient state elsewhere."""

import ast
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import mlxdiff
import mlx.core as mx
from mlxdiff import default_model, memory, policy
from mlxdiff.loading.component import load_component
from mlxdiff.pacing import pace
from mlxdiff.policy import RunPolicy, installed

PACKAGE = Path(mlxdiff.__file__).parent
KW = dict(steps=2, seed=3, progress_bar=False)


def _inputs(args, tokens=16, text=7, seed=0):
    rng = np.random.default_rng(seed)
    img = mx.array(rng.standard_normal((1, tokens, args.in_channels)).astype(np.float32))
    txt = mx.array(rng.standard_normal((1, text, args.joint_attention_dim)).astype(np.float32))
    side = int(tokens ** 0.5)
    hh, ww = np.meshgrid(np.arange(side), np.arange(side), indexing="ij")
    img_ids = mx.array(np.stack([np.zeros(tokens), hh.ravel(), ww.ravel(), np.zeros(tokens)], -1)[None].astype(np.int32))
    txt_ids = mx.array(np.stack([np.zeros(text)] * 3 + [np.arange(text)], -1)[None].astype(np.int32))
    return img, txt, img_ids, txt_ids


def test_a_model_outside_any_policy_is_plain_mlx_and_gives_the_same_numbers(monkeypatch):
    """The embedded default's FLUX.2 transformer, loaded as a phase loads it, called on its own (no policy: nothing
    paced, no async_eval, one SwiGLU matmul) and inside the policy its phase installs (paced, SwiGLU in two
    ranges): the same forward."""
    pipe = mlxdiff.load(str(default_model.folder()))
    spec = pipe.components["transformer"]
    model = load_component(spec, RunPolicy()).model
    args = spec.args
    inputs = _inputs(args)
    scheduled = []
    real = mx.async_eval
    monkeypatch.setattr(mx, "async_eval", lambda *a: (scheduled.append(len(a)), real(*a))[1])

    plain = np.array(model(*inputs[:2], mx.array([0.4]), *inputs[2:], after_block=None))
    assert scheduled == []                       # no policy installed: no async_eval anywhere
    phase = memory.decide(RunPolicy(), model)
    assert phase.split_swiglu                    # the CPU's floor: one piece in flight
    with installed(phase):
        paced = np.array(model(*inputs[:2], mx.array([0.4]), *inputs[2:],
                               after_block=lambda *outs: pace(*outs)))
    assert len(scheduled) > 0
    assert policy.current() is None              # restored on leaving
    err = np.abs(plain - paced).max() / np.abs(plain).max()
    assert err <= 1e-6, err


def _mlx_limit():
    """MLX's memory limit in force (set_memory_limit returns the previous one)."""
    previous = mx.set_memory_limit(1 << 40)
    mx.set_memory_limit(previous)
    return previous


def test_two_pipelines_with_different_limits_do_not_affect_each_other():
    default = _mlx_limit()
    limited = mlxdiff.load(str(default_model.folder()), memory_limit=8)
    free = mlxdiff.load(str(default_model.folder()))
    assert limited.policy.memory_limit == 8 * 2 ** 30 and free.policy.memory_limit is None
    seen = {}

    def probe(name):
        return lambda i, t, x: seen.setdefault(name, (policy.current().memory_limit, _mlx_limit()))

    a = limited.generate(default_model.PROMPT, callback=probe("limited"), **KW)
    b = free.generate(default_model.PROMPT, callback=probe("free"), **KW)
    c = limited.generate(default_model.PROMPT, callback=probe("limited again"), **KW)
    assert seen["limited"] == (8 * 2 ** 30, 8 * 2 ** 30) == seen["limited again"]
    assert seen["free"] == (None, default)       # the other pipeline's limit is not in force in this one's run
    assert _mlx_limit() == default and policy.current() is None     # nothing outlives a run
    assert np.array_equal(a.latents, b.latents) and np.array_equal(a.latents, c.latents)


def test_switches_are_read_when_a_pipeline_is_made_not_at_import(monkeypatch):
    monkeypatch.setenv("MLXDIFF_IN_FLIGHT", "3")
    pipe = mlxdiff.load(str(default_model.folder()))
    assert pipe.policy.in_flight == 3 and "in_flight" in pipe.policy.fixed
    assert pipe.policy.refined(in_flight=1, compile_blocks=True).in_flight == 3     # a switch wins over a decision
    monkeypatch.setenv("MLXDIFF_IN_FLIGHT", "0")
    with pytest.raises(mlxdiff.MlxdiffError, match=r"^MLXDIFF_IN_FLIGHT='0': expected a whole number from 1 to 64"):
        mlxdiff.load(str(default_model.folder()))
    # a bad value does not break the import
    p = subprocess.run([sys.executable, "-c", "import mlxdiff, mlxdiff.generate; print('ok')"], capture_output=True,
                       text=True, timeout=300, env={"MLXDIFF_IN_FLIGHT": "x", "PATH": "/usr/bin:/bin"})
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr


def test_the_compute_dtype_is_chosen_once_in_the_policy():
    """load(dtype=) sets the policy's compute dtype (and float16-mixed's stream dtype) once; a phase's build reads it
    from the installed policy; a model built on its own computes in float32."""
    pipe = mlxdiff.load(str(default_model.folder()), dtype="float16-mixed")
    assert (pipe.policy.compute_dtype, pipe.policy.stream_dtype) == (mx.float16, mx.float32)
    assert (pipe.dtype, pipe.stream_dtype, pipe.dtype_name) == (mx.float16, mx.float32, "float16-mixed")
    spec = pipe.components["vae"]
    assert spec.build().compute_dtype == mx.float32 and policy.current_dtype() == mx.float32
    with pipe.use(spec) as vae:
        assert vae.compute_dtype == mx.float16 and policy.current_dtype() == mx.float16
    assert policy.current() is None
    with pytest.raises(mlxdiff.MlxdiffError, match=r"^unknown dtype 'float8'"):
        mlxdiff.load(str(default_model.folder()), dtype="float8")


def _modules():
    return sorted(PACKAGE.rglob("*.py"))


def test_no_ambient_state_outside_the_policy_stack_and_the_pacing_queue():
    """No `global` statement, and no module-level name bound to a mutable container, but the policy stack and the
    running phase's pacing queue (UPPER_CASE names are constant tables)."""
    allowed = {("policy.py", "_stack"), ("pacing.py", "_queued")}
    found = []
    for path in _modules():
        tree = ast.parse(path.read_text())
        found += [f"{path.name}: global {', '.join(n.names)}" for n in ast.walk(tree) if isinstance(n, ast.Global)]
        for node in tree.body:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] \
                if isinstance(node, ast.AnnAssign) and node.value is not None else []
            for target in targets:
                if not isinstance(target, ast.Name) or target.id.isupper() or target.id.startswith("__") \
                        or (path.name, target.id) in allowed:
                    continue
                value = node.value
                mutable = isinstance(value, (ast.List, ast.Dict, ast.Set, ast.ListComp, ast.DictComp)) or (
                    isinstance(value, ast.Call) and getattr(value.func, "id", getattr(value.func, "attr", ""))
                    in ("list", "dict", "set", "deque", "defaultdict", "OrderedDict"))
                if mutable:
                    found.append(f"{path.relative_to(PACKAGE)}: {target.id}")
    assert found == []
    assert {path.name for path in (PACKAGE / "policy.py", PACKAGE / "pacing.py")} == {n for n, _ in allowed}


def test_one_place_reads_the_switches():
    """os.environ is read in switches.py only (footprint.py passes the environment on to the processes it
    samples); every MLXDIFF_* name the package uses is in its table."""
    from mlxdiff import switches
    readers, names = [], set()
    for path in _modules():
        text = path.read_text()
        if "os.environ" in text or "getenv" in text:
            readers.append(path.name)
        names |= {n for n in re.findall(r"MLXDIFF_[A-Z_]+", text) if not n.endswith("_")}
    assert sorted(readers) == ["footprint.py", "switches.py"]
    footprint = (PACKAGE / "footprint.py").read_text()
    assert all(line.strip().startswith("env={**os.environ") for line in footprint.splitlines() if "os.environ" in line)
    # the stderr markers footprint reads are not switches
    assert names - {"MLXDIFF_PHASE", "MLXDIFF_RSS", "MLXDIFF_GPU", "MLXDIFF_CHILD"} == set(switches.SWITCHES)
