"""Several processes, one job: the mx.distributed group that `mlx.launch` started this process in (the ring backend
over TCP or Thunderbolt, MPI, NCCL), and what a command splits over it. Data-parallel jobs: a command's images
(`--seed` lists, `--num-images`, `--prompts-file`) go round-robin over the ranks, each made exactly as a single
process makes it, each written by the rank that made it. Guidance-parallel runs (`--split guidance`,
`mlxdiff.load(group=...)`): the two forwards of classifier-free guidance on two ranks (pipelines/base.guidance_pair),
rank 0 writing. Tensor-parallel runs (`--split tensor`, `mlxdiff.load(group=..., split="tensor")`): the transformer's
blocks sharded over the ranks as mlx-lm shards its LLMs (each architecture's `Model.shard(group)`, with mlx.nn's
sharded linear layers): attention heads and the feed-forward hidden width split, q/k/v and the feed-forward input
projections all-to-sharded, the attention output and feed-forward output projections sharded-to-all (one all_sum
each); the modulation linears (SD3.5's per-block adaLN, FLUX.2's shared ones) split by output rows and gathered back
(one small all_gather of a (batch, width) vector each). Every rank runs the whole job on every image (the text
encoders and the VAE whole on each), rank 0 writes. Nothing here runs without mlx.launch: a plain process is a group
of one, and every command behaves as before.

    mlx.launch --backend ring -n 2 -- python -m mlxdiff.generate --seed 1 2 3 4 --output fox.png
    mlx.launch --backend ring --hostfile macs.json -- python -m mlxdiff.generate ...   # two Macs
"""

import hashlib
from dataclasses import dataclass

from . import backend  # noqa: F401  (OpenBLAS preload before mlx)
import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .errors import MlxdiffError
from .loading.spec import ComponentSpec

SPLITS = ("guidance", "tensor")     # mlxdiff.load(split=...): what a group of ranks shares
TENSOR_FAMILIES = ("sd3", "flux2")  # whose transformers have Model.shard


def job_group():
    """The group of this process's ranks when mlx.launch started several, else None."""
    if not mx.distributed.is_available():
        return None
    group = mx.distributed.init()
    return group if group.size() > 1 else None


def check_same_job(group, key: str) -> None:
    """Every rank must run the same job (the same arguments): refused on every rank, in one line, if they differ
    (a rank that split a job differently would write other images under the same names)."""
    mine = mx.array(np.frombuffer(hashlib.sha256(key.encode()).digest()[:16], np.uint8).astype(np.int32))
    total = mx.distributed.all_sum(mine, group=group)     # every rank's digest bytes, summed: N x its own if alike
    if not bool(mx.array_equal(total, mine * group.size()).item()):
        raise MlxdiffError(f"rank {group.rank()} of {group.size()}: the ranks were started with different arguments; "
                           "start every rank with the same command (mlx.launch does)")


def check_guidance_group(group):
    """mlxdiff.load's group=: None, or an mx.distributed group of exactly two ranks (one per guidance forward)."""
    if group is None:
        return None
    if not isinstance(group, mx.distributed.Group):
        raise MlxdiffError(f"group={type(group).__name__}: give an mx.distributed group (mx.distributed.init()) or "
                           "None")
    if group.size() != 2:
        raise MlxdiffError(f"group of {group.size()} ranks: guidance-parallel runs take exactly 2 (one per forward "
                           "of classifier-free guidance); start two ranks, or give group=None")
    return group


def check_split(split, group):
    """mlxdiff.load's split= (with group=): "guidance" (the default) or "tensor"; refused in one line otherwise."""
    if split is None:
        return "guidance"
    if split not in SPLITS:
        raise MlxdiffError(f"split={split!r}: use one of {', '.join(SPLITS)}")
    if group is None:
        raise MlxdiffError(f"split={split!r} needs group= (an mx.distributed group of the ranks mlx.launch started)")
    return split


