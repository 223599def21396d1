"""Per-forward time of a mid-size random FLUX.2 transformer (8 heads of 128, 2 double + 6 single blocks, 632 MB
float32; 1024 image + 128 text tokens), one process or sharded over the ranks mlx.launch started (issue 27):
    python bench/tensor_parallel_cpu.py  |  mlx.launch --backend ring -n 2 -- python bench/tensor_parallel_cpu.py"""
import time, sys, json
import mlxdiff  # noqa: F401  (OpenBLAS before mlx)
import numpy as np
import mlx.core as mx
from mlx.utils import tree_flatten
from mlxdiff.models import flux2

args = flux2.ModelArgs(in_channels=64, num_layers=2, num_single_layers=6, attention_head_dim=128,
                       num_attention_heads=8, joint_attention_dim=1024, mlp_ratio=3.0, guidance_embeds=True)
n_img, n_txt = 32 * 32, 128
mx.random.seed(0)
model = flux2.Model(args)
from mlx.utils import tree_unflatten
model.update(tree_unflatten([(k, mx.random.normal(v.shape, key=mx.random.key(i)) * 0.02)
                             for i, (k, v) in enumerate(tree_flatten(model.parameters()))]))
group = mx.distributed.init()
if group.size() > 1:
    model.shard(group)
mx.eval(model.parameters())
nbytes = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
x = mx.random.normal((1, n_img, args.in_channels), key=mx.random.key(100))
c = mx.random.normal((1, n_txt, args.joint_attention_dim), key=mx.random.key(101))
img_ids = np.stack(np.meshgrid(np.zeros(1), np.arange(32), np.arange(32), np.zeros(1), indexing="ij"), -1).reshape(-1, 4)
txt_ids = np.stack([np.zeros(n_txt), np.zeros(n_txt), np.zeros(n_txt), np.arange(n_txt)], -1)
times, out = [], None
for i in range(4):
    t = time.perf_counter()
    out = model(x, c, mx.array([0.5]), img_ids, txt_ids, guidance=mx.array([3.5]))
    mx.eval(out)
    times.append(time.perf_counter() - t)
dim = args.num_attention_heads * args.attention_head_dim
all_sum_elems = args.num_layers * 2 * (n_img + n_txt) * dim + args.num_single_layers * (n_img + n_txt) * dim
gather_elems = (6 + 6 + 3) * dim
print(json.dumps({"rank": group.rank(), "ranks": group.size(), "param_bytes": nbytes, "step_s": times,
                  "median_s": sorted(times[1:])[1], "all_sum_payload_bytes_f32": all_sum_elems * 4,
                  "gather_payload_bytes_f32": gather_elems * 4, "out_checksum": float(mx.abs(out).sum())}))
