"""One transformer forward at a real config, mlxdiff beside diffusers, random bf16 weights built in memory (no file).

    python bench/forward_gpu.py mlxdiff [--model klein-4b|flux1-dev] [--size 1024]   # MLXDIFF_IN_FLIGHT / ... apply
    python bench/forward_gpu.py diffusers [--model klein-4b|flux1-dev]

flux1-dev: FLUX.1-dev's FluxTransformer2DModel (12B; guidance 3.5, pooled CLIP, 512 T5 tokens), one forward being
one denoising step of FluxPipeline (no CFG). With --phase-file F the side writes "forward <unix time>" to F when its
timed forwards start and "done <unix time>" when they end, for an outside sampler (bench/flux1_dev_gpu.sh).

Prints one RESULT json line: seconds per forward (median of 5 after 2 warm-up calls, which include MLX's kernel
compilation on CUDA) and the peak above the weights. Used for bench/RESULTS.md (issue 12 rows). mlxdiff runs
under the policy a run would have before its phase decides (policy.from_switches: one piece in flight, eager
blocks, fused pieces and CUDA kernels on, unless MLXDIFF_IN_FLIGHT / _FUSE / _COMPILE_BLOCKS / _CUDA_KERNELS say
otherwise).
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
GB = 1024 ** 3
CONFIGS = {
    "klein-4b": dict(patch_size=1, in_channels=128, num_layers=5, num_single_layers=20, attention_head_dim=128,
                     num_attention_heads=24, joint_attention_dim=7680, timestep_guidance_channels=256, mlp_ratio=3.0,
                     axes_dims_rope=(32, 32, 32, 32), rope_theta=2000, eps=1e-6, guidance_embeds=False),
    # black-forest-labs/FLUX.1-dev transformer/config.json
    "flux1-dev": dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
                      num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768,
                      guidance_embeds=True, axes_dims_rope=(16, 56, 56)),
}
FLUX1 = ("flux1-dev",)
PHASE_FILE = None


def mark(what):
    if PHASE_FILE:
        with open(PHASE_FILE, "a") as f:
            f.write(f"{what} {time.time()}\n")


def flux1_inputs(size, cfg, text_len=512):
    """FluxPipeline's: packed latents, T5 states, pooled CLIP, (0, row, col) image ids and zero text ids."""
    rng = np.random.default_rng(0)
    h = w = size // 16
    img = rng.standard_normal((1, h * w, cfg["in_channels"])).astype(np.float32)
    txt = (rng.standard_normal((1, text_len, cfg["joint_attention_dim"])) * 0.5).astype(np.float32)
    pooled = rng.standard_normal((1, cfg["pooled_projection_dim"])).astype(np.float32)
    rows, cols = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
    img_ids = np.stack([np.zeros(h * w), rows.ravel(), cols.ravel()], -1).astype(np.float32)
    return img, txt, pooled, img_ids, np.zeros((text_len, 3), np.float32)


def inputs(size, cfg, text_len=512):
    rng = np.random.default_rng(0)
    h = w = size // 16
    img = rng.standard_normal((1, h * w, cfg["in_channels"])).astype(np.float32)
    txt = (rng.standard_normal((1, text_len, cfg["joint_attention_dim"])) * 0.5).astype(np.float32)
    img_ids = np.stack(np.meshgrid(np.zeros(1), np.arange(h), np.arange(w), np.zeros(1), indexing="ij"), -1)
    txt_ids = np.zeros((1, text_len, 4))
    txt_ids[..., 3] = np.arange(text_len)
    return img, txt, img_ids.reshape(1, -1, 4).astype(np.int32), txt_ids.astype(np.int32)


def timed(fn, sync):
    for _ in range(2):
        fn()
        sync()
    times = []
    mark("forward")
    for _ in range(5):
        t = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t)
    mark("done")
    return statistics.median(times)


