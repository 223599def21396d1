"""Which components stay loaded across generate() calls (keep=), and the one place a phase gets its model: loaded
(loading/component.py) or kept, under the run policy refined for that phase (memory.decide), installed for as long
as the phase uses it (policy.installed)."""

import gc
from contextlib import contextmanager

from .. import backend
import mlx.core as mx

from ..errors import MlxdiffError
from ..loading.component import load_component
from ..memory import cache_limit_for, decide, release_host_memory
from ..pacing import settle
from ..policy import RunPolicy, installed

KEEP_POLICIES = ("none", "auto", "all")
AUTO_SHARE = 0.75   # keep="auto" without a memory limit: components stay while they fit in this share of memory


def release(collect=True):
    if collect:
        gc.collect()
    mx.clear_cache()
    release_host_memory()


def free_model(model, nbytes):
    """Empties a phase's model (its layers go with their last reference) and frees what it held. A full collection
    only when its weights outlive that (a reference cycle holds them): one scans every live object, which costs
    most beside large libraries (bench/RESULTS.md, "The suite's time")."""
    before = mx.get_active_memory()
    model.clear()
    release(collect=before - mx.get_active_memory() < nbytes)


class Residency:
    """Which components a pipeline keeps loaded across generate() calls (keep=):
    - "none": load, use, free in every phase (the peak is the largest phase);
    - "all": keep every component once loaded (repeated calls load nothing);
    - "auto": keep a component while it, the others kept, and the largest other component together fit the
      budget (the policy's memory limit, else AUTO_SHARE of physical memory), so that any next phase still fits;
      otherwise free it as "none" does. A run that does not fit behaves as "none"."""

    def __init__(self, keep="none"):
        if keep not in KEEP_POLICIES:
            raise MlxdiffError(f"keep={keep!r}: use one of {', '.join(KEEP_POLICIES)}")
        self.keep = keep
        self.models = {}    # spec key -> (model, resident bytes)

    @staticmethod
    def key(spec):
        return (spec.name, tuple(str(f) for f in spec.files), repr(sorted(spec.config.items())), repr(spec.quantize),
                spec.matmul, tuple(getattr(spec, "loras", ())))

    def held_bytes(self) -> int:
        return sum(n for _, n in self.models.values())

    def keeps(self, nbytes, largest_other, policy: RunPolicy) -> bool:
        if self.keep != "auto":
            return self.keep == "all"
        budget = policy.memory_limit or AUTO_SHARE * backend.physical_memory(working_set=True)
        return self.held_bytes() + nbytes + largest_other <= budget

    @contextmanager
    def use(self, spec, policy: RunPolicy, result=None, largest_other=0):
        """The model of `spec`, kept from an earlier call or loaded under `policy`, used under the policy decided
        for this phase; kept or emptied on leaving by the keep policy."""
        key = self.key(spec)
        # the load too keeps MLX's buffer cache small: a GGUF load's converted chunks are not held beside the weights
        loading = policy.refined(cache_limit=cache_limit_for(policy))
        with installed(loading):
            held = self.models.pop(key, None)
            if held is not None:
                model, nbytes = held
                if result is not None and spec.name not in result.reused:   # SD3.5's CLIPs serve two prompts
                    result.reused.append(spec.name)
            else:
                loaded = load_component(spec, loading)
                model, nbytes = loaded.model, loaded.nbytes
                if result is not None:
                    result.notes.extend(loaded.notes)
                    result.load_seconds[spec.name] = loaded.seconds
                    result.count_weights(nbytes)
            phase_policy = decide(policy, model)     # with this phase's weights in memory
            if result is not None and phase_policy.in_flight > 1:
                result.notes.append(f"{spec.name}: {phase_policy.in_flight} pieces of work in flight (memory to "
                                    "spare)")
            try:
                with installed(phase_policy), backend.kernel_build_errors():
                    yield model
            finally:
                settle()
                stream = getattr(model, "block_stream", None)   # loading/streaming.py: what this phase read
                if stream is not None and result is not None and stream.bytes_read:
                    result.notes.append(stream.summary(spec.name))
                if stream is not None:
                    stream.reset()
                if self.keeps(nbytes, largest_other, policy):
                    self.models[key] = (model, nbytes)
                else:
                    free_model(model, nbytes)
                    del model

    def clear(self):
        for model, _ in self.models.values():
            model.clear()
        self.models.clear()
        release()
