"""A random FLUX.1-dev transformer GGUF in city96's layout (Black Forest Labs' original names), from shapes only.

    python bench/flux1_dev_gguf.py write PATH --type Q4_K_S|Q8_0 [--tiny]

Every BFL tensor name and shape is derived from the config (FLUX.1-dev: 19 double, 38 single blocks, 24 heads of
128, joint 4096, pooled 768, guidance embedder, in_channels 64; --tiny: bench/make_random_models.py flux1-tiny's
config), so no 12 B float weights are ever in memory. Type mix (city96's convert.py + lcpp.patch): 1-D tensors and
tensors of at most 1024 elements F32; img_in, txt_in, time_in, vector_in, guidance_in, final_layer kept in F16
(city96 converts the bf16 checkpoint to an F16 GGUF first); every other 2-D weight Q8_0 (--type Q8_0) or Q4_K
(--type Q4_K_S; F16 where the in-dim is not a multiple of 256; llama.cpp's per-layer Q5_K bumps are not applied,
so it is city96's file within a few %). Quantized tensors hold random valid blocks with small finite f16 scales.
Only memory and speed mean anything.
"""

import argparse
import json
import time
from pathlib import Path

import numpy as np

REAL = dict(num_layers=19, num_single_layers=38, heads=24, head_dim=128, joint=4096, pooled=768, in_channels=64)
TINY = dict(num_layers=1, num_single_layers=1, heads=2, head_dim=128, joint=64, pooled=32, in_channels=64)
KEEP = ("img_in.", "txt_in.", "time_in.", "vector_in.", "guidance_in.", "final_layer.")
F16_FIELDS = {"Q8_0": (0,), "Q4_K": (0, 2)}   # byte offsets of each block's f16 scales (Q8_0: d; Q4_K: d, dmin)


def bfl_shapes(c) -> dict:
    D = c["heads"] * c["head_dim"]
    M = 4 * D
    s = {}
    def linear(name, o, i):
        s[name + ".weight"], s[name + ".bias"] = (o, i), (o,)
    linear("img_in", D, c["in_channels"])
    linear("txt_in", D, c["joint"])
    for emb, i in (("time_in", 256), ("vector_in", c["pooled"]), ("guidance_in", 256)):
        linear(emb + ".in_layer", D, i)
        linear(emb + ".out_layer", D, D)
    for i in range(c["num_layers"]):
        o = f"double_blocks.{i}."
        for side in ("img", "txt"):
            linear(o + f"{side}_mod.lin", 6 * D, D)
            linear(o + f"{side}_attn.qkv", 3 * D, D)
            s[o + f"{side}_attn.norm.query_norm.scale"] = (c["head_dim"],)
            s[o + f"{side}_attn.norm.key_norm.scale"] = (c["head_dim"],)
            linear(o + f"{side}_attn.proj", D, D)
            linear(o + f"{side}_mlp.0", M, D)
            linear(o + f"{side}_mlp.2", D, M)
    for i in range(c["num_single_layers"]):
        o = f"single_blocks.{i}."
        linear(o + "modulation.lin", 3 * D, D)
        linear(o + "linear1", 3 * D + M, D)
        linear(o + "linear2", D, D + M)
        s[o + "norm.query_norm.scale"] = (c["head_dim"],)
        s[o + "norm.key_norm.scale"] = (c["head_dim"],)
    linear("final_layer.linear", c["in_channels"], D)
    linear("final_layer.adaLN_modulation.1", 2 * D, D)
    return s


def qtype_of(name, shape, kind):
    from gguf import GGMLQuantizationType as T
    if len(shape) == 1 or int(np.prod(shape)) <= 1024:
        return T.F32
    if len(shape) != 2 or name.startswith(KEEP):
        return T.F16
    if kind == "Q8_0":
        return T.Q8_0 if shape[1] % 32 == 0 else T.F16
    return T.Q4_K if shape[1] % 256 == 0 else T.F16


def write(path, kind, tiny=False, seed=0):
    from gguf import GGMLQuantizationType as T, GGML_QUANT_SIZES, GGUFWriter
    rng = np.random.default_rng(seed)
    w = GGUFWriter(str(path), "flux")
    t0 = time.time()
    counts = {}
    for name, shape in bfl_shapes(TINY if tiny else REAL).items():
        qt = qtype_of(name, shape, kind)
        counts[qt.name] = counts.get(qt.name, 0) + 1
        if qt == T.F32:
            scale = name.endswith(".scale")
            w.add_tensor(name, ((1.0 if scale else 0.0) + 0.02 * rng.standard_normal(shape)).astype(np.float32))
        elif qt == T.F16:
            w.add_tensor(name, (0.02 * rng.standard_normal(shape, dtype=np.float32)).astype(np.float16))
        else:
            block, nbytes = GGML_QUANT_SIZES[qt]
            rows, cols = shape
            raw = rng.integers(0, 256, size=(rows, cols // block, nbytes), dtype=np.uint8)
            for off in F16_FIELDS[qt.name]:
                raw[..., off:off + 2] = (np.abs(rng.standard_normal((rows, cols // block), dtype=np.float32)) * 2e-4
                                         + 1e-5).astype(np.float16).view(np.uint8).reshape(rows, cols // block, 2)
            w.add_tensor(name, raw.reshape(rows, -1), raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print("RESULT" + json.dumps({"wrote": str(path), "type": kind, "tiny": tiny, "bytes": Path(path).stat().st_size,
                                 "seconds": time.time() - t0, "tensor_types": counts}), flush=True)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    wp = sub.add_parser("write")
    wp.add_argument("path")
    wp.add_argument("--type", choices=("Q4_K_S", "Q8_0"), required=True)
    wp.add_argument("--tiny", action="store_true")
    wp.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    write(a.path, a.type, a.tiny, a.seed)
