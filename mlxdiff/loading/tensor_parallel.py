"""A transformer sharded over the ranks of a tensor-parallel run (mlxdiff/distributed.py): its spec shards the model
between the lazy build and materializing, and counts a rank's share for the memory budget."""

from dataclasses import dataclass, replace

from ..errors import MlxdiffError
from ..formats import format_of
from .quantize import parameter_nbytes, setting
from .spec import ComponentSpec


def tensor_parallel(spec, group) -> "TensorParallelSpec":
    """`spec` (a transformer's) as a TensorParallelSpec over `group`; its config checked for the split here, before
    anything is read (heads and widths that the ranks do not divide are refused in one line)."""
    spec.arch.check_shardable(spec.args, group.size())
    fields = {name: getattr(spec, name) for name in spec.__dataclass_fields__}
    return TensorParallelSpec(**fields, group=group)


def shardable(spec, group) -> bool:
    """Whether a component other than the transformer splits over `group` too: its architecture can shard (a text
    encoder of models/text_llm.py) and its config divides, its file is not GGUF (a GGUF encoder's split is not
    tested yet: it stays whole) and it has no LoRA. Otherwise every rank holds it whole (generate's rank line says
    which components are split)."""
    return (hasattr(spec.arch, "shards_evenly") and all(format_of(f, header=False).shards for f in spec.files)
            and not spec.loras and spec.arch.shards_evenly(spec.args, group.size()))


@dataclass
class TensorParallelSpec(ComponentSpec):
    """A component whose model is sharded over `group` between its lazy build and its materialization: build() makes
    the model as any spec does (weights mapped, quantized layers made, nothing read but the small checked tensors),
    then `model.shard(group)` swaps its block linears for slices of the same lazy arrays, so that materializing
    evaluates only this rank's slices (MLX still reads each whole tensor from the file to slice it: the file's
    bytes pass through, a layer at a time, but only the slices stay). `loaded_nbytes` is this rank's share, so the
    memory budget (memory.check_fits) counts what a rank holds."""
    group: object = None

    def build(self, standins=frozenset(), check=True):
        n = self.group.size()
        if standins:
            raise MlxdiffError(f"{self.name}: its 1/{n} share does not fit this rank's memory budget, and a "
                               f"tensor-parallel {self.name} cannot stream its blocks; raise --memory-limit, start "
                               "more ranks, or quantize it once (python -m mlxdiff.convert)")
        if self.loras:
            raise MlxdiffError(f"{self.name}: LoRAs are not added to a tensor-parallel transformer yet; use "
                               "--split guidance or --split images with --lora")
        model = super().build(check=check)
        model.shard(self.group)
        return model

    def loaded_nbytes(self, quantize=None, compute_dtype=None) -> int:
        """This rank's bytes: those of the sharded model, built lazily (nothing read). GGUF files (their build
        converts what it reads): the whole model's bytes, a bound."""
        if any(format_of(f, header=False).converts for f in self.files):
            return super().loaded_nbytes(quantize, compute_dtype)
        spec = replace(self, quantize=self.quantize if quantize is None else setting(quantize), loras=())
        model = spec.build(check=False)     # in the installed policy's compute dtype
        try:
            return parameter_nbytes(model)
        finally:
            model.clear()
