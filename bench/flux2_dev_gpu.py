"""FLUX.2-dev at its real config on a GPU: mlxdiff (MLX CUDA) beside diffusers (torch CUDA), same random
Q4_K_M GGUF transformer. Recipe for the lent H200: the device README of the shared folder; steps (each prints RESULT json):

    python bench/flux2_dev_gpu.py write-gguf /tmp/flux2-dev-Q4_K_M-random.gguf      # ~20 GB, city96's type mix
    python bench/flux2_dev_gpu.py mlxdiff  /tmp/flux2-dev-Q4_K_M-random.gguf [--strategy qmm|dequantize]
    python bench/flux2_dev_gpu.py encoder                                             # Mistral-Small taps, random
    python bench/flux2_dev_gpu.py diffusers /tmp/flux2-dev-Q4_K_M-random.gguf

The GGUF holds random valid blocks (random codes, random finite f16 scales) in city96's Q4_K_M mix: BF16 for
img_in/txt_in/time_in/guidance_in/final_layer and the three shared modulations, F32 for the QK-norm scales,
Q5_K for the fused qkv, Q4_K elsewhere. The encoder phase builds Mistral-Small-3.x's first 30 layers with random
bf16 weights in memory (no 35 GB file). Only memory and speed mean anything.
"""

import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import os
SHAPES = json.loads(Path(os.environ.get("FLUX2_SHAPES", ROOT / "bench" / "flux2_dev_bfl_shapes.json")).read_text())
BF16_PREFIXES = ("img_in.", "txt_in.", "time_in.", "guidance_in.", "final_layer.", "single_stream_modulation.",
                 "double_stream_modulation_")
GB = 1024 ** 3


def qtype_of(name, shape):
    from gguf import GGMLQuantizationType as T
    if len(shape) == 1 or np.prod(shape) <= 1024:
        return T.F32
    if name.startswith(BF16_PREFIXES):
        return T.BF16
    return T.Q5_K if "attn.qkv.weight" in name else T.Q4_K


