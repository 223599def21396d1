"""The run policy: every choice of how a run spends memory and time, and its compute dtype, in one frozen object,
passed explicitly.

A pipeline holds one `RunPolicy`, built once by `from_switches` from `mlxdiff.load(memory_limit=, dtype=)` /
`--memory-limit`, `--dtype` and the MLXDIFF_* switches (mlxdiff/switches.py). Each phase refines it for its component
once the weights are loaded (memory.decide: pieces in flight, block compilation, convolution bands) and installs it
for the length of the phase with `installed(policy)`, a scoped, restorable context as mlx-lm's
`use_attention_backend`. The code that computes reads the installed policy (`current()`): the pacing points
(mlxdiff/pacing.py), the compiled blocks and fused pieces (models/fused.py), FLUX.2's SwiGLU ranges; the build
(loading/build.py: a model's `compute_dtype`) and the VAE encode and decode tails read its compute dtype
(`current_dtype()`). Outside any installed policy nothing is paced, a model is plain MLX (the caller evaluates) and
builds in float32.

The policy stack here and the running phase's pacing queue (pacing.py) are the only mutable module state.
"""

from contextlib import contextmanager
from dataclasses import dataclass, field, replace

from . import backend
import mlx.core as mx

from . import switches
from .errors import MlxdiffError

GB = 1024 ** 3
GGUF_LAYOUTS = ("auto", "raw", "affine")
MATMUL_STRATEGIES = ("qmm", "dequantize")


@dataclass(frozen=True)
class RunPolicy:
    memory_limit: int | None = None   # bytes; None: the free memory is the budget (memory.budget_bytes)
    in_flight: int = 1                # paced pieces of work queued at once (pacing.py); 1 is the memory floor
    compile_blocks: bool = False      # transformer blocks compiled whole (models/fused.compiled_block)
    conv_band: int | None = None      # a VAE convolution's largest working buffer before row bands; None: no bands
    cache_limit: int | None = None    # bytes MLX's buffer cache may keep in a phase; None: MLX's own limit
    fuse: bool = True                 # the blocks' elementwise chains compiled (models/fused.py)
    cuda_kernels: bool = True         # mlxdiff's CUDA kernels where they apply (policy.cuda_kernels)
    gguf_layout: str | None = None    # how GGUF tensors are kept; None: the spec's, else "auto" (formats/gguf.py)
    matmul: str | None = None         # how quantized layers multiply; None: the spec's, else per backend
    phase_markers: bool = False       # marker lines on stderr for mlxdiff.footprint
    paced: bool = True                # False while a compiled block is traced: the block is the unit of work
    fixed: frozenset = field(default=frozenset())   # fields a switch fixed: no phase decision changes them
    # the run's compute dtype, chosen once (load(dtype=) / --dtype: from_switches); float32 for a model on its own
    compute_dtype: mx.Dtype = mx.float32
    stream_dtype: mx.Dtype | None = None   # a transformer's residual streams' when wider ("float16-mixed": float32)

    @property
    def split_swiglu(self) -> bool:
        """FLUX.2's SwiGLU in two ranges of its hidden axis: at the memory floor (one piece in flight)."""
        return self.paced and self.in_flight == 1

    def refined(self, **decided) -> "RunPolicy":
        """This policy with a phase's decisions, except where a switch fixed the field."""
        return replace(self, **{k: v for k, v in decided.items() if k not in self.fixed})


def _flag(name, value) -> bool:
    if value not in ("0", "1"):
        raise MlxdiffError(f"{name}={value!r:.40}: expected 0 or 1 (or leave it unset)")
    return value == "1"


def _choice(name, value, allowed) -> str:
    if value not in allowed:
        raise MlxdiffError(f"{name}={value!r:.40}: expected one of {', '.join(allowed)} (or leave it unset)")
    return value


def _whole(name, value, low, high) -> int:
    if not value.isdigit() or not low <= int(value) <= high:
        raise MlxdiffError(f"{name}={value!r:.40}: expected a whole number from {low} to {high} (or leave it unset)")
    return int(value)


