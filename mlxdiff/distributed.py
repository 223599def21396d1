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
(one small all_gather of a (batch, width) vector each; the layers: models/sharding.py; the spec that shards after
the lazy build: loading/tensor_parallel.py). Every rank runs the whole job on every image (the text
encoders and the VAE whole on each), rank 0 writes. Nothing here runs without mlx.launch: a plain process is a group
of one, and every command behaves as before.

    mlx.launch --backend ring -n 2 -- python -m mlxdiff.generate --seed 1 2 3 4 --output fox.png
    mlx.launch --backend ring --hostfile macs.json -- python -m mlxdiff.generate ...   # two Macs
"""

import hashlib

from . import backend  # noqa: F401  (OpenBLAS preload before mlx)
import mlx.core as mx
import numpy as np

from .errors import MlxdiffError

SPLITS = ("guidance", "tensor")     # mlxdiff.load(split=...): what a group of ranks shares


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


def check_tensor_group(group, title: str, shardable: bool, which_can: str):
    """A group to shard a transformer over: an mx.distributed group of two or more ranks, for a family (`title`)
    whose denoiser can be sharded (its model has Model.shard; `which_can`: the families that can, for the line)."""
    if not isinstance(group, mx.distributed.Group):
        raise MlxdiffError(f"group={type(group).__name__}: give an mx.distributed group (mx.distributed.init())")
    if group.size() < 2:
        raise MlxdiffError(f"group of {group.size()} rank: tensor-parallel runs take 2 or more; start several ranks "
                           "with mlx.launch, or give group=None")
    if not shardable:
        raise MlxdiffError(f"split='tensor': the {title} family's denoiser cannot be sharded yet ({which_can} "
                           "can); use --split images or --split guidance")
    return group


def share(count: int, group) -> range:
    """The job's items (0 .. count-1) this rank makes: every size-th from its rank on."""
    return range(count) if group is None else range(group.rank(), count, group.size())