def write_gguf(path):
    from gguf import GGMLQuantizationType as T, GGUFWriter, GGML_QUANT_SIZES
    rng = np.random.default_rng(0)
    w = GGUFWriter(str(path), "flux")
    t0 = time.time()
    for name, shape in SHAPES["bfl_shapes"].items():
        qt = qtype_of(name, shape)
        if qt == T.F32:
            w.add_tensor(name, (1 + 0.05 * rng.standard_normal(shape)).astype(np.float32))
            continue
        if qt == T.BF16:
            bf = (rng.standard_normal(shape).astype(np.float32) * 0.02).view(np.uint32) >> 16
            w.add_tensor(name, bf.astype(np.uint16).view(np.uint8).reshape(shape[0], -1), raw_dtype=T.BF16)
            continue
        block, nbytes = GGML_QUANT_SIZES[qt]
        rows, cols = shape
        raw = rng.integers(0, 256, size=(rows, cols // block, nbytes), dtype=np.uint8)
        for off in (0, 2):  # d and dmin: small finite f16
            raw[..., off:off + 2] = (np.abs(rng.standard_normal((rows, cols // block))) * 2e-4 + 1e-5) \
                .astype(np.float16).view(np.uint8).reshape(rows, cols // block, 2)
        w.add_tensor(name, raw.reshape(rows, -1), raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print("RESULT" + json.dumps({"wrote": str(path), "bytes": Path(path).stat().st_size,
                                 "seconds": time.time() - t0}))


def inputs(size, text_len=512, seed=0):
    rng = np.random.default_rng(seed)
    h = w = size // 16
    cfg = SHAPES["config"]
    img = rng.standard_normal((1, h * w, cfg["in_channels"])).astype(np.float32)
    txt = (rng.standard_normal((1, text_len, cfg["joint_attention_dim"])) * 0.5).astype(np.float32)
    img_ids = np.stack(np.meshgrid(np.zeros(1), np.arange(h), np.arange(w), np.zeros(1), indexing="ij"), -1)
    img_ids = img_ids.reshape(1, -1, 4)
    txt_ids = np.zeros((1, text_len, 4))
    txt_ids[..., 3] = np.arange(text_len)
    return img, txt, img_ids.astype(np.int32), txt_ids.astype(np.int32)


def run_mlxdiff(path, strategy="qmm", size=1024, steps=3):
    import mlxdiff  # noqa: F401
    from dataclasses import replace
    import mlx.core as mx
    from mlxdiff.loading import sources
    from mlxdiff.loading.quantize import materialize
    from mlxdiff.models import flux2
    from mlxdiff.pacing import settle
    from mlxdiff.pipelines.base import evaluate_each_block
    from mlxdiff.policy import from_switches, installed
    policy = from_switches(dtype="bfloat16")     # as a run's phases (MLXDIFF_IN_FLIGHT / _COMPILE_BLOCKS ... apply)
    out = {"backend": f"mlx {mx.__version__} {mx.default_device()}", "strategy": strategy, "size": size}
    mx.reset_peak_memory()
    t = time.perf_counter()
    spec = sources.transformer_from_file(path, flux2)
    if policy.gguf_layout:
        spec = replace(spec, gguf_layout=policy.gguf_layout)
    with installed(policy):
        model = spec.build()
        materialize(model)
    mx.synchronize()
    out["load_s"], out["load_peak_gb"] = time.perf_counter() - t, mx.get_peak_memory() / GB
    out["steady_gb"] = mx.get_active_memory() / GB
    if strategy != "qmm":
        from mlxdiff.loading.matmul import use_strategy
        use_strategy(model, strategy)
    img, txt, img_ids, txt_ids = (mx.array(a) for a in inputs(size))
    img, txt = img.astype(mx.bfloat16), txt.astype(mx.bfloat16)
    g = mx.array([4.0])
    times = []
    mx.reset_peak_memory()
    for i in range(steps):
        t = time.perf_counter()
        with installed(policy):
            y = model(img, txt, mx.array([1.0 - i / steps]), img_ids, txt_ids, guidance=g,
                      after_block=evaluate_each_block)
            mx.eval(y)
            settle()
        mx.synchronize()
        times.append(time.perf_counter() - t)
    out["step_s"] = times
    out["inference_peak_gb"] = mx.get_peak_memory() / GB
    out["finite"] = bool(mx.isfinite(y.astype(mx.float32)).all())
    print("RESULT" + json.dumps(out))


def run_encoder(text_len=512):
    import mlxdiff  # noqa: F401
    import mlx.core as mx
    from mlxdiff.models import text_llm
    from mlxdiff.loading.quantize import materialize
    config = {"model_type": "mistral3", "architectures": ["Mistral3ForConditionalGeneration"],
              "text_config": {"model_type": "mistral", "hidden_size": 5120, "intermediate_size": 32768,
                              "num_hidden_layers": 40, "num_attention_heads": 32, "num_key_value_heads": 8,
                              "head_dim": 128, "vocab_size": 131072, "rope_theta": 1e9, "rms_norm_eps": 1e-5,
                              "max_position_embeddings": 131072, "sliding_window": None},
              "vision_config": {"model_type": "pixtral"}, "taps": (10, 20, 30)}
    if os.environ.get("FLUX2_ENCODER_TINY"):  # a quick check of this code path on a small machine
        config["text_config"].update(hidden_size=256, intermediate_size=512, num_hidden_layers=6, num_attention_heads=4,
                                     num_key_value_heads=2, head_dim=64, vocab_size=1000)
        config["taps"] = (1, 3, 5)
    args = text_llm.ModelArgs.from_dict(config)
    mx.reset_peak_memory()
    t = time.perf_counter()
    model = text_llm.Model(args)
    model.compute_dtype = mx.bfloat16
    model.set_dtype(mx.bfloat16)          # random init evaluated one module at a time, in bf16
    materialize(model)
    mx.synchronize()
    out = {"build_s": time.perf_counter() - t, "weights_gb": mx.get_active_memory() / GB,
           "build_peak_gb": mx.get_peak_memory() / GB}
    ids = mx.array(np.random.default_rng(0).integers(0, args.text_config["vocab_size"] if isinstance(
        args.text_config, dict) else 1000, (1, text_len)).astype(np.int32))
    mask = mx.ones((1, text_len), dtype=mx.int32)
    mx.reset_peak_memory()
    times = []
    for _ in range(2):
        t = time.perf_counter()
        e = model(ids, mask)
        mx.eval(e)
        mx.synchronize()
        times.append(time.perf_counter() - t)
    out.update(encode_s=times, encode_peak_gb=mx.get_peak_memory() / GB, shape=list(e.shape))
    print("RESULT" + json.dumps(out))


def run_diffusers(path, size=1024, steps=3):
    import torch
    from diffusers import Flux2Transformer2DModel, GGUFQuantizationConfig
    cfg_dir = Path("/tmp/flux2-dev-config")
    cfg_dir.mkdir(exist_ok=True)
    cfg = dict(SHAPES["config"], _class_name="Flux2Transformer2DModel", out_channels=None)
    (cfg_dir / "config.json").write_text(json.dumps(cfg))
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    mem = (lambda: torch.cuda.max_memory_allocated() / GB) if dev == "cuda" else (lambda: None)
    reset = torch.cuda.reset_peak_memory_stats if dev == "cuda" else (lambda: None)
    reset()
    t = time.perf_counter()
    model = Flux2Transformer2DModel.from_single_file(
        str(path), config=str(cfg_dir), quantization_config=GGUFQuantizationConfig(compute_dtype=torch.bfloat16),
        torch_dtype=torch.bfloat16, local_files_only=True).to(dev)
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    sync()
    out = {"backend": f"torch {torch.__version__} {dev}", "size": size,
           "load_s": time.perf_counter() - t, "load_peak_gb": mem(),
           "steady_gb": torch.cuda.memory_allocated() / GB if dev == "cuda" else None}
    img, txt, img_ids, txt_ids = (torch.from_numpy(a).to(dev) for a in inputs(size))
    img, txt = img.to(torch.bfloat16), txt.to(torch.bfloat16)
    reset()
    times = []
    with torch.no_grad():
        for i in range(steps):
            t = time.perf_counter()
            y = model(hidden_states=img, encoder_hidden_states=txt,
                      timestep=torch.tensor([1.0 - i / steps], device=dev, dtype=torch.bfloat16),
                      img_ids=img_ids[0], txt_ids=txt_ids[0],
                      guidance=torch.tensor([4.0], device=dev), return_dict=False)[0]
            sync()
            times.append(time.perf_counter() - t)
    out.update(step_s=times, inference_peak_gb=mem(),
               finite=bool(torch.isfinite(y).all()))
    print("RESULT" + json.dumps(out))


if __name__ == "__main__":
    what = sys.argv[1]
    if what == "write-gguf":
        write_gguf(sys.argv[2])
    elif what == "mlxdiff":
        strategy = sys.argv[sys.argv.index("--strategy") + 1] if "--strategy" in sys.argv else "qmm"
        run_mlxdiff(sys.argv[2], strategy)
    elif what == "encoder":
        run_encoder()
    elif what == "diffusers":
        run_diffusers(sys.argv[2])