def from_switches(memory_limit_gb=None, environ=None, dtype=None) -> RunPolicy:
    """The base policy of a pipeline: `memory_limit_gb` (already checked, arguments.check_number), the compute dtype
    `dtype` names (backend.compute_dtype; None: the device's default) and the MLXDIFF_* switches that are set, each
    checked (a bad value is one MlxdiffError line)."""
    given = switches.read(environ)
    fields = {}
    if "MLXDIFF_IN_FLIGHT" in given:
        fields["in_flight"] = _whole("MLXDIFF_IN_FLIGHT", given["MLXDIFF_IN_FLIGHT"], 1, 64)
    if "MLXDIFF_COMPILE_BLOCKS" in given:
        fields["compile_blocks"] = _flag("MLXDIFF_COMPILE_BLOCKS", given["MLXDIFF_COMPILE_BLOCKS"])
    if "MLXDIFF_FUSE" in given:
        fields["fuse"] = _flag("MLXDIFF_FUSE", given["MLXDIFF_FUSE"])
    if "MLXDIFF_CUDA_KERNELS" in given:
        fields["cuda_kernels"] = _flag("MLXDIFF_CUDA_KERNELS", given["MLXDIFF_CUDA_KERNELS"])
    if "MLXDIFF_CONV_BAND" in given:
        fields["conv_band"] = _whole("MLXDIFF_CONV_BAND", given["MLXDIFF_CONV_BAND"], 0, 1 << 50) or None
    if "MLXDIFF_CACHE_LIMIT" in given:
        fields["cache_limit"] = _whole("MLXDIFF_CACHE_LIMIT", given["MLXDIFF_CACHE_LIMIT"], 0, 1 << 50) or None
    if "MLXDIFF_GGUF_LAYOUT" in given:
        fields["gguf_layout"] = _choice("MLXDIFF_GGUF_LAYOUT", given["MLXDIFF_GGUF_LAYOUT"], GGUF_LAYOUTS)
    if "MLXDIFF_MATMUL" in given:
        fields["matmul"] = _choice("MLXDIFF_MATMUL", given["MLXDIFF_MATMUL"], MATMUL_STRATEGIES)
    if "MLXDIFF_DEVICE" in given:     # applied at import (backend.py); checked here
        _choice("MLXDIFF_DEVICE", given["MLXDIFF_DEVICE"], ("cpu", "gpu"))
    if "MLXDIFF_PHASE_MARKERS" in given:
        fields["phase_markers"] = True
    limit = None if memory_limit_gb is None else int(memory_limit_gb * GB)
    return RunPolicy(memory_limit=limit, fixed=frozenset(fields), compute_dtype=backend.compute_dtype(dtype),
                     stream_dtype=backend.stream_dtype(dtype), **fields)


# -- the installed policy ----------------------------------------------------------------------------------------

_stack = []   # installed policies, innermost last


def current() -> RunPolicy | None:
    """The policy installed for the running phase, or None (a model called on its own: nothing is paced)."""
    return _stack[-1] if _stack else None


def current_dtype() -> mx.Dtype:
    """The dtype the running phase computes in: the installed policy's, float32 with none (a model on its own)."""
    return (current() or RunPolicy()).compute_dtype


def _cache_cap(policy: RunPolicy):
    """The most MLX's buffer cache may keep under `policy`: its cache_limit, and under a memory limit a quarter of
    it (beside what is cached already); None: no cap of its own."""
    caps = [c for c in (policy.cache_limit, policy.memory_limit and
                        min(policy.memory_limit, mx.get_cache_memory() + policy.memory_limit // 4)) if c]
    return min(caps) if caps else None


def cuda_kernels() -> bool:
    """Whether mlxdiff's own CUDA kernels run (models/fused.norm_rope and norm_modulate, formats/quantized's affine
    dequantize and palettized decode): the CUDA default device, and fusion and the kernels on in the installed
    policy (with none installed, on)."""
    policy = current()
    if (policy is not None and not (policy.fuse and policy.cuda_kernels)) or mx.default_device() != mx.gpu:
        return False
    cuda = getattr(mx, "cuda", None)
    return bool(cuda and cuda.is_available())


@contextmanager
def installed(policy: RunPolicy):
    """`policy` in force for the block, restored on leaving. A memory limit also caps MLX's allocator for that long,
    and the policy's cache cap MLX's buffer cache; a cap never raises MLX's own cache limit (mlx-cpu keeps only
    32 MiB of freed buffers by default; raising it made a CPU run under --memory-limit hold more, not less). A
    limit the enclosing policy already set is not set again."""
    outer = current()
    memory = cache = None
    if policy.memory_limit and (outer is None or outer.memory_limit != policy.memory_limit):
        memory = mx.set_memory_limit(policy.memory_limit)
    cap = _cache_cap(policy)
    if cap is not None and (outer is None or _cache_cap(outer) != cap):
        cache = mx.set_cache_limit(cap)
        if cache < cap:      # MLX's own limit was lower: keep it
            mx.set_cache_limit(cache)
    _stack.append(policy)
    try:
        yield policy
    finally:
        _stack.pop()
        if memory is not None:
            mx.set_memory_limit(memory)
        if cache is not None:
            mx.set_cache_limit(cache)
