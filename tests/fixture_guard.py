"""Shared fixtures stay as they were built (issue 47): `unchanged(request, names)` is the body of an autouse fixture
that records, before each test, the state of the module's shared fixtures the test uses, and fails the test if it
left any of them changed. A test that needs another scheduler, adapter or setting builds its own object instead.

The state is cheap to take: for a diffusers pipeline each component's class, the scheduler's config, the
tokenizers' padding sides and each model's state; for a torch module its weights' digest, dtype, mode, diffusers
hooks and adapters; for an mlxdiff pipeline what a run reads of it (scheduler config, options, dtypes, policy, components,
tokenizers' padding sides); for a folder or file its files' sizes and modification times."""

import hashlib
from pathlib import Path

import pytest


def _module_state(module):
    import torch
    digest = hashlib.sha1()
    for key, tensor in module.state_dict().items():
        digest.update(key.encode())
        digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    adapters = getattr(module, "peft_config", None)
    # diffusers' hooks (caching, offloading, layerwise casting) live in a HookRegistry (`_diffusers_hook`), which its
    # first cache_context creates empty: only one that holds hooks counts. torch's own forward hooks are left out:
    # transformers 5 installs its output-recording hooks on a text model's first forward
    hooked = sorted(n for n, m in module.named_modules()
                    if getattr(getattr(m, "_diffusers_hook", None), "hooks", None))
    return [type(module).__name__, digest.hexdigest(), str(next(module.parameters()).dtype), module.training,
            hooked, sorted(adapters or {})]


def _files_state(path):
    path = Path(path)
    files = sorted(path.rglob("*")) if path.is_dir() else [path]
    return [(str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in files if p.exists()]


def state_of(value):
    """A comparable snapshot of a fixture's value (tuples, lists and dicts taken item by item)."""
    import torch
    from mlxdiff.pipelines.base import Pipeline
    if isinstance(value, (tuple, list)):
        return [state_of(v) for v in value]
    if isinstance(value, dict):
        return {k: state_of(v) for k, v in value.items()}
    if isinstance(value, Path):
        return _files_state(value)
    if isinstance(value, Pipeline):
        return [value.scheduler_config, repr(value.options), str(value.dtype), str(value.stream_dtype),
                repr(value.policy), value.group, sorted(value.components), repr(value.components),
                {k: getattr(t, "padding_side", None) for k, t in (value.tokenizers or {}).items()}
                if isinstance(value.tokenizers, dict) else getattr(value.tokenizers, "padding_side", None),
                getattr(getattr(value, "tokenizer", None), "padding_side", None)]
    if hasattr(value, "components") and hasattr(value, "scheduler"):       # a diffusers pipeline
        return {k: [type(v).__name__, repr(dict(v.config)) if hasattr(v, "config") and k == "scheduler" else None,
                    getattr(v, "padding_side", None), _module_state(v) if isinstance(v, torch.nn.Module) else None]
                for k, v in value.components.items()}
    if isinstance(value, torch.nn.Module):
        return _module_state(value)
    return repr(value)


def unchanged(request, names):
    """Yield between the before / after snapshots of the fixtures in `names` the running test uses."""
    used = [n for n in names if n in request.fixturenames]
    before = {n: state_of(request.getfixturevalue(n)) for n in used}
    yield
    changed = [f"{n} ({_where(before[n], state_of(request.getfixturevalue(n)))})" for n in used
               if state_of(request.getfixturevalue(n)) != before[n]]
    if changed:
        pytest.fail(f"{request.node.nodeid} changed the shared fixture(s) {', '.join(changed)}: build the test's own "
                    "pipeline (or copy) instead", pytrace=False)


def _where(a, b, path=""):
    """The first place two snapshots differ, as an index path."""
    if isinstance(a, (list, dict)) and type(a) is type(b) and len(a) == len(b):
        for k in (a if isinstance(a, dict) else range(len(a))):
            if a[k] != b[k]:
                return _where(a[k], b[k], f"{path}[{k!r}]")
    return f"{path}: {str(a)[:120]} -> {str(b)[:120]}"