def run_mlxdiff(cfg, size):
    import mlxdiff  # noqa: F401
    import mlx.core as mx
    import mlx.nn as nn
    from mlxdiff.models import flux2
    from mlxdiff.pipelines.base import evaluate_each_block
    from mlxdiff.pacing import settle
    from mlxdiff.policy import from_switches, installed
    from mlxdiff.models import flux1
    policy = from_switches()
    arch = flux1 if cfg is CONFIGS["flux1-dev"] else flux2
    model = arch.Model(arch.ModelArgs(**cfg))
    model.compute_dtype = mx.bfloat16
    model.update(nn.utils.tree_map(lambda a: (a * 0.02).astype(mx.bfloat16) if a.ndim > 1 else
                                   a.astype(mx.bfloat16), model.parameters()))
    mx.eval(model.parameters())
    if arch is flux1:
        img, txt, pooled, img_ids, txt_ids = flux1_inputs(size, cfg)
        pooled = mx.array(pooled).astype(mx.bfloat16)
        call = lambda: model(img, txt, pooled, mx.array([0.5]), img_ids, txt_ids, guidance=mx.array([3.5]),
                             after_block=evaluate_each_block)
    else:
        img, txt, img_ids, txt_ids = inputs(size, cfg)
        call = lambda: model(img, txt, mx.array([0.5]), img_ids, txt_ids, after_block=evaluate_each_block)
    img, txt = mx.array(img).astype(mx.bfloat16), mx.array(txt).astype(mx.bfloat16)
    mx.eval(img, txt)
    mx.clear_cache()
    weights = mx.get_active_memory()

    def forward():
        with installed(policy):
            y = call()
            mx.eval(y)
            settle()

    forward()
    mx.reset_peak_memory()
    seconds = timed(forward, mx.synchronize)
    return {"side": "mlxdiff", "backend": f"mlx {mx.__version__} {mx.default_device()}",
            "in_flight": str(policy.in_flight), "fuse": str(int(policy.fuse)),
            "compile_blocks": str(int(policy.compile_blocks)), "cuda_kernels": str(int(policy.cuda_kernels)),
            "seconds": seconds, "peak_above_weights_gb": (mx.get_peak_memory() - weights) / GB,
            "weights_gb": weights / GB}


def run_diffusers(cfg, size):
    import torch
    from diffusers import FluxTransformer2DModel, Flux2Transformer2DModel
    flux1 = cfg is CONFIGS["flux1-dev"]
    with torch.device("cuda"):     # built on the device in bfloat16 (no float32 copy of 12B weights first)
        torch.set_default_dtype(torch.bfloat16)
        model = (FluxTransformer2DModel if flux1 else Flux2Transformer2DModel)(**cfg).eval()
        torch.set_default_dtype(torch.float32)
    torch.cuda.empty_cache()
    if flux1:
        img, txt, pooled, img_ids, txt_ids = (torch.from_numpy(a).cuda() for a in flux1_inputs(size, cfg))
        extra = dict(pooled_projections=pooled.bfloat16(), guidance=torch.tensor([3.5], device="cuda"),
                     img_ids=img_ids, txt_ids=txt_ids)
    else:
        img, txt, img_ids, txt_ids = (torch.from_numpy(a).cuda() for a in inputs(size, cfg))
        extra = dict(img_ids=img_ids[0], txt_ids=txt_ids[0], guidance=None)
    img, txt = img.bfloat16(), txt.bfloat16()
    weights = torch.cuda.memory_allocated()

    @torch.no_grad()
    def forward():
        model(hidden_states=img, encoder_hidden_states=txt, timestep=torch.tensor([0.5], device="cuda"),
              return_dict=False, **extra)

    forward()
    torch.cuda.reset_peak_memory_stats()
    seconds = timed(forward, torch.cuda.synchronize)
    return {"side": "diffusers", "backend": f"torch {torch.__version__} cuda", "seconds": seconds,
            "peak_above_weights_gb": (torch.cuda.max_memory_allocated() - weights) / GB, "weights_gb": weights / GB}


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("side", choices=("mlxdiff", "diffusers"))
    p.add_argument("--model", default="klein-4b", choices=tuple(CONFIGS))
    p.add_argument("--size", type=int, default=1024)
    p.add_argument("--phase-file", default=None)
    a = p.parse_args()
    PHASE_FILE = a.phase_file
    run = run_mlxdiff if a.side == "mlxdiff" else run_diffusers
    print("RESULT" + json.dumps({"model": a.model, "size": a.size, **run(CONFIGS[a.model], a.size)}), flush=True)