def check_tensor_group(group, family: str):
    """A group to shard a transformer over: an mx.distributed group of two or more ranks, for a family whose
    transformer can be sharded (TENSOR_FAMILIES)."""
    if not isinstance(group, mx.distributed.Group):
        raise MlxdiffError(f"group={type(group).__name__}: give an mx.distributed group (mx.distributed.init())")
    if group.size() < 2:
        raise MlxdiffError(f"group of {group.size()} rank: tensor-parallel runs take 2 or more; start several ranks "
                           "with mlx.launch, or give group=None")
    if family not in TENSOR_FAMILIES:
        raise MlxdiffError(f"split='tensor': the {family} family's denoiser cannot be sharded yet (FLUX.2 and SD3.5 "
                           "transformers can); use --split images or --split guidance")
    return group


def tensor_parallel(spec, group) -> "TensorParallelSpec":
    """`spec` (a transformer's) as a TensorParallelSpec over `group`; its config checked for the split here, before
    anything is read (heads and widths that the ranks do not divide are refused in one line)."""
    spec.arch.check_shardable(spec.args, group.size())
    fields = {name: getattr(spec, name) for name in spec.__dataclass_fields__}
    return TensorParallelSpec(**fields, group=group)


@dataclass
class TensorParallelSpec(ComponentSpec):
    """A component whose model is sharded over `group` between its lazy build and its materialization: build() makes
    the model as any spec does (weights mapped, quantized layers made, nothing read but the small checked tensors),
    then `model.shard(group)` swaps its block linears for slices of the same lazy arrays, so that materializing
    evaluates only this rank's slices (MLX still reads each whole tensor from the file to slice it: the file's
    bytes pass through, a layer at a time, but only the slices stay). `loaded_nbytes` is this rank's share, so the
    memory budget (memory.check_fits) counts what a rank holds."""
    group: object = None

    def build(self, compute_dtype=None, standins=frozenset(), check=True):
        n = self.group.size()
        if standins:
            raise MlxdiffError(f"{self.name}: its 1/{n} share does not fit this rank's memory budget, and a "
                               "tensor-parallel transformer cannot stream its blocks; raise --memory-limit or "
                               "start more ranks")
        if self.loras:
            raise MlxdiffError(f"{self.name}: LoRAs are not added to a tensor-parallel transformer yet; use "
                               "--split guidance or --split images with --lora")
        model = super().build(compute_dtype, check=check)
        model.shard(self.group)
        return model

    def loaded_nbytes(self, quantize=None, compute_dtype=None) -> int:
        """This rank's bytes: those of the sharded model, built lazily (nothing read). GGUF files (their build
        converts what it reads): the whole model's bytes, a bound."""
        from .formats import is_gguf
        from .loading.quantize import parameter_nbytes, setting
        from dataclasses import replace
        if any(is_gguf(f) for f in self.files):
            return super().loaded_nbytes(quantize, compute_dtype)
        spec = replace(self, quantize=self.quantize if quantize is None else setting(quantize), loras=())
        model = spec.build(compute_dtype, check=False)
        try:
            return parameter_nbytes(model)
        finally:
            model.clear()


# -- sharding one layer (what each Model.shard calls) ----------------------------------------------------------

def _refuse(where, why):
    return MlxdiffError(f"tensor-parallel split: layer {where} {why}")


