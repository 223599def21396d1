"""T5-XXL (SD3.5's text_encoder_3) in bf16 streamed under a memory limit on this CPU (issue "Below the weights":
T5-XXL under 2 GiB), beside the resident run: the same hidden states, and what the process held.

    python bench/t5_streaming_cpu.py write DIR                   # random weights, google/t5-v1_1-xxl's config,
                                                                 # transformers' layout, bf16, 5 shards (9.5 GB)
    python -m mlxdiff.footprint run --interval 0.05 --json r.json -- python bench/t5_streaming_cpu.py run DIR OUT.npy
    python -m mlxdiff.footprint run --interval 0.05 --json s.json -- \
        python bench/t5_streaming_cpu.py run DIR OUT2.npy --memory-limit 2
    python bench/t5_streaming_cpu.py compare OUT.npy OUT2.npy

`run` loads the encoder as a pipeline loads it (loading/component.load_component under the run policy of the
limit; float32 compute, the CPU default), encodes 256 tokens (SD3.5's max_sequence_length) and prints the plan and
the bytes read. Random weights: only memory, time and exactness mean anything. Used for bench/RESULTS.md,
"Streaming below the weights".
"""

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

XXL = dict(vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
           relative_attention_num_buckets=32, relative_attention_max_distance=128, feed_forward_proj="gated-gelu",
           dense_act_fn="gelu_new", is_gated_act=True, layer_norm_epsilon=1e-6, model_type="t5",
           architectures=["T5EncoderModel"], torch_dtype="bfloat16")
SHARDS = 5


def tensors(cfg):
    """(name, shape) of T5EncoderModel's state dict, in order."""
    d, f, inner = cfg["d_model"], cfg["d_ff"], cfg["num_heads"] * cfg["d_kv"]
    yield "shared.weight", (cfg["vocab_size"], d)
    for i in range(cfg["num_layers"]):
        p = f"encoder.block.{i}.layer."
        for name in "qkv":
            yield p + f"0.SelfAttention.{name}.weight", (inner, d)
        yield p + "0.SelfAttention.o.weight", (d, inner)
        if i == 0:
            yield p + "0.SelfAttention.relative_attention_bias.weight", (cfg["relative_attention_num_buckets"],
                                                                        cfg["num_heads"])
        yield p + "0.layer_norm.weight", (d,)
        yield p + "1.DenseReluDense.wi_0.weight", (f, d)
        yield p + "1.DenseReluDense.wi_1.weight", (f, d)
        yield p + "1.DenseReluDense.wo.weight", (d, f)
        yield p + "1.layer_norm.weight", (d,)
    yield "encoder.final_layer_norm.weight", (d,)


def write(folder):
    import torch
    from safetensors.torch import save_file
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(XXL, indent=1))
    names = list(tensors(XXL))
    per = -(-len(names) // SHARDS)
    index, gen = {}, torch.Generator().manual_seed(0)
    for k in range(SHARDS):
        file = f"model-{k + 1:05d}-of-{SHARDS:05d}.safetensors"
        shard = {}
        for name, shape in names[k * per:(k + 1) * per]:
            scale = 1.0 if len(shape) == 1 else shape[1] ** -0.5     # unit-variance outputs: finite through 24 blocks
            shard[name] = (torch.randn(shape, generator=gen) * scale).to(torch.bfloat16)
            index[name] = file
        save_file(shard, str(folder / file), metadata={"format": "pt"})
        del shard
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))


def run(folder, out, memory_limit):
    import mlxdiff  # noqa: F401  (first: OpenBLAS takes over mlx-cpu's matmuls, mlxdiff/backend.py)
    import mlx.core as mx
    from mlxdiff.loading.component import load_component
    from mlxdiff.loading.sources import folder_component
    from mlxdiff.memory import GB
    from mlxdiff.policy import RunPolicy, installed
    folder = Path(folder)
    spec = folder_component(folder.parent, folder.name, "T5EncoderModel")
    policy = RunPolicy(memory_limit=None if memory_limit is None else int(memory_limit * GB))
    start = time.perf_counter()
    with installed(policy):
        loaded = load_component(spec, policy)
        loaded_s = time.perf_counter() - start
        ids = mx.array(np.random.default_rng(0).integers(0, XXL["vocab_size"], (1, 256)))
        start = time.perf_counter()
        hidden = loaded.model(ids)
        mx.eval(hidden)
        encode_s = time.perf_counter() - start
    np.save(out, np.array(hidden))
    stream = getattr(loaded.model, "block_stream", None)
    print("RESULT" + json.dumps({
        "memory_limit_gb": memory_limit, "load_s": loaded_s, "encode_s": encode_s, "notes": loaded.notes,
        "resident_weights_gb": loaded.nbytes / GB, "mlx_peak_gb": mx.get_peak_memory() / GB,
        "bytes_read_gb": None if stream is None else stream.bytes_read / GB,
        "stream": None if stream is None else stream.summary("text_encoder_3")}))


def compare(a, b):
    x, y = np.load(a), np.load(b)
    print("RESULT" + json.dumps({"equal": bool(np.array_equal(x, y)), "max_abs_diff": float(np.abs(x - y).max()),
                                 "finite": bool(np.isfinite(x).all())}))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("what", choices=("write", "run", "compare"))
    p.add_argument("paths", nargs="+")
    p.add_argument("--memory-limit", type=float, default=None, metavar="GB")
    args = p.parse_args()
    if args.what == "write":
        write(args.paths[0])
    elif args.what == "run":
        run(args.paths[0], args.paths[1], args.memory_limit)
    else:
        compare(*args.paths)


if __name__ == "__main__":
    main()
