"""One path from a ComponentSpec to a loaded model, for every component alike: check that it fits the budget, build
it (lazily mapped weights, quantized checkpoints, GGUF layers, LoRAs: ComponentSpec.build), give its quantized layers
their matmul strategy, and evaluate it one module at a time (quantize.materialize), so the peak stays about one
layer above the model."""

import time
from dataclasses import dataclass, field, replace

from .. import backend
import mlx.core as mx

from ..memory import check_fits, fmt_gb, release_host_memory
from ..policy import RunPolicy, installed
from .matmul import use_strategy
from .quantize import materialize
from .streaming import load_streamed


@dataclass
class Loaded:
    model: object
    nbytes: int                 # resident bytes it added
    seconds: float              # to map and read its weights
    notes: list = field(default_factory=list)   # what the budget chose (e.g. a GGUF layout)


def load_component(spec, policy: RunPolicy) -> Loaded:
    """The model of `spec`, loaded under `policy` (its memory limit, compute dtype, GGUF layout and matmul
    strategy), installed for the load (Residency.use installs it already); refused, in one line, before anything is
    read if it cannot fit."""
    if policy.gguf_layout and spec.gguf_layout is None:
        spec = replace(spec, gguf_layout=policy.gguf_layout)
    fitted = check_fits(spec, policy)
    notes = []
    if fitted.gguf_layout != spec.gguf_layout:
        notes.append(f"{spec.name}: GGUF weights kept as the file's {fitted.gguf_layout} blocks "
                     f"({fmt_gb(fitted.loaded_nbytes(compute_dtype=policy.compute_dtype))}) to fit the memory "
                     "budget")
    start, before = time.perf_counter(), mx.get_active_memory()
    strategy = fitted.matmul or policy.matmul or backend.default_matmul_strategy()
    with installed(policy):     # the build reads its compute dtype from the installed policy
        if fitted.stream_budget:
            model, plan = load_streamed(fitted, fitted.stream_budget, strategy)
            notes.append(plan.note(spec.name))
        else:
            model = fitted.build()
            use_strategy(model, strategy)
        materialize(model)
    mx.clear_cache()     # what the load converted and dropped (GGUF chunks, quantization inputs) is not kept
    release_host_memory()
    return Loaded(model, mx.get_active_memory() - before, time.perf_counter() - start, notes)
