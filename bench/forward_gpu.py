"""One transformer forward at a real config, mlxdiff beside diffusers, random bf16 weights built in memory (no file).

    python bench/forward_gpu.py mlxdiff [--model klein-4b|flux1-dev] [--size 1024]   # MLXDIFF_IN_FLIGHT / ... apply
    python bench/forward_gpu.py diffusers [--model klein-4b|flux1-dev]
    python bench/forward_gpu.py mlxdiff|diffusers --model zimage-turbo|qwen-image [--text-tokens 128]
    python bench/forward_gpu.py mlxdiff|diffusers --model krea2|flux3-klein [--text-tokens N]
    python bench/forward_gpu.py mlxdiff|diffusers --model zimage-tiny|qwen-image-tiny --size 64 --device cpu
    python bench/forward_gpu.py mlxdiff|diffusers --model krea2-tiny|flux3-klein-tiny --size 64 --device cpu

flux1-dev: FLUX.1-dev's FluxTransformer2DModel (12B; guidance 3.5, pooled CLIP, 512 T5 tokens), one forward being
one denoising step of FluxPipeline (no CFG). zimage-turbo: Tongyi-MAI/Z-Image-Turbo's ZImageTransformer2DModel
(6.15 B; bench/make_random_models.py says where each value comes from), one forward = one step of ZImagePipeline at
guidance 0 (Turbo's way: no CFG), --text-tokens caption tokens (default 128: the pipeline keeps only a prompt's
valid tokens, and a long prompt in Qwen3's chat template is about that; max_sequence_length is 512). qwen-image:
Qwen/Qwen-Image's QwenImageTransformer2DModel (20.4 B), one timed call = one step of QwenImagePipeline with true
CFG: two forwards, the prompt's --text-tokens and a negative prompt's NEGATIVE_TOKENS (8: a few words after the
template's 34 dropped tokens); both sides run CFG as two separate forwards, as their pipelines do. Both models'
sides alternate under one outside ruler in bench/qwen_zimage_gpu.sh. krea2: Krea2Transformer2DModel (12.8 B),
one timed call = one step of Krea2Pipeline at its default guidance 4.5: two forwards (the prompt's, then the
negative's, as the pipeline does; not batched), each over the fixed 512-token text window (max_sequence_length:
the pipeline pads every prompt to it) with its mask: --text-tokens valid prompt tokens (default 40: a sentence or
two of prompt) + the 5 suffix tokens, the negative "" only its 5 suffix tokens. flux3-klein: Flux3Transformer2DModel
(5.5 B) as a step-distilled flow map (Flux3DistilledModularPipeline: one forward a step, no CFG, the target
timestep passed), --text-tokens the text window (default 80: the pipeline pads the chat-templated prompt to a
multiple of 80, so a prompt under ~70 tokens gets 80; the padding is attended, no mask). bench/new_families_gpu.sh
runs these two. The -tiny configs (small dims) check the chain on the CPU: `--device cpu` puts diffusers'
side there too (no memory figures then). With --phase-file F the side writes "forward <unix time>" to F when
its timed forwards start and "done <unix time>" when they end, for an outside sampler (bench/flux1_dev_gpu.sh).

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
    # diffusers 0.42.1 Krea2Transformer2DModel's class defaults, written out: no released Krea 2 config
    # is available offline (mlxdiff.models.krea2.ModelArgs has the same defaults)
    "krea2": dict(in_channels=64, num_layers=28, attention_head_dim=128, num_attention_heads=48, num_key_value_heads=12,
                  intermediate_size=16384, timestep_embed_dim=256, text_hidden_dim=2560, num_text_layers=12,
                  text_num_attention_heads=20, text_num_key_value_heads=20, text_intermediate_size=6912,
                  num_layerwise_text_blocks=2, num_refiner_text_blocks=2, axes_dims_rope=(32, 48, 48),
                  rope_theta=1000.0, norm_eps=1e-5),
    "krea2-tiny": dict(in_channels=64, num_layers=2, attention_head_dim=32, num_attention_heads=3,
                       num_key_value_heads=1, intermediate_size=136, timestep_embed_dim=44, text_hidden_dim=36,
                       num_text_layers=3, text_num_attention_heads=3, text_num_key_value_heads=1,
                       text_intermediate_size=52, num_layerwise_text_blocks=1, num_refiner_text_blocks=1,
                       axes_dims_rope=(8, 12, 12)),
    # diffusers 0.42.1 Flux3Transformer2DModel's class defaults (FLUX 3 Klein), but flow_map=True: the step-distilled
    # checkpoint Flux3DistilledModularPipeline runs (a target timestep embedder)
    "flux3-klein": dict(in_channels=128, cond_in_channels=128, num_layers=5, num_single_layers=28,
                        attention_head_dim=128, num_attention_heads=24, joint_attention_dim=20480,
                        timestep_channels=256, mlp_ratio=3.0, axes_dims_rope=(32, 32, 32, 32), rope_theta=10000,
                        eps=1e-6, flow_map=True),
    "flux3-klein-tiny": dict(in_channels=32, cond_in_channels=24, num_layers=1, num_single_layers=2,
                             attention_head_dim=32, num_attention_heads=3, joint_attention_dim=80, timestep_channels=36,
                             mlp_ratio=2.5, axes_dims_rope=(8, 8, 8, 8), flow_map=True),
}
FLUX1 = ("flux1-dev",)
ZIMAGE = ("zimage-turbo", "zimage-tiny")
QWEN = ("qwen-image", "qwen-image-tiny")
KREA2 = ("krea2", "krea2-tiny")
FLUX3 = ("flux3-klein", "flux3-klein-tiny")
TEXT_TOKENS = {**dict.fromkeys(ZIMAGE + QWEN, 128), **dict.fromkeys(KREA2, 40), **dict.fromkeys(FLUX3, 80)}
KREA2_WINDOW = 512          # Krea2Pipeline's max_sequence_length: every prompt is padded to it
KREA2_SUFFIX = 5            # the assistant suffix, valid, after the padding
KREA2_GUIDANCE = 4.5
FLUX3_TIMESTEPS = (0.5, 0.4375)     # this step's t / 1000 and the one it jumps to (the flow map's target)
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


def krea2_inputs(size, cfg, prompt_tokens):
    """Krea2Pipeline's: packed latents (1, (H/16)(W/16), 64), per prompt (positive, then the negative "") the
    tapped states (1, 512, num_text_layers, text_hidden_dim) and the mask [prompt | PAD | suffix] (the 34 prefix
    tokens dropped), position ids (512 + image tokens, 3): text at the origin, image (0, row, col)."""
    rng = np.random.default_rng(0)
    h = w = size // 16
    img = rng.standard_normal((1, h * w, cfg["in_channels"])).astype(np.float32)
    txts, masks = [], []
    for valid in (prompt_tokens, 0):
        txts.append((rng.standard_normal((1, KREA2_WINDOW, cfg["num_text_layers"], cfg["text_hidden_dim"])) * 0.5)
                    .astype(np.float32))
        mask = np.zeros((1, KREA2_WINDOW), bool)
        mask[:, :valid] = mask[:, -KREA2_SUFFIX:] = True
        masks.append(mask)
    rows, cols = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
    image_ids = np.stack([np.zeros(h * w), rows.ravel(), cols.ravel()], -1)
    ids = np.concatenate([np.zeros((KREA2_WINDOW, 3)), image_ids]).astype(np.float32)
    return img, txts, masks, ids


def flux3_inputs(size, cfg, text_len):
    """Flux3DistilledModularPipeline's: latents as tokens (1, (H/16)(W/16), 128), the stacked Qwen3-VL states (1,
    text_len, 20480), image ids (0, row / 2, col / 2, 0) (image_rope_scale 0.5), text ids (0, 0, 0, l)."""
    rng = np.random.default_rng(0)
    h = w = size // 16
    img = rng.standard_normal((1, h * w, cfg["in_channels"])).astype(np.float32)
    txt = (rng.standard_normal((1, text_len, cfg["joint_attention_dim"])) * 0.5).astype(np.float32)
    rows, cols = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
    img_ids = np.stack([np.zeros(h * w), rows.ravel() * 0.5, cols.ravel() * 0.5, np.zeros(h * w)], -1)
    txt_ids = np.zeros((text_len, 4))
    txt_ids[:, 3] = np.arange(text_len)
    return img, txt, img_ids.astype(np.float32), txt_ids.astype(np.float32)


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


def mlxdiff_model(name, cfg):
    """The mlxdiff transformer of `name` at `cfg` with random bf16 weights -> (model, its models/ module)."""
    import mlxdiff  # noqa: F401
    import mlx.core as mx
    import mlx.nn as nn
    from mlxdiff.models import flux1, flux2, flux3, krea2, qwenimage, zimage
    arch = (flux1 if name in FLUX1 else zimage if name in ZIMAGE else qwenimage if name in QWEN else
            krea2 if name in KREA2 else flux3 if name in FLUX3 else flux2)
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
    return model, arch


def run_mlxdiff(name, cfg, size, text_tokens, device):
    import mlxdiff  # noqa: F401  (OpenBLAS preload before mlx)
    import mlx.core as mx
    from mlxdiff.models import flux1, flux2, flux3, krea2, qwenimage, zimage
    from mlxdiff.pipelines.base import evaluate_each_block
    from mlxdiff.pacing import settle
    from mlxdiff.policy import from_switches, installed
    policy = from_switches()
    model, arch = mlxdiff_model(name, cfg)
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
    elif arch is krea2:      # CFG as Krea2Pipeline: the prompt's forward, then the negative's
        img, txts, masks, ids = krea2_inputs(size, cfg, text_tokens)
        txts = [mx.array(a).astype(mx.bfloat16) for a in txts]
        masks = [mx.array(m.astype(np.int32)) for m in masks]      # the pipeline's 0 / 1 mask
        t = mx.array([0.5], dtype=mx.float32).astype(mx.bfloat16)
        img = mx.array(img).astype(mx.bfloat16)
        call = lambda: [model(img, c, t, ids, m, after_block=evaluate_each_block) for c, m in zip(txts, masks)]
        txt = txts[0]
    elif arch is flux3:
        img, txt, img_ids, txt_ids = flux3_inputs(size, cfg, text_tokens)
        img_ids, txt_ids = mx.array(img_ids), mx.array(txt_ids)
        t, target = (mx.array([v], dtype=mx.float32).astype(mx.bfloat16) for v in FLUX3_TIMESTEPS)
        img, txt = mx.array(img).astype(mx.bfloat16), mx.array(txt).astype(mx.bfloat16)
        call = lambda: model(img, txt, t, img_ids, txt_ids, target_timestep=target, after_block=evaluate_each_block)
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


def diffusers_model(name, cfg, device):
    """diffusers' transformer of `name` at `cfg`, built on `device` in bf16 (its float32 modules as from_pretrained
    keeps them)."""
    import torch
    from diffusers import (FluxTransformer2DModel, Flux2Transformer2DModel, Flux3Transformer2DModel,
                           Krea2Transformer2DModel, QwenImageTransformer2DModel, ZImageTransformer2DModel)
    cls = (FluxTransformer2DModel if name in FLUX1 else ZImageTransformer2DModel if name in ZIMAGE else
           QwenImageTransformer2DModel if name in QWEN else Krea2Transformer2DModel if name in KREA2 else
           Flux3Transformer2DModel if name in FLUX3 else Flux2Transformer2DModel)
    with torch.device(device):     # built on the device in bfloat16 (no float32 copy of 12B weights first)
        torch.set_default_dtype(torch.bfloat16)
        model = cls(**cfg).eval()
        torch.set_default_dtype(torch.float32)
    if name in KREA2 + FLUX3:      # from_pretrained(torch_dtype=bfloat16) keeps these in float32 (its split rule)
        for key, param in model.named_parameters():
            if any(m in key.split(".") for m in cls._keep_in_fp32_modules):
                param.data = param.data.float()
    if device == "cuda":
        torch.cuda.empty_cache()
    return model


def run_diffusers(name, cfg, size, text_tokens, device):
    import torch
    flux1 = name in FLUX1
    cuda = device == "cuda"
    model = diffusers_model(name, cfg, device)
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
    elif name in KREA2:     # Krea2Pipeline with CFG: the prompt's forward, then the negative's (t: latents' dtype)
        img, txts, masks, ids = krea2_inputs(size, cfg, text_tokens)
        img, ids, masks = dev(img).bfloat16(), dev(ids), [dev(m) for m in masks]
        txts = [dev(a).bfloat16() for a in txts]
        t = torch.tensor([0.5], device=device).bfloat16()
        call = lambda: [model(hidden_states=img, encoder_hidden_states=c, timestep=t, position_ids=ids,
                              encoder_attention_mask=m, return_dict=False) for c, m in zip(txts, masks)]
    elif name in FLUX3:     # Flux3DistilledLoopDenoiser: one forward, the target timestep passed
        img, txt, img_ids, txt_ids = flux3_inputs(size, cfg, text_tokens)
        img, txt, img_ids, txt_ids = dev(img).bfloat16(), dev(txt).bfloat16(), dev(img_ids), dev(txt_ids)
        t, target = (torch.tensor([v], device=device).bfloat16() for v in FLUX3_TIMESTEPS)
        call = lambda: model(hidden_states=img, encoder_hidden_states=txt, timestep=t, target_timestep=target,
                             img_ids=img_ids, txt_ids=txt_ids, return_dict=False)
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
    p.add_argument("--text-tokens", type=int, default=None,
                   help="zimage / qwen-image: the prompt's tokens (default 128); krea2: the prompt's valid tokens in "
                        "the 512 window (default 40); flux3-klein: the text window (default 80)")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                   help="diffusers' side; mlxdiff's takes MLX's default device (MLX_DEVICE / the build)")
    a = p.parse_args()
    PHASE_FILE = a.phase_file
    run = run_mlxdiff if a.side == "mlxdiff" else run_diffusers
    text_tokens = TEXT_TOKENS.get(a.model) if a.text_tokens is None else a.text_tokens
    extra = {"text_tokens": text_tokens} if a.model in ZIMAGE + QWEN + FLUX3 else {}
    extra.update({"negative_tokens": NEGATIVE_TOKENS, "forwards_per_call": 2} if a.model in QWEN else {})
    extra.update({"text_tokens": KREA2_WINDOW, "prompt_valid_tokens": text_tokens + KREA2_SUFFIX,
                  "negative_valid_tokens": KREA2_SUFFIX, "guidance": KREA2_GUIDANCE, "forwards_per_call": 2}
                 if a.model in KREA2 else {})
    extra.update({"flow_map": True, "forwards_per_call": 1} if a.model in FLUX3 else {})
    print("RESULT" + json.dumps({"model": a.model, "size": a.size, **extra,
                                 **run(a.model, CONFIGS[a.model], a.size, text_tokens, a.device)}), flush=True)
