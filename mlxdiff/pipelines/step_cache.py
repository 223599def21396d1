"""Step caching, opt-in: work a denoising step skips where its result can be had from earlier steps.

- `--cache first-block[:threshold]` (generate(cache="first-block:0.2")): a step's blocks after the first skipped when
  the first block's output barely changed. This is diffusers' First Block Cache (hooks/first_block_cache.py,
  FirstBlockCacheConfig), decided the same way: after the first transformer block, the change of its image-stream
  residual (output - input) since the last forward that ran every block, mean(|r - r_prev|) / mean(|r_prev|) in the
  compute dtype, is compared with the threshold; above it every block runs and the residual of the remaining blocks
  (the image stream after the last block minus after the first) is kept, otherwise that kept residual is added to
  the first block's output instead of running them. The first forward always runs every block.
- `--cache taylorseer[:interval[:order]]`: whole forwards skipped on a fixed schedule, their output predicted by a
  Taylor series of the transformer's output over the steps. This is diffusers' TaylorSeer cache in its lite mode
  (hooks/taylorseer_cache.py, TaylorSeerCacheConfig(use_lite_mode=True): every block skipped, proj_out's output
  predicted): forwards 0 .. WARMUP-1 run, then forward n runs when (n - WARMUP - 1) % interval == 0 and is
  predicted otherwise, from divided differences up to `order` (defaults: interval 5, order 1, WARMUP 3, diffusers').
  The factors are kept in the compute dtype (diffusers' default is bfloat16).

Conditional and unconditional forwards keep separate state when they run separately (FLUX.2 with CFG, as diffusers'
klein pipeline's "cond"/"uncond" contexts); a batched CFG forward (SD3.5) decides once for the batch, as diffusers
does.

diffusers 0.42's First Block Cache hook fails on both transformers we have (FLUX.2: huggingface/diffusers#14280,
its tail block returns the joined streams; SD3.5: its last block returns no text stream): the parity tests use it
with the tail arithmetic mended as the open fix (#14359) does, which leaves every decision and value as above.

A pipeline calls `forward(context, call)` for each transformer forward; `call(step_cache)` runs it, passing the
first-block state to the model as `step_cache=` (models/flux2.py, models/mmdit.py call `reuse` after their first
block and `remember` after their last). What is skipped is decided here. Figures: bench/RESULTS.md, "Step caching".
"""

import math
from dataclasses import dataclass, field

from .. import backend  # noqa: F401  (OpenBLAS preload before mlx)
import mlx.core as mx

from ..errors import MlxdiffError

KINDS = ("first-block", "taylorseer")
DEFAULT_THRESHOLD = 0.05        # FirstBlockCacheConfig's default
DEFAULT_INTERVAL, DEFAULT_ORDER, WARMUP = 5, 1, 3      # TaylorSeerCacheConfig's defaults
USAGE = ("give first-block[:THRESHOLD] (a number > 0, e.g. first-block:0.2) or taylorseer[:INTERVAL[:ORDER]] "
         "(whole numbers, INTERVAL >= 1, ORDER 0-4, e.g. taylorseer:5:1)")


class BlockResiduals:
    """One context's state (one kind of forward: "cond", "uncond"): the first block's residual and the remaining
    blocks' residual at the last forward that ran them all, and what each forward did."""

    def __init__(self, threshold: float):
        self.threshold = threshold
        self.head_residual = None
        self.tail_residual = None
        self.reused = []          # per forward: True where the remaining blocks were skipped
        self.changes = []         # per forward after the first: the relative change the threshold was held to

    def reuse(self, head_residual):
        """After the first block (head_residual: its image-stream output minus input): the remaining blocks'
        residual to add to the first block's output instead of running them, or None: run them, then `remember`."""
        previous = self.head_residual
        if previous is not None and self.tail_residual is not None:
            change = (mx.mean(mx.abs(head_residual - previous)) / mx.mean(mx.abs(previous))).item()
            self.changes.append(change)
            if not change > self.threshold:       # diffusers' test, NaN included
                self.reused.append(True)
                return self.tail_residual
        self.head_residual = head_residual
        self.reused.append(False)
        return None

    def remember(self, tail_residual):
        """After the last block of a forward that ran them all: the image stream's residual since the first block."""
        self.tail_residual = tail_residual


