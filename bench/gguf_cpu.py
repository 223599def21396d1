"""A random Q4_K_M FLUX.2 klein-4B GGUF transformer on this CPU: mlxdiff with quantized matmul, mlxdiff with
per-layer dequantization, and diffusers' GGUF path, each in its own process, one after the other.

    python bench/gguf_cpu.py [--gguf weights/bench-klein-4b-Q4_K_M-random.gguf] [--size 512] [--text 512]
                             [--only qmm,dequantize,diffusers] [--json bench/gguf_cpu.json]

The file (written on the first run, 2.50 GB, git-ignored under weights/) has klein-4B's real transformer config
(5 double + 20 single blocks, 24 heads x 128, joint 7680, mlp ratio 3) in city96's Q4_K_M mix (BF16 embedders,
modulations and final layer, F32 norms, Q5_K fused qkv, Q4_K elsewhere) with random valid blocks: only memory and
speed mean anything. One transformer forward = one step of the distilled klein (no CFG): 512x512 -> 1024 image
tokens, plus 512 text tokens.

mlxdiff runs in its CPU default, float32 compute (GGUF scales and biases then float32: 6 bits per Q4_K weight in
memory against the file's 4.5); diffusers runs `from_single_file(..., GGUFQuantizationConfig(compute_dtype=
torch.bfloat16), torch_dtype=torch.bfloat16)` (it dequantizes every GGUF layer at each forward). Per run: load
seconds, MLX peak and process peak (Linux VmHWM) for the load and for the forward, seconds for the forward.
"""

import argparse
import dataclasses
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_GGUF = ROOT / "weights" / "bench-klein-4b-Q4_K_M-random.gguf"
KLEIN_4B = dict(patch_size=1, in_channels=128, out_channels=None, num_layers=5, num_single_layers=20,
                attention_head_dim=128, num_attention_heads=24, joint_attention_dim=7680,
                timestep_guidance_channels=256, mlp_ratio=3.0, axes_dims_rope=(32, 32, 32, 32), rope_theta=2000,
                eps=1e-6, guidance_embeds=False)
GB = 1e9
RUNS = ("qmm", "dequantize", "diffusers")


# -- process memory (Linux) ------------------------------------------------------------------------------------------