def shard_layer(layer, sharding: str, group, where: str, boundaries=()):
    """`layer` as mlx.nn's sharded layer of the same kind (AllToShardedLinear / ShardedToAllLinear, or their
    Quantized* twins for a quantized layer), through mlx's own `shard_linear`. `sharding`: "all-to-sharded" (output
    rows split: q, k, v, a feed-forward's input) or "sharded-to-all" (input columns split, then one all_sum: the
    attention and feed-forward outputs). `boundaries`: offsets (in output rows, or input columns) of the parts a
    fused layer is made of ([gate; value], [q; k; v; gate; up], [attention | mlp]): each part is split over the
    ranks on its own. Layers whose stored blocks cannot be split so (a GGUF file's raw blocks, float8 codes with
    row scales, palettized tables, a LoRA around a layer) are refused in one line naming the layer."""
    n = group.size()
    kind = type(layer).__name__
    if type(layer) is not nn.Linear and not isinstance(layer, nn.QuantizedLinear):
        advice = {"RawLinear": "holds a GGUF file's raw blocks, which are not split; load it in the affine layout "
                               "(MLXDIFF_GGUF_LAYOUT=affine) or use --split guidance",
                  "Fp8Linear": "holds float8 codes, which are not split yet; quantize it (--quantize) or use "
                               "--split guidance",
                  "PalettizedLinear": "is palettized, which is not split yet; use --split guidance"}
        raise _refuse(where, advice.get(kind, f"is a {kind}, which cannot be split; use --split guidance"))
    rows = sharding == "all-to-sharded"
    quantized = isinstance(layer, nn.QuantizedLinear)
    out_dims = layer.weight.shape[0]
    in_dims = layer.weight.shape[1] * 32 // layer.bits if quantized else layer.weight.shape[1]
    width = out_dims if rows else in_dims
    edges = [0, *boundaries, width]
    parts = [b - a for a, b in zip(edges, edges[1:])]
    unit = layer.group_size * n if quantized and not rows else n
    if any(p % unit for p in parts):
        what = "output rows" if rows else "input columns"
        need = f"{n} ranks" + (f" x its group size {layer.group_size}" if unit != n else "")
        raise _refuse(where, f"has {what} in parts of {parts}, which {need} do not divide; start a number of ranks "
                             "that does, or use --split guidance")
    if not boundaries:
        segments = 1
    elif rows or not quantized:
        segments = list(boundaries)      # mx.split indices, in the layer's own (unpacked) rows or columns
    else:
        # a quantized layer's columns are packed (weight) and grouped (scales, biases): mlx splits them at the same
        # fractions of each array's width; each must land exactly on a part's edge
        segments = [b / width for b in boundaries]
        for array in (layer.weight, layer.scales):
            w = array.shape[-1]
            if any(int(s * w) * width != b * w for s, b in zip(segments, boundaries)):
                raise _refuse(where, "has parts that its packed columns cannot be split at; use --split guidance")
    return nn.layers.distributed.shard_linear(layer, sharding, segments=segments, group=group)


class GatheredLinear(nn.Module):
    """A linear layer split by output rows over the ranks (mlx's AllToShardedLinear, or its quantized twin), whose
    output slices are gathered back, so every rank has the whole output (exact: no sum). For the modulation linears,
    whose outputs are small (batch, k x width) vectors and whose weights are not: one all_gather each."""

    def __init__(self, layer, group, where: str):
        super().__init__()
        self.layer = shard_layer(layer, "all-to-sharded", group, where)
        self.group = group

    def __call__(self, x):
        return gather_last(self.layer(x), self.group)


def gather_last(x, group):
    """(..., F / N) on each of N ranks -> (..., F): the ranks' slices side by side, in rank order."""
    n = group.size()
    both = mx.distributed.all_gather(x.reshape(1, -1), group=group)     # (N, prod(x.shape))
    return mx.moveaxis(both.reshape(n, *x.shape), 0, -2).reshape(*x.shape[:-1], n * x.shape[-1])


def check_divides(what: str, count: int, n: int, unit: str = "") -> None:
    """A count (heads, a hidden width) the N ranks must split evenly, else one line."""
    if count % n:
        raise MlxdiffError(f"{what}: {count}{unit} do not split over {n} ranks; start a number of ranks that divides "
                           f"{count}, or use --split guidance")


def share(count: int, group) -> range:
    """The job's items (0 .. count-1) this rank makes: every size-th from its rank on."""
    return range(count) if group is None else range(group.rank(), count, group.size())
