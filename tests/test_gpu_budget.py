"""A memory limit on a GPU bounds the whole process (memory.check_fits): what the process holds outside MLX (the CUDA
context) comes off the budget, and a component loaded whole must leave room for its phase's activations and the
buffer cache, else it streams. FLUX.1-dev's Q4_K_S GGUF (6.33 GiB) under --memory-limit 8 was loaded whole and the
process peaked at 9.75 GiB (bench/RESULTS.md, "FLUX.1-dev streamed and as GGUF"). The GPU is stood in for by the
device MLX reports and NVML's reading; on the CPU the rule is unchanged."""

from dataclasses import dataclass

import mlxdiff  # noqa: F401  (OpenBLAS preload before mlx)
import mlx.core as mx

from mlxdiff import memory
from mlxdiff.policy import RunPolicy

GiB = 1 << 30


@dataclass(frozen=True)
class Spec:
    """What check_fits reads of a ComponentSpec."""
    nbytes: int
    files: tuple = ("transformer.safetensors",)
    gguf_layout: str | None = None
    stream_budget: int | None = None

    def loaded_nbytes(self, compute_dtype=None, quantize=None):
        return self.nbytes


def on_a_gpu(monkeypatch, held):
    """MLX on a GPU whose process holds `held` bytes by NVML (MLX's own active bytes included)."""
    monkeypatch.setattr(memory.mx, "default_device", lambda: mx.gpu)
    monkeypatch.setattr(memory, "process_memory", lambda *a, **k: {"gpu": held, "footprint": held})
    monkeypatch.setattr(memory, "available_bytes", lambda: 100 * GiB)


def test_on_a_gpu_the_limit_is_the_whole_process(monkeypatch):
    context = GiB // 2 + mx.get_active_memory() + mx.get_cache_memory()      # a 0.5 GiB CUDA context
    on_a_gpu(monkeypatch, context)
    policy = RunPolicy(memory_limit=8 * GiB)
    fitted = memory.check_fits(Spec(int(6.33 * GiB)), policy)
    assert fitted.stream_budget == 8 * GiB - GiB // 2       # streamed, within the limit less the context
    small = memory.check_fits(Spec(4 * GiB), policy)        # 4 + 3 GiB reserve fits 7.5: loaded whole
    assert small.stream_budget is None
    assert memory.check_fits(Spec(int(6.33 * GiB)), RunPolicy()).stream_budget is None   # no limit: whole


def test_on_the_cpu_the_rule_is_unchanged(monkeypatch):
    monkeypatch.setattr(memory, "available_bytes", lambda: 100 * GiB)
    assert memory.outside_mlx_bytes() == 0 and memory.device_cache_bytes() == 0
    fitted = memory.check_fits(Spec(int(7.9 * GiB)), RunPolicy(memory_limit=8 * GiB))
    assert fitted.stream_budget is None                     # the weights fit the limit: loaded whole
    assert memory.check_fits(Spec(9 * GiB), RunPolicy(memory_limit=8 * GiB)).stream_budget == 8 * GiB
