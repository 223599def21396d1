"""One transformer forward at a real config, mlxdiff beside diffusers, random bf16 weights built in memory (no file).

    python bench/forward_gpu.py mlxdiff [--model klein-4b|flux1-dev] [--size 1024]   # MLXDIFF_IN_FLIGHT / ... apply
    python bench/forward_gpu.py diffusers [--model klein-4b|flux1-dev]
    python bench/forward_gpu.py mlxdiff|diffusers --model zimage-turbo|qwen-image [--text-tokens 128]
    python bench/forward_gpu.py mlxdiff|diffusers --model zimage-tiny|qwen-image-tiny --size 64 --device cpu

flux1-dev: FLUX.1-dev's FluxTransformer2DModel (12B; guidance 3.5, pooled CLIP, 512 T5 tokens), one forward being
one denoising step of FluxPipeline (no CFG). zimage-turbo: Tongyi-MAI/Z-Image-Turbo's ZImageTransformer2DModel
(6.15 B; bench/make_random_models.py says where each value comes from), one forward = one step of ZImagePipeline at
guidance 0 (Turbo's way: no CFG), --text-tokens caption tokens (default 128: the pipeline keeps only a prompt's
valid tokens, and a long prompt in Qwen3's chat template is about that; max_sequence_length is 512). qwen-image:
Qwen/Qwen-Image's QwenImageTransformer2DModel (20.4 B), one timed call = one step of QwenImagePipeline with true
CFG: two forwards, the prompt's --text-tokens and a negative prompt's NEGATIVE_TOKENS (8: a few words after the
template's 34 dropped tokens); both sides run CFG as two separate forwards, as their pipelines do. Both models'
sides alternate under one outside ruler in bench/qwen_zimage_gpu.sh. The -tiny configs (small dims) check the chain
on the CPU: `--device cpu` puts diffusers' side there too (no memory figures then). With --phase-file F the side
writes "forward <unix time>" to F when its timed forwards start and "done <unix time>" when they end, for an
outside sampler (bench/flux1_dev_gpu.sh).

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
    # diffusers 0.42.1 ZImageTransformer2DModel defaults, axes_lens as Tongyi-MAI/Z-Image-Turbo transformer/config.json
    "zimage-turbo": dict(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=3840, n_layers=30,
                         n_refiner_layers=2, n_heads=30, n_kv_heads=30, norm_eps=1e-5, qk_norm=True, cap_feat_dim=2560,
                         rope_theta=256.0, t_scale=1000.0, axes_dims=(32, 48, 48), axes_lens=(1536, 512, 512)),
    "zimage-tiny": dict(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=192, n_layers=4,
                        n_refiner_layers=1, n_heads=2, n_kv_heads=2, cap_feat_dim=256, axes_dims=(32, 32, 32),
                        axes_lens=(512, 64, 64)),
    # Qwen/Qwen-Image transformer/config.json (= diffusers' class defaults)
    "qwen-image": dict(patch_size=2, in_channels=64, out_channels=16, num_layers=60, attention_head_dim=128,
                       num_attention_heads=24, joint_attention_dim=3584, guidance_embeds=False,
                       axes_dims_rope=(16, 56, 56)),
    "qwen-image-tiny": dict(patch_size=2, in_channels=64, out_channels=16, num_layers=8, attention_head_dim=32,
                            num_attention_heads=3, joint_attention_dim=256, guidance_embeds=False,
                            axes_dims_rope=(6, 12, 14)),
}
FLUX1 = ("flux1-dev",)
ZIMAGE = ("zimage-turbo", "zimage-tiny")
QWEN = ("qwen-image", "qwen-image-tiny")
TEXT_TOKENS = 128
NEGATIVE_TOKENS = 8
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


def zimage_inputs(size, cfg, text_len):
    """ZImagePipeline's: latents (1, 16, H/8, W/8), the caption's valid Qwen3 states (text_len, cap_feat_dim), t."""
    rng = np.random.default_rng(0)
    lat = rng.standard_normal((1, cfg["in_channels"], size // 8, size // 8)).astype(np.float32)
    cap = (rng.standard_normal((1, text_len, cfg["cap_feat_dim"])) * 0.5).astype(np.float32)
    return lat, cap


def qwen_inputs(size, cfg, text_lens):
    """QwenImagePipeline's: packed latents (1, (H/16)(W/16), 64), one Qwen2.5-VL state per prompt (positive and
    negative), img_shapes (1, H/16, W/16)."""
    rng = np.random.default_rng(0)
    h = w = size // 16
    img = rng.standard_normal((1, h * w, cfg["in_channels"])).astype(np.float32)
    txts = [(rng.standard_normal((1, n, cfg["joint_attention_dim"])) * 0.5).astype(np.float32) for n in text_lens]
    return img, txts, (1, h, w)


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


def run_mlxdiff(name, cfg, size, text_tokens, device):
    import mlxdiff  # noqa: F401
    import mlx.core as mx
    import mlx.nn as nn
    from mlxdiff.models import flux2
    from mlxdiff.pipelines.base import evaluate_each_block
    from mlxdiff.pacing import settle
    from mlxdiff.policy import from_switches, installed
    from mlxdiff.models import flux1, qwenimage, zimage
    policy = from_switches()
    arch = (flux1 if name in FLUX1 else zimage if name in ZIMAGE else qwenimage if name in QWEN else flux2)
    model = arch.Model(arch.ModelArgs(**cfg))
    model.compute_dtype = mx.bfloat16
    # bf16, evaluated a layer at a time: MLX's initialisation is lazy, so no float32 copy of the whole model exists
    for _, child in sorted(nn.utils.tree_flatten(model.children(), is_leaf=lambda m: isinstance(m, nn.Module))):
        child.update(nn.utils.tree_map(lambda a: (a * 0.02).astype(mx.bfloat16) if a.ndim > 1 else
                                       a.astype(mx.bfloat16), child.parameters()))
        mx.eval(child.parameters())
    model.update(nn.utils.tree_map(lambda a: a if a.dtype == mx.bfloat16 else a.astype(mx.bfloat16),
                                   model.parameters()))   # the model's own arrays (Z-Image's pad tokens)
    mx.eval(model.parameters())
    if arch is zimage:
        lat, cap = (mx.array(a).astype(mx.bfloat16) for a in zimage_inputs(size, cfg, text_tokens))
        t = mx.array([0.5], dtype=mx.float32)
        call = lambda: model(lat, t, cap, after_block=evaluate_each_block)
        img = txt = lat
    elif arch is qwenimage:
        img, txts, shape = qwen_inputs(size, cfg, (text_tokens, NEGATIVE_TOKENS))
        txts = [mx.array(a).astype(mx.bfloat16) for a in txts]
        t = mx.array([0.5]).astype(mx.bfloat16)
        img = mx.array(img).astype(mx.bfloat16)
        call = lambda: [model(img, c, t, [shape], after_block=evaluate_each_block) for c in txts]   # CFG: 2 calls
        txt = txts[0]
    elif arch is flux1:
        img, txt, pooled, img_ids, txt_ids = flux1_inputs(size, cfg)
        pooled = mx.array(pooled).astype(mx.bfloat16)
        call = lambda: model(img, txt, pooled, mx.array([0.5]), img_ids, txt_ids, guidance=mx.array([3.5]),
                             after_block=evaluate_each_block)
    else:
        img, txt, img_ids, txt_ids = inputs(size, cfg)
        call = lambda: model(img, txt, mx.array([0.5]), img_ids, txt_ids, after_block=evaluate_each_block)
    if arch in (flux1, flux2):
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


def run_diffusers(name, cfg, size, text_tokens, device):
    import torch
    from diffusers import (FluxTransformer2DModel, Flux2Transformer2DModel, QwenImageTransformer2DModel,
                           ZImageTransformer2DModel)
    flux1 = name in FLUX1
    cls = (FluxTransformer2DModel if flux1 else ZImageTransformer2DModel if name in ZIMAGE else
           QwenImageTransformer2DModel if name in QWEN else Flux2Transformer2DModel)
    cuda = device == "cuda"
    with torch.device(device):     # built on the device in bfloat16 (no float32 copy of 12B weights first)
        torch.set_default_dtype(torch.bfloat16)
        model = cls(**cfg).eval()
        torch.set_default_dtype(torch.float32)
    if cuda:
        torch.cuda.empty_cache()
    dev = lambda a: torch.from_numpy(a).to(device)
    if name in ZIMAGE:      # ZImagePipeline: lists of (C, 1, H, W) latents and (L, D) captions
        lat, cap = (dev(a).bfloat16() for a in zimage_inputs(size, cfg, text_tokens))
        t = torch.tensor([0.5], device=device)
        call = lambda: model([lat[0].unsqueeze(1)], t, [cap[0]], return_dict=False)
    elif name in QWEN:      # QwenImagePipeline with true CFG: the prompt's forward, then the negative's
        img, txts, shape = qwen_inputs(size, cfg, (text_tokens, NEGATIVE_TOKENS))
        img, txts = dev(img).bfloat16(), [dev(a).bfloat16() for a in txts]
        t = torch.tensor([0.5], device=device).bfloat16()
        call = lambda: [model(hidden_states=img, timestep=t, encoder_hidden_states=c, encoder_hidden_states_mask=None,
                              img_shapes=[[shape]], return_dict=False) for c in txts]
    else:
        if flux1:
            img, txt, pooled, img_ids, txt_ids = (dev(a) for a in flux1_inputs(size, cfg))
            extra = dict(pooled_projections=pooled.bfloat16(), guidance=torch.tensor([3.5], device=device),
                         img_ids=img_ids, txt_ids=txt_ids)
        else:
            img, txt, img_ids, txt_ids = (dev(a) for a in inputs(size, cfg))
            extra = dict(img_ids=img_ids[0], txt_ids=txt_ids[0], guidance=None)
        img, txt = img.bfloat16(), txt.bfloat16()
        call = lambda: model(hidden_states=img, encoder_hidden_states=txt, timestep=torch.tensor([0.5], device=device),
                             return_dict=False, **extra)
    weights = torch.cuda.memory_allocated() if cuda else 0

    @torch.no_grad()
    def forward():
        call()

    forward()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    seconds = timed(forward, torch.cuda.synchronize if cuda else lambda: None)
    if not cuda:
        return {"side": "diffusers", "backend": f"torch {torch.__version__} cpu", "seconds": seconds}
    return {"side": "diffusers", "backend": f"torch {torch.__version__} cuda", "seconds": seconds,
            "peak_above_weights_gb": (torch.cuda.max_memory_allocated() - weights) / GB, "weights_gb": weights / GB}


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("side", choices=("mlxdiff", "diffusers"))
    p.add_argument("--model", default="klein-4b", choices=tuple(CONFIGS))
    p.add_argument("--size", type=int, default=1024)
    p.add_argument("--phase-file", default=None)
    p.add_argument("--text-tokens", type=int, default=TEXT_TOKENS, help="zimage / qwen-image: the prompt's tokens")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                   help="diffusers' side; mlxdiff's takes MLX's default device (MLX_DEVICE / the build)")
    a = p.parse_args()
    PHASE_FILE = a.phase_file
    run = run_mlxdiff if a.side == "mlxdiff" else run_diffusers
    extra = {"text_tokens": a.text_tokens} if a.model in ZIMAGE + QWEN else {}
    extra.update({"negative_tokens": NEGATIVE_TOKENS, "forwards_per_call": 2} if a.model in QWEN else {})
    print("RESULT" + json.dumps({"model": a.model, "size": a.size, **extra,
                                 **run(a.model, CONFIGS[a.model], a.size, a.text_tokens, a.device)}), flush=True)
