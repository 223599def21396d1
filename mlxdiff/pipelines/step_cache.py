"""Step caching, opt-in: a denoising step's remaining blocks skipped when the first block's output barely changed
(`--cache first-block[:threshold]`, generate(cache="first-block:0.2")).

This is diffusers' First Block Cache (hooks/first_block_cache.py, FirstBlockCacheConfig), decided the same way:
after the first transformer block, the change of its image-stream residual (output - input) since the last forward
that ran every block, mean(|r - r_prev|) / mean(|r_prev|) in the compute dtype, is compared with the threshold; above
it every block runs and the residual of the remaining blocks (the image stream after the last block minus after the
first) is kept, otherwise that kept residual is added to the first block's output instead of running them. The
first forward always runs every block. Conditional and unconditional forwards keep separate state when they run
separately (FLUX.2 with CFG, as diffusers' klein pipeline's "cond"/"uncond" contexts); a batched CFG forward (SD3.5)
decides once for the batch, as diffusers does.

diffusers 0.42's hook fails on both transformers we have (FLUX.2: huggingface/diffusers#14280, its tail block
returns the joined streams; SD3.5: its last block returns no text stream): the parity tests use it with the tail
arithmetic mended as the open fix (#14359) does, which leaves every decision and value as above.

The model only calls `reuse` after its first block and `remember` after its last (models/flux2.py, models/mmdit.py
take `step_cache=`); what is skipped is decided here. Figures: bench/RESULTS.md, "Step caching".
"""

from dataclasses import dataclass, field

from .. import backend  # noqa: F401  (OpenBLAS preload before mlx)
import mlx.core as mx

from ..errors import MlxdiffError

KINDS = ("first-block",)
DEFAULT_THRESHOLD = 0.05        # FirstBlockCacheConfig's default
USAGE = "give first-block or first-block:THRESHOLD (a number > 0, e.g. first-block:0.2)"


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


def parse(spec) -> FirstBlockCache | None:
    """"first-block" / "first-block:0.2" / None (or a FirstBlockCache, given fresh per call) -> a fresh cache, or one
    line naming what to give."""
    if spec is None or isinstance(spec, FirstBlockCache):
        return None if spec is None else FirstBlockCache(spec.threshold)
    if not isinstance(spec, str):
        raise MlxdiffError(f"cache={spec!r}: {USAGE}")
    kind, _, value = spec.strip().partition(":")
    if kind not in KINDS:
        raise MlxdiffError(f"cache {spec!r}: unknown kind {kind!r}; {USAGE}")
    if not value:
        return FirstBlockCache()
    try:
        threshold = float(value)
    except ValueError:
        threshold = float("nan")
    if not threshold > 0 or threshold == float("inf"):
        raise MlxdiffError(f"cache {spec!r}: the threshold must be a number > 0; {USAGE}")
    return FirstBlockCache(threshold)
