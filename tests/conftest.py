"""Shared fixtures: tiny random diffusers pipelines saved with save_pretrained (the real Hugging Face layout)."""

import os
import sys
from pathlib import Path

import pytest

# pytest-xdist's workers share the cores: each worker (and the commands it starts) gets its share of BLAS and OpenMP
# threads, set before mlxdiff loads OpenBLAS and before torch starts, which read them once. Left at one thread per
# core in every worker, OpenBLAS's threads contend: two workers drawing the embedded default at once took 10% longer.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS"):
        os.environ.setdefault(_var, str(max(1, len(os.sched_getaffinity(0)) // _WORKERS)))

import mlxdiff  # noqa: E402,F401  (OpenBLAS preload before anything imports mlx)

sys.path.insert(0, str(Path(__file__).parent))
from sd3_helpers import sd3_tiny_components  # noqa: E402


@pytest.fixture(scope="session")
def sd3_tiny(tmp_path_factory):
    """(folder, diffusers pipeline) of a tiny SD3 pipeline saved with save_pretrained."""
    from diffusers import StableDiffusion3Pipeline
    pipe = StableDiffusion3Pipeline(**sd3_tiny_components())
    folder = tmp_path_factory.mktemp("sd3_tiny")
    pipe.save_pretrained(str(folder))
    # the reference reads the same folder we do (a T5 tokenizer's normalizer changes on a save/load round trip)
    return folder, StableDiffusion3Pipeline.from_pretrained(str(folder))


def _pipeline_state(pipe, folder):
    """What a test could change on a shared diffusers pipeline and its folder, cheaply: each component's class,
    config, dtype, mode, diffusers hooks (its HookRegistry patches `forward` on the module; transformers' own
    output-capturing torch hooks, installed at a first call, are not counted) and a digest of its weights; the
    folder's files with their sizes and modification times."""
    import hashlib
    import torch
    state = {}
    for name, component in pipe.components.items():
        config = getattr(component, "config", None)
        entry = [type(component).__name__, repr(config.to_dict() if hasattr(config, "to_dict") else config)]
        if isinstance(component, torch.nn.Module):
            digest = hashlib.sha1()
            for key, tensor in component.state_dict().items():
                digest.update(key.encode())
                digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
            entry += [digest.hexdigest(), str(component.dtype), component.training,
                      sorted(n for n, m in component.named_modules()
                             if "forward" in vars(m) or getattr(m, "_diffusers_hook", None) is not None)]
        state[name] = entry
    state["folder"] = sorted((str(p.relative_to(folder)), p.stat().st_size, p.stat().st_mtime_ns)
                             for p in Path(folder).rglob("*"))
    return state


@pytest.fixture(autouse=True)
def _sd3_tiny_unchanged(request):
    """The session's sd3_tiny is shared by every test that asks for it: a test that needs another scheduler, a hook
    or other weights builds its own pipeline (issue 47). Checked after each test that uses it."""
    if "sd3_tiny" not in request.fixturenames:
        yield
        return
    folder, pipe = request.getfixturevalue("sd3_tiny")
    before = _pipeline_state(pipe, folder)
    yield
    after = _pipeline_state(pipe, folder)
    changed = sorted(name for name in before if before[name] != after.get(name))
    assert not changed, (f"{request.node.nodeid} changed the shared sd3_tiny fixture ({', '.join(changed)}): build "
                         "the test's own pipeline instead")