@dataclass
class FirstBlockCache:
    """The cache of one generate() call: its threshold and a BlockResiduals per context."""
    threshold: float = DEFAULT_THRESHOLD
    contexts: dict = field(default_factory=dict)

    def context(self, name: str) -> BlockResiduals:
        if name not in self.contexts:
            self.contexts[name] = BlockResiduals(self.threshold)
        return self.contexts[name]

    def forward(self, name: str, call):
        """One transformer forward of context `name`: call(step_cache) with that context's state."""
        return call(self.context(name))

    def reused_steps(self) -> dict:
        """{context: [indices of the forwards whose remaining blocks were skipped]}."""
        return {name: [i for i, r in enumerate(c.reused) if r] for name, c in self.contexts.items()}

    def note(self) -> str:
        """Result.notes' line: how many forwards of each context reused the kept residual."""
        parts = [f"{sum(c.reused)} of {len(c.reused)} {name} forwards" for name, c in self.contexts.items()]
        changes = sorted(x for c in self.contexts.values() for x in c.changes)
        spread = (f"; the first block's change ran {changes[0]:.3g} to {changes[-1]:.3g}, median "
                  f"{changes[len(changes) // 2]:.3g}" if changes else "")
        return (f"first-block cache (threshold {self.threshold:g}): remaining blocks skipped in "
                + (", ".join(parts) or "no forward") + spread)


class OutputSeries:
    """One context's TaylorSeer state: the forwards counted, the Taylor factors of the output at the last forward
    that ran (factor k: the k-th divided difference over the forward index), and what each forward did."""

    def __init__(self, interval: int, order: int):
        self.interval, self.order = interval, order
        self.forwards = 0
        self.last_run = None
        self.factors = []
        self.reused = []          # per forward: True where the output was predicted
        self.changes = []         # (first-block's figure; none here)

    def runs(self, n: int) -> bool:
        return n < WARMUP or (n - WARMUP - 1) % self.interval == 0

    def forward(self, call):
        n = self.forwards
        self.forwards += 1
        if self.runs(n) or not self.factors:
            out = call(None)
            factors = [out]
            if self.last_run is not None:       # recursive divided differences, as diffusers' update
                for k in range(min(self.order, len(self.factors))):
                    factors.append((factors[k] - self.factors[k]) / (n - self.last_run))
            self.factors, self.last_run = factors, n
            self.reused.append(False)
            return out
        offset = n - self.last_run
        out = self.factors[0]
        for k in range(1, len(self.factors)):
            out = out + self.factors[k] * (offset ** k / math.factorial(k))
        self.reused.append(True)
        return out


@dataclass
class TaylorSeerCache:
    """The TaylorSeer cache of one generate() call: its schedule and an OutputSeries per context."""
    interval: int = DEFAULT_INTERVAL
    order: int = DEFAULT_ORDER
    contexts: dict = field(default_factory=dict)

    def forward(self, name: str, call):
        if name not in self.contexts:
            self.contexts[name] = OutputSeries(self.interval, self.order)
        return self.contexts[name].forward(call)

    def reused_steps(self) -> dict:
        """{context: [indices of the forwards whose output was predicted]}."""
        return {name: [i for i, r in enumerate(c.reused) if r] for name, c in self.contexts.items()}

    def note(self) -> str:
        parts = [f"{sum(c.reused)} of {len(c.reused)} {name} forwards" for name, c in self.contexts.items()]
        return (f"taylorseer cache (interval {self.interval}, order {self.order}, first {WARMUP} run): predicted "
                + (", ".join(parts) or "no forward"))


def _whole(spec, text, low, high):
    if not (text.isdigit() and low <= int(text) <= high):
        raise MlxdiffError(f"cache {spec!r}: {text!r} is not a whole number from {low} to {high}; {USAGE}")
    return int(text)


def parse(spec):
    """"first-block" / "first-block:0.2" / "taylorseer" / "taylorseer:5:1" / None (or a cache, given fresh per call)
    -> a fresh FirstBlockCache or TaylorSeerCache, or one line naming what to give."""
    if spec is None:
        return None
    if isinstance(spec, FirstBlockCache):
        return FirstBlockCache(spec.threshold)
    if isinstance(spec, TaylorSeerCache):
        return TaylorSeerCache(spec.interval, spec.order)
    if not isinstance(spec, str):
        raise MlxdiffError(f"cache={spec!r}: {USAGE}")
    kind, _, value = spec.strip().partition(":")
    if kind not in KINDS:
        raise MlxdiffError(f"cache {spec!r}: unknown kind {kind!r}; {USAGE}")
    if kind == "taylorseer":
        interval, _, order = value.partition(":")
        return TaylorSeerCache(_whole(spec, interval, 1, 1000) if interval else DEFAULT_INTERVAL,
                               _whole(spec, order, 0, 4) if order else DEFAULT_ORDER)
    if not value:
        return FirstBlockCache()
    try:
        threshold = float(value)
    except ValueError:
        threshold = float("nan")
    if not threshold > 0 or threshold == float("inf"):
        raise MlxdiffError(f"cache {spec!r}: the threshold must be a number > 0; {USAGE}")
    return FirstBlockCache(threshold)
