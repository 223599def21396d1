"""VAE decode at the real configs (SD3.5's AutoencoderKL, FLUX.2's AutoencoderKLFlux2; random weights), mlxdiff beside
diffusers on the same saved folder, each in its own process: seconds and peak memory above the loaded weights.

    python bench/vae_decode.py [--sizes 512 1024] [--vaes sd3 flux2] [--dtype float32|bfloat16]

mlxdiff decodes as its pipelines do (pipelines/base.decode_array under the policy a decode phase decides,
memory.decide: staged evaluation, exact row bands for the CPU's convolutions, no tiles unless the budget requires
them). Memory: on the CPU the process's peak RSS above its RSS once the weights are loaded (VmHWM after
clear_refs), and MLX's own peak above its weights; on CUDA the allocators' peaks (torch.cuda.max_memory_allocated,
mx.get_peak_memory) above the weights. Prints one RESULT json per run.
"""

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GB = 1024 ** 3

CHILD = r"""
import json, sys, time
import numpy as np
side, folder, kind, size, dtype_name = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
GB = 1024 ** 3

def rss():
    vals = {}
    for line in open("/proc/self/status"):
        if line.startswith(("VmRSS:", "VmHWM:")):
            k, v = line.split(":", 1)
            vals[k] = int(v.split()[0]) * 1024
    return vals

def reset_hwm():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")

channels = 32 if kind == "flux2" else 16
z = np.random.default_rng(0).standard_normal((1, channels, size // 8, size // 8)).astype(np.float32)
out = {"side": side, "vae": kind, "size": size, "dtype": dtype_name}
if side == "mlxdiff":
    import mlxdiff
    import mlx.core as mx
    from mlxdiff.loading import sources
    from mlxdiff.memory import decide
    from mlxdiff.pipelines.base import decode_array
    from mlxdiff.pacing import settle
    from mlxdiff.policy import from_switches, installed
    from mlxdiff.models import vae as vae_mod, vae_flux2
    arch = vae_flux2 if kind == "flux2" else vae_mod
    spec = sources.ComponentSpec("vae", arch, json.loads(open(folder + "/config.json").read()),
                                 sources.st.safetensors_files(folder))
    dtype = getattr(mx, dtype_name)
    with installed(from_switches(dtype=dtype_name)):
        model = spec.build()
    mx.eval(model.parameters())
    policy = decide(from_switches(dtype=dtype_name), model)   # the decode phase's policy, with these weights loaded
    zz = mx.array(z).astype(dtype)
    for run in range(2):   # the first run compiles kernels (CUDA) and fused norms
        mx.synchronize(); mx.clear_cache()
        base = mx.get_active_memory(); rss0 = rss()["VmRSS"]; reset_hwm(); mx.reset_peak_memory()
        t = time.perf_counter()
        with installed(policy):
            img = decode_array(model, zz)
            mx.eval(img); settle(); mx.synchronize()
        out["seconds"] = time.perf_counter() - t
        out["mlx_peak_above_weights_gb"] = (mx.get_peak_memory() - base) / GB
        out["rss_peak_above_gb"] = (rss()["VmHWM"] - rss0) / GB
        del img
    out["device"] = str(mx.default_device())
    out["weights_gb"] = base / GB
else:
    import torch
    from diffusers import AutoencoderKL, AutoencoderKLFlux2
    cls = AutoencoderKLFlux2 if kind == "flux2" else AutoencoderKL
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, dtype_name)
    torch.set_num_threads(torch.get_num_threads())
    model = cls.from_pretrained(folder, torch_dtype=dtype).to(dev).eval()
    zz = torch.from_numpy(z).to(dev, dtype)
    for run in range(2):
        if dev == "cuda":
            torch.cuda.synchronize(); torch.cuda.empty_cache(); torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        rss0 = rss()["VmRSS"]; reset_hwm()
        t = time.perf_counter()
        with torch.no_grad():
            img = model.decode(zz, return_dict=False)[0]
        if dev == "cuda":
            torch.cuda.synchronize()
            out["gpu_peak_above_weights_gb"] = (torch.cuda.max_memory_allocated() - base) / GB
        out["seconds"] = time.perf_counter() - t
        out["rss_peak_above_gb"] = (rss()["VmHWM"] - rss0) / GB
        del img
    out["device"] = f"torch {torch.__version__} {dev}"
print("RESULT" + json.dumps(out), flush=True)
"""


def save_folder(kind, root):
    """The real config with seeded random weights, saved by diffusers (float32)."""
    import torch
    from diffusers import AutoencoderKL, AutoencoderKLFlux2
    sys.path.insert(0, str(ROOT))
    import mlxdiff  # noqa: F401
    from mlxdiff.models import vae, vae_flux2
    torch.manual_seed(0)
    if kind == "flux2":
        model = AutoencoderKLFlux2(**{k: v for k, v in vae_flux2.FLUX2_CONFIG.items() if k not in ("sample_size",)})
    else:
        model = AutoencoderKL(**{k: v for k, v in vae.SD3_CONFIG.items() if k != "sample_size"})
    folder = Path(root) / kind
    model.save_pretrained(str(folder))
    return folder


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", type=int, nargs="+", default=[512, 1024])
    p.add_argument("--vaes", nargs="+", default=["sd3", "flux2"])
    p.add_argument("--dtype", default="float32")
    p.add_argument("--sides", nargs="+", default=["mlxdiff", "diffusers"])
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as root:
        for kind in args.vaes:
            folder = save_folder(kind, root)
            for size in args.sizes:
                for side in args.sides:
                    r = subprocess.run([sys.executable, "-c", CHILD, side, str(folder), kind, str(size), args.dtype],
                                       capture_output=True, text=True, cwd=ROOT)
                    lines = [l for l in r.stdout.splitlines() if l.startswith("RESULT")]
                    print(lines[-1] if lines else f"FAILED {side} {kind} {size}: {r.stderr[-800:]}", flush=True)


if __name__ == "__main__":
    main()
