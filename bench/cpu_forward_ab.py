"""One transformer forward on this CPU (float32, OpenBLAS), run in a given tree: a check that a change did not slow the
CPU path. `python bench/cpu_forward_ab.py TREE sd3|klein` (TREE: a checkout, e.g. a `git worktree` of the commit
before); SD3.5 Medium widths with 6 blocks (3 dual) at 384x384, CFG batch 2, or klein-4B at 512x512; median of 3 forwards
after one warm-up. Prints one json line."""

import sys, time, statistics, json
sys.path.insert(0, sys.argv[1])
import mlxdiff  # noqa
import mlx.core as mx, mlx.nn as nn
from mlxdiff.models import mmdit, flux2
from mlxdiff.pipelines.base import evaluate_each_block
from mlxdiff.policy import RunPolicy, installed
which = sys.argv[2]
mx.random.seed(0)
if which == "sd3":
    m = mmdit.Model(mmdit.ModelArgs(num_layers=6, dual_attention_layers=(0, 1, 2)))
    m.update(nn.utils.tree_map(lambda a: mx.random.normal(a.shape) * 0.02 if a.ndim > 1 else mx.ones(a.shape), m.parameters()))
    m.compute_dtype = mx.float32
    mx.eval(m.parameters())
    x = mx.random.normal((2, 16, 48, 48)); ctx = mx.random.normal((2, 333, 4096)); pooled = mx.random.normal((2, 2048))
    call = lambda: m(x, ctx, pooled, mx.array([500.0, 500.0]), after_block=evaluate_each_block)
else:
    m = flux2.Model(flux2.ModelArgs(num_layers=5, num_single_layers=20, num_attention_heads=24, joint_attention_dim=7680, guidance_embeds=False))
    m.update(nn.utils.tree_map(lambda a: mx.random.normal(a.shape) * 0.02 if a.ndim > 1 else mx.ones(a.shape), m.parameters()))
    m.compute_dtype = mx.float32
    mx.eval(m.parameters())
    import numpy as np
    h = w = 32
    img = mx.random.normal((1, h * w, 128)); txt = mx.random.normal((1, 512, 7680))
    ids = np.stack(np.meshgrid(np.zeros(1), np.arange(h), np.arange(w), np.zeros(1), indexing="ij"), -1).reshape(1, -1, 4).astype(np.int32)
    tids = np.zeros((1, 512, 4), np.int32); tids[..., 3] = np.arange(512)
    call = lambda: m(img, txt, mx.array([0.5]), mx.array(ids), mx.array(tids), after_block=evaluate_each_block)
times = []
for i in range(4):
    t = time.perf_counter()
    with installed(RunPolicy()):
        mx.eval(call())
    if i: times.append(time.perf_counter() - t)
print(json.dumps({"tree": sys.argv[1], "model": which, "median_s": round(statistics.median(times), 3), "all": [round(t, 3) for t in times]}))