def _status(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return None


def reset_process_peak():
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")    # resets VmHWM to the current RSS
    except OSError:
        pass


def process_peak():
    return _status("VmHWM")


# -- the file ----------------------------------------------------------------------------------------------------------

def write_file(path: Path):
    """klein-4B's BFL tensors in city96's Q4_K_M mix, random valid blocks (the writer of tests/test_gguf_models.py)."""
    import torch
    from diffusers import Flux2Transformer2DModel
    sys.path.insert(0, str(ROOT / "tests"))
    from gguf_helpers import write_city96_gguf
    from twins import flux2_to_bfl
    with torch.device("meta"):
        shapes = flux2_to_bfl(Flux2Transformer2DModel(**KLEIN_4B).state_dict(), KLEIN_4B)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    t = time.perf_counter()
    # float16 scales of N(0, 1e-4): weights of magnitude up to ~0.1, so the 25 blocks stay finite
    types = write_city96_gguf(partial, shapes, "flux2", "flux", random=True, block_scale=1e-4)
    partial.rename(path)
    counts = {}
    for qtype in types.values():
        counts[qtype.name] = counts.get(qtype.name, 0) + 1
    print(f"wrote {path} ({path.stat().st_size / GB:.2f} GB, {counts}) in {time.perf_counter() - t:.0f} s",
          flush=True)


def inputs(size, text_len, seed=0):
    """Latents packed as the pipeline does (1, (size/16)^2, 128), text (1, L, 7680), ids as diffusers builds them."""
    rng = np.random.default_rng(seed)
    h = w = size // 16
    img = rng.standard_normal((1, h * w, KLEIN_4B["in_channels"])).astype(np.float32)
    txt = rng.standard_normal((1, text_len, KLEIN_4B["joint_attention_dim"])).astype(np.float32)
    hh, ww = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
    img_ids = np.stack([np.zeros(h * w), hh.ravel(), ww.ravel(), np.zeros(h * w)], -1)[None].astype(np.int64)
    txt_ids = np.zeros((1, text_len, 4), np.int64)
    txt_ids[..., 3] = np.arange(text_len)
    return img, txt, img_ids, txt_ids


# -- one run per process -----------------------------------------------------------------------------------------

def run_mlxdiff(path, strategy, size, text_len):
    sys.path.insert(0, str(ROOT))
    import mlxdiff  # noqa: F401  (OpenBLAS before mlx)
    import mlx.core as mx
    from mlxdiff import backend
    from mlxdiff.loading import sources
    from mlxdiff.loading.matmul import strategy_of, use_strategy
    from mlxdiff.loading.quantize import materialize
    from mlxdiff.models import flux2
    from mlxdiff.pipelines.base import evaluate_each_block
    from mlxdiff.policy import from_switches, installed
    policy = from_switches()     # as a run's phases on the CPU: paced, MLXDIFF_* switches applied
    dtype = backend.compute_dtype()
    out = {"run": f"mlxdiff {strategy}", "backend": f"mlx {mx.__version__} {mx.default_device()}, "
           f"{str(dtype).split('.')[-1]} compute, OpenBLAS {'on' if backend.openblas_path else 'off'}"}
    reset_process_peak()
    mx.reset_peak_memory()
    t = time.perf_counter()
    spec = sources.transformer_from_file(path, flux2)
    if policy.gguf_layout:
        spec = dataclasses.replace(spec, gguf_layout=policy.gguf_layout)
    with installed(policy):
        model = spec.build()     # in the policy's compute dtype: the device's default, as `dtype`
        materialize(model)
    out["load_s"] = time.perf_counter() - t
    out["load_mlx_peak"], out["load_process_peak"] = mx.get_peak_memory(), process_peak()
    out["resident"] = mx.get_active_memory()
    use_strategy(model, strategy)
    out["layers"] = strategy_of(model)
    img, txt, img_ids, txt_ids = inputs(size, text_len)
    reset_process_peak()
    mx.reset_peak_memory()
    t = time.perf_counter()
    with installed(policy):
        y = model(mx.array(img), mx.array(txt), mx.array([1.0]), img_ids, txt_ids, after_block=evaluate_each_block)
        mx.eval(y)
    out["forward_s"] = time.perf_counter() - t
    out["forward_mlx_peak"], out["forward_process_peak"] = mx.get_peak_memory(), process_peak()
    out["finite"] = bool(mx.isfinite(y).all())
    out["output_rms"] = float(mx.sqrt(mx.mean(y.astype(mx.float32) ** 2)))
    return out


def run_diffusers(path, size, text_len):
    import torch
    from diffusers import Flux2Transformer2DModel, GGUFQuantizationConfig
    import tempfile
    config_dir = Path(tempfile.mkdtemp())
    (config_dir / "config.json").write_text(json.dumps(dict(KLEIN_4B, _class_name="Flux2Transformer2DModel")))
    out = {"run": "diffusers GGUF", "backend": f"torch {torch.__version__} cpu, bf16 compute, "
           f"{torch.get_num_threads()} threads"}
    reset_process_peak()
    t = time.perf_counter()
    model = Flux2Transformer2DModel.from_single_file(
        str(path), config=str(config_dir), local_files_only=True, torch_dtype=torch.bfloat16,
        quantization_config=GGUFQuantizationConfig(compute_dtype=torch.bfloat16)).eval()
    out["load_s"] = time.perf_counter() - t
    out["load_process_peak"] = process_peak()
    out["layers"] = {"GGUFLinear": sum(type(m).__name__ == "GGUFLinear" for m in model.modules())}
    img, txt, img_ids, txt_ids = (torch.from_numpy(a) for a in inputs(size, text_len))
    reset_process_peak()
    t = time.perf_counter()
    with torch.no_grad():
        y = model(hidden_states=img.to(torch.bfloat16), encoder_hidden_states=txt.to(torch.bfloat16),
                  timestep=torch.tensor([1.0], dtype=torch.bfloat16), img_ids=img_ids, txt_ids=txt_ids,
                  return_dict=False)[0]
    out["forward_s"] = time.perf_counter() - t
    out["forward_process_peak"] = process_peak()
    out["finite"] = bool(torch.isfinite(y).all())
    out["output_rms"] = float(y.float().pow(2).mean().sqrt())
    return out


# -- driver ------------------------------------------------------------------------------------------------------------

def machine():
    cpu = "?"
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2 ** 30
    return f"{os.cpu_count()}-vCPU {cpu}, {mem:.1f} GiB, {platform.system()} {platform.machine()}"


def fmt(n, scale=GB, digits=2):
    return "-" if n is None else f"{n / scale:.{digits}f}"


def table(results, path, size, text_len):
    file_gb = sum(t.nbytes for t in __import__("mlxdiff.formats.gguf", fromlist=["x"]).check_gguf(path).tensors) / GB
    lines = [f"Machine: {machine()}. File: {path.name}, {file_gb:.2f} GB of tensors (random klein-4B, Q4_K_M mix). "
             f"One forward: {size}x{size} ({(size // 16) ** 2} image tokens) + {text_len} text tokens.", "",
             "| run | backend | load s | load peak GB (MLX / process) | resident GB (MLX) | forward s | "
             "forward peak GB (MLX / process) | finite |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['run']} | - | failed: {r['error'][:80]} | | | | | |")
            continue
        lines.append(f"| {r['run']} | {r['backend']} | {r['load_s']:.1f} | {fmt(r.get('load_mlx_peak'))} / "
                     f"{fmt(r.get('load_process_peak'))} | {fmt(r.get('resident'))} | {r['forward_s']:.1f} | "
                     f"{fmt(r.get('forward_mlx_peak'))} / {fmt(r.get('forward_process_peak'))} | {r['finite']} |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf", type=Path, default=DEFAULT_GGUF)
    parser.add_argument("--size", type=int, default=512)
    parser.add_argument("--text", type=int, default=512)
    parser.add_argument("--only", default=",".join(RUNS))
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--blocks", default=None, help="double,single block counts instead of klein-4B's 5,20 "
                        "(a quick check of this script; use another --gguf)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.blocks:
        KLEIN_4B["num_layers"], KLEIN_4B["num_single_layers"] = (int(n) for n in args.blocks.split(","))
    if args.child:   # one measurement in this process
        result = (run_diffusers(args.gguf, args.size, args.text) if args.child == "diffusers"
                  else run_mlxdiff(args.gguf, args.child, args.size, args.text))
        print("RESULT " + json.dumps(result), flush=True)
        return
    sys.path.insert(0, str(ROOT))
    if not args.gguf.exists():
        write_file(args.gguf)
    results = []
    for run in args.only.split(","):
        t = time.perf_counter()
        proc = subprocess.run([sys.executable, __file__, "--gguf", str(args.gguf), "--size", str(args.size),
                               "--text", str(args.text), "--child", run]
                              + (["--blocks", args.blocks] if args.blocks else []), capture_output=True, text=True)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        result = json.loads(lines[-1][7:]) if lines else {"run": run, "error": proc.stderr.strip()[-300:]}
        print(f"{run}: {time.perf_counter() - t:.0f} s wall: {json.dumps(result)}", flush=True)
        results.append(result)
    if args.json:
        args.json.write_text(json.dumps({"machine": machine(), "size": args.size, "text": args.text,
                                         "results": results}, indent=1))
    print(table(results, args.gguf, args.size, args.text))


if __name__ == "__main__":
    main()
