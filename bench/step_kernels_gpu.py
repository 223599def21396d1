"""Issue 29's per-step kernels on the lent GPU, and where each transformer step's time goes.

    python bench/step_kernels_gpu.py exact                       # each kernel against the MLX ops; exit 1 on a miss
    python bench/step_kernels_gpu.py ops                         # ms per call, kernel and MLX ops, real shapes
    python bench/step_kernels_gpu.py forward MODEL [--old]       # one transformer forward (median of 5 after 2)
    python bench/step_kernels_gpu.py floor MODEL                 # its matmuls and attentions alone, summed
    python bench/step_kernels_gpu.py diffusers MODEL             # the torch forward, same shapes
    python bench/step_kernels_gpu.py rest                        # klein-4B's other ops, one by one

MODEL: klein-4b, sd3.5-medium (CFG: batch 2) or dev-q4 (FLUX.2-dev with every quantizable layer affine 4-bit g32
and the double blocks' q/k/v 5-bit g32, the forms Q4_K and Q5_K repack into on CUDA, built in memory: no 20 GB
GGUF to write; the dequantize strategy mlxdiff uses on CUDA). 1024x1024, random weights, bf16; the policy a GPU
phase with room to spare decides (2 pieces in flight; whole blocks compiled where memory.compile_blocks_for says).
`--old` runs the new kernels' call sites through the MLX ops (the code before them; the FLUX.2 norm+RoPE kernel of
an earlier round stays on). Each line printed is `RESULT{json}`. Numbers go to bench/RESULTS.md ("Speed, second
round"). Import mlxdiff before mlx (OpenBLAS on the CPU).
"""

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import mlxdiff  # noqa: F401,E402  (before mlx)
import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402

from mlxdiff.formats import quantized as Q  # noqa: E402
from mlxdiff.models import fused  # noqa: E402
from mlxdiff.policy import RunPolicy, installed  # noqa: E402

SIZE = 1024
TXT_FLUX, TXT_SD3 = 512, 333          # FLUX.2's text tokens; SD3.5's CLIP 77 + T5 256


def result(**kw):
    print("RESULT" + json.dumps(kw), flush=True)


def batched(fn, calls=20, rounds=5):
    """ms per call with `calls` calls queued in one evaluation (as a forward queues its layers): median of rounds."""
    for _ in range(2):
        mx.eval([fn() for _ in range(calls)])
    mx.synchronize()
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        mx.eval([fn() for _ in range(calls)])
        mx.synchronize()
        times.append((time.perf_counter() - t) / calls * 1e3)
    return round(statistics.median(times), 4)


def kernels(on: bool):
    return installed(replace(RunPolicy(), cuda_kernels=on))


def rand(shape, dtype=mx.bfloat16, scale=1.0, seed=0):
    return (mx.random.normal(shape, key=mx.random.key(seed)) * scale).astype(dtype)


# -- exact ----------------------------------------------------------------------------------------------------------

def exact() -> int:
    misses = 0
    # 1. affine dequantize: bit for bit, every bit width, dtype and group size, whole layers and row slices
    for bits in sorted(Q.AFFINE_UNITS):
        for dtype in (mx.bfloat16, mx.float16, mx.float32):
            for group in (32, 64, 128):
                w = rand((96, 512), mx.float32, 0.05, seed=bits * group)
                qw, s, b = mx.quantize(w.astype(dtype), group_size=group, bits=bits)
                for r0, r1 in ((0, 96), (16, 80)):
                    got = {}
                    for on in (True, False):
                        with kernels(on):
                            got[on] = Q.affine_dequantize(qw[r0:r1], s[r0:r1], b[r0:r1], group, bits)
                            mx.eval(got[on])
                    same = got[True].dtype == got[False].dtype and bool(mx.array_equal(got[True], got[False]))
                    misses += not same
                    if not same:
                        print("MISS affine", bits, dtype, group, (r0, r1), flush=True)
    result(part="exact", kernel="affine_dequantize", cases=6 * 3 * 3 * 2, misses=misses)

    # 2. LayerNorm + modulation, and 3. SD3's qk norms without RoPE: a value may differ where the order of a float32
    # sum (the mean, the variance) or a contracted multiply-add moves a rounding. Measured in ulps of the magnitude of
    # the terms it is made of (|norm * (1 + scale)| + |shift|; |value| for the qk norm), which bounds what one
    # moved rounding can change; ok: at most 4 ulps.
    ULP = {mx.bfloat16: 2 ** -7, mx.float16: 2 ** -10, mx.float32: 2 ** -23}

    def compare(name, a, b, dtype, terms):
        a, b = a.astype(mx.float32), b.astype(mx.float32)
        diff = mx.abs(a - b)
        frac = float(mx.mean((diff > 0).astype(mx.float32)))
        ulps = float(mx.max(diff / (mx.maximum(terms, 1e-30) * ULP[dtype])))
        ok = ulps <= 4.0
        result(part="exact", kernel=name, dtype=str(dtype), differing_fraction=frac, max_ulps=round(ulps, 3), ok=ok)
        return not ok

    bad = 0
    for dtype in (mx.bfloat16, mx.float16, mx.float32):
        for b_, s_, d in ((2, 333, 1536), (1, 4608, 3072), (1, 700, 6144), (2, 77, 768)):
            x = rand((b_, s_, d), dtype, 3.0, seed=d) + rand((b_, 1, d), dtype, 1.0, seed=1)
            sc, sh = rand((b_, 1, d), dtype, 0.5, seed=2), rand((b_, 1, d), dtype, 0.5, seed=3)
            got = {}
            for on in (True, False):
                with kernels(on):
                    got[on] = fused.norm_modulate(x, sc, sh, 1e-6)
                    mx.eval(got[on])
            n = mx.fast.layer_norm(x, None, None, 1e-6).astype(mx.float32)
            terms = mx.abs(n * (1 + sc.astype(mx.float32))) + mx.abs(sh.astype(mx.float32))
            bad += compare(f"norm_modulate {b_}x{s_}x{d}", got[True], got[False], dtype, terms)
            if dtype != mx.float32:     # a float32 stream (float16-mixed) modulated into the 16-bit dtype
                x32 = x.astype(mx.float32) * 40
                got = {}
                for on in (True, False):
                    with kernels(on):
                        got[on] = fused.norm_modulate(x32, sc, sh, 1e-6)
                        mx.eval(got[on])
                n = mx.fast.layer_norm(x32, None, None, 1e-6)
                terms = mx.abs(n * (1 + sc.astype(mx.float32))) + mx.abs(sh.astype(mx.float32))
                bad += compare(f"norm_modulate, float32 stream {b_}x{s_}x{d}", got[True], got[False], dtype, terms)
        for heads, hd in ((24, 64), (8, 128)):
            qi, qc = rand((2, 300, heads, hd), dtype, 2.0, seed=4), rand((2, 77, heads, hd), dtype, 2.0, seed=5)
            ni, nc = nn.RMSNorm(hd, eps=1e-6), nn.RMSNorm(hd, eps=1e-6)
            ni.weight, nc.weight = rand((hd,), dtype, 1.0, seed=6), rand((hd,), dtype, 1.0, seed=7)
            for parts in ([(qi, ni), (qc, nc)], [(qi, ni)]):
                got = {}
                for on in (True, False):
                    with kernels(on):
                        got[on] = fused.norm_rope(parts, None, None, None)
                        mx.eval(got[on])
                bad += compare(f"qk norm, no RoPE, {len(parts)} part(s), {heads}x{hd}", got[True], got[False],
                               dtype, mx.abs(got[False].astype(mx.float32)))
    return int(misses > 0 or bad > 0)


# -- ops ------------------------------------------------------------------------------------------------------------

def ops():
    for name, out_dims, in_dims, bits in (("FLUX.2-dev single fused proj, Q4_K", 55296, 6144, 4),
                                          ("FLUX.2-dev double q/k/v, Q5_K", 6144, 6144, 5),
                                          ("FLUX.2-dev single out, Q4_K", 6144, 24576, 4)):
        qw, s, b = mx.quantize(rand((out_dims, in_dims), mx.bfloat16, 0.02), group_size=32, bits=bits)
        x = rand((1, 4608, in_dims), mx.bfloat16, 1.0, seed=1)
        w = mx.dequantize(qw, s, b, group_size=32, bits=bits)
        mx.eval(qw, s, b, x, w)
        row = {"matmul_bf16": batched(lambda: x @ w.T, calls=8)}
        for on in (True, False):
            with kernels(on):
                tag = "kernel" if on else "mlx"
                row[f"dequantize_{tag}"] = batched(lambda: Q.affine_dequantize(qw, s, b, 32, bits), calls=8)
                row[f"dequantize_matmul_{tag}"] = batched(lambda: x @ Q.affine_dequantize(qw, s, b, 32, bits).T, calls=8)
        gb = (qw.nbytes + s.nbytes + b.nbytes + out_dims * in_dims * 2) / 1e9
        result(part="ops", op=name, tokens=4608, moved_gb=round(gb, 3), **row,
               kernel_tb_s=round(gb / row["dequantize_kernel"], 2))

    for name, shape in (("klein-4B stream", (1, 4608, 3072)), ("SD3.5 Medium image stream, CFG", (2, 4096, 1536)),
                        ("FLUX.2-dev stream", (1, 4608, 6144))):
        x = rand(shape, mx.bfloat16, 2.0)
        sc, sh = rand((shape[0], 1, shape[2]), scale=0.5, seed=2), rand((shape[0], 1, shape[2]), scale=0.5, seed=3)
        mx.eval(x, sc, sh)
        row = {}
        for on in (True, False):
            with kernels(on):
                row["kernel" if on else "mlx"] = batched(lambda: fused.norm_modulate(x, sc, sh, 1e-6))
        result(part="ops", op=f"layer_norm + modulation, {name}", shape=shape, **row)

    qi, qc = rand((2, 4096, 24, 64), scale=2.0), rand((2, 333, 24, 64), scale=2.0, seed=5)
    ni, nc = nn.RMSNorm(64, eps=1e-6), nn.RMSNorm(64, eps=1e-6)
    ni.weight, nc.weight = rand((64,)), rand((64,), seed=7)
    mx.eval(qi, qc, ni.weight, nc.weight)
    row = {}
    for on in (True, False):
        with kernels(on):
            row["kernel" if on else "mlx"] = batched(lambda: fused.norm_rope([(qi, ni), (qc, nc)], None, None, None))
    result(part="ops", op="SD3.5 joint qk norm + transpose + join (one of q, k), CFG", **row)


# -- rest: klein-4B's ops outside the matmuls and attentions, one by one ----------------------------------------

def rest():
    """Each op of a klein-4B forward (1024x1024) that is not a matmul or an attention, at its shapes, 20 calls
    queued per evaluation, times its count per forward: where `floor`'s "rest" goes."""
    from mlxdiff.models import flux2
    D, H, HD, M, IMG, TXT = 3072, 24, 128, 9216, 4096, TXT_FLUX
    S = IMG + TXT
    norm = nn.RMSNorm(HD, eps=1e-6)
    norm.weight = mx.ones((HD,), mx.bfloat16)
    cos = mx.random.uniform(shape=(S, HD)).astype(mx.float32)
    sin = mx.random.uniform(shape=(S, HD)).astype(mx.float32)
    rows = []

    def row(name, count, fn):
        ms = batched(fn)
        rows.append({"op": name, "count": count, "ms": ms, "ms_per_forward": round(count * ms, 3)})

    for s_, count, where in ((S, 20, "single"), (IMG, 10, "double image"), (TXT, 10, "double text")):
        x = rand((1, s_, D))
        sc, sh, gate = (rand((1, 1, D), scale=0.5, seed=i) for i in range(3))
        y = rand((1, s_, D), seed=4)
        mx.eval(x, sc, sh, gate, y)
        row(f"LayerNorm + modulation (kernel), {where} stream", count, lambda: fused.norm_modulate(x, sc, sh, 1e-6))
        row(f"gated residual x + gate * y, {where} stream", count, lambda: fused.gated_residual(x, gate, y))
    qkv = rand((1, S, 3 * D))
    q_view = qkv[..., :D].reshape(1, S, H, HD)
    q_cont = mx.contiguous(q_view)
    v_view = qkv[..., 2 * D:].reshape(1, S, H, HD)
    mx.eval(qkv, q_cont)
    row("qk norm + RoPE kernel, one of q / k (contiguous input)", 50,
        lambda: fused.norm_rope([(q_cont, norm)], cos, sin, flux2.apply_rope))
    row("the single block's q / k view made contiguous for the kernel", 40, lambda: mx.contiguous(q_view))
    row("the single block's v view to attention's layout", 20, lambda: mx.contiguous(v_view.transpose(0, 2, 1, 3)))
    vi, vt = rand((1, IMG, H, HD)), rand((1, TXT, H, HD), seed=1)
    mx.eval(vi, vt)
    row("the double block's [text; image] v joined", 5,
        lambda: mx.concatenate([vt, vi], axis=1).transpose(0, 2, 1, 3))
    o = rand((1, H, S, HD))
    mx.eval(o)
    row("attention output to (S, H*hd)", 25, lambda: o.transpose(0, 2, 1, 3).reshape(1, S, -1))
    for s_, count, where in ((S, 20, "single"), (IMG, 5, "double image"), (TXT, 5, "double text")):
        g = rand((1, s_, 2 * M))
        mx.eval(g)
        row(f"SwiGLU, {where}", count, lambda: flux2.swiglu(g))
    a, m = rand((1, S, D)), rand((1, S, M), seed=1)
    mx.eval(a, m)
    row("the single block's [attention; MLP] concatenation", 20, lambda: mx.concatenate([a, m], axis=-1))
    c, xi = rand((1, TXT, D)), rand((1, IMG, D), seed=1)
    mx.eval(c, xi)
    row("[text; image] joined before the single blocks", 1, lambda: mx.concatenate([c, xi], axis=1))
    temb = rand((1, D))
    mods = {n: rand((k * D, D), scale=0.02, seed=k) for n, k in (("double img", 6), ("double txt", 6), ("single", 3))}
    mx.eval(temb, *mods.values())
    for n, w in mods.items():
        row(f"modulation linear, {n} (M=1)", 1, lambda: nn.silu(temb) @ w.T)
    total = round(sum(r["ms_per_forward"] for r in rows), 3)
    result(part="rest", model="klein-4b", rows=rows, total_ms=total)


# -- forward --------------------------------------------------------------------------------------------------------

KLEIN = dict(num_layers=5, num_single_layers=20, num_attention_heads=24, joint_attention_dim=7680,
             guidance_embeds=False)


def flux_inputs(text_len=TXT_FLUX):
    rng = np.random.default_rng(0)
    h = w = SIZE // 16
    img = rng.standard_normal((1, h * w, 128)).astype(np.float32)
    img_ids = np.stack(np.meshgrid(np.zeros(1), np.arange(h), np.arange(w), np.zeros(1), indexing="ij"), -1)
    txt_ids = np.zeros((1, text_len, 4))
    txt_ids[..., 3] = np.arange(text_len)
    return img, img_ids.reshape(1, -1, 4).astype(np.int32), txt_ids.astype(np.int32)


def randomize(model, scale=0.02):
    """Random bf16 weights (0.02 spread for matrices), evaluated a block at a time."""
    def one(a):
        return (mx.random.normal(a.shape) * scale).astype(mx.bfloat16) if a.ndim > 1 else mx.ones(a.shape,
                                                                                                    mx.bfloat16)
    model.update(nn.utils.tree_map(one, model.parameters()))


def quantize_dev(model):
    from mlxdiff.loading.matmul import use_strategy

    def predicate(path, module):
        if not isinstance(module, nn.Linear) or not model.quant_predicate(path, module):
            return False
        qkv = ".attn.to_" in path and path.split(".")[-1] in ("to_q", "to_k", "to_v") or ".add_" in path
        return {"group_size": 32, "bits": 5 if qkv and path.startswith("transformer_blocks") else 4}
    nn.quantize(model, class_predicate=predicate)
    for block in (*model.transformer_blocks, *model.single_transformer_blocks):
        mx.eval(block.parameters())
    mx.eval(model.parameters())
    model.compute_dtype = mx.bfloat16      # as loading/build sets it: the dequantized weights' dtype
    use_strategy(model, "dequantize")


def old_call_sites():
    """The code before this round's kernels: their call sites through the MLX ops."""
    from mlxdiff.loading import matmul
    from mlxdiff.models import flux2, mmdit

    def norm_modulate(x, scale, shift, eps):
        return fused.scale_shift(mx.fast.layer_norm(x, None, None, eps), scale, shift)

    def norm_heads(parts, cos, sin, rope):
        assert rope is None
        normed = [n(x) for x, n in parts]
        return (normed[0] if len(normed) == 1 else mx.concatenate(normed, axis=1)).transpose(0, 2, 1, 3)

    flux2.norm_modulate = mmdit.norm_modulate = norm_modulate
    mmdit.norm_rope = norm_heads
    matmul.affine_dequantize = lambda w, s, b, g, bits: mx.dequantize(w, s, b, group_size=g, bits=bits)


def build(name):
    from mlxdiff.models import flux2, mmdit
    if name == "sd3.5-medium":
        model = mmdit.Model(mmdit.ModelArgs())
    else:
        model = flux2.Model(flux2.ModelArgs(**(KLEIN if name == "klein-4b" else {})))
    model.compute_dtype = mx.bfloat16
    randomize(model)
    if name == "dev-q4":
        quantize_dev(model)
    mx.eval(model.parameters())
    return model


def forward(name, old):
    from mlxdiff import memory
    from mlxdiff.pacing import settle
    from mlxdiff.pipelines.base import evaluate_each_block
    if old:
        old_call_sites()
    model = build(name)
    weights = mx.get_active_memory()
    policy = RunPolicy(in_flight=2, compile_blocks=memory.compile_blocks_for(model, 2))
    if name == "sd3.5-medium":
        x = rand((2, 16, SIZE // 8, SIZE // 8))
        ctx, pooled = rand((2, TXT_SD3, 4096)), rand((2, 2048))
        t = mx.array([500.0, 500.0])

        def call():
            return model(x, ctx, pooled, t, after_block=evaluate_each_block)
    else:
        img, img_ids, txt_ids = flux_inputs()
        img = mx.array(img).astype(mx.bfloat16)
        txt = rand((1, TXT_FLUX, model.args.joint_attention_dim), scale=0.5)
        g = mx.array([4.0]) if model.args.guidance_embeds else None

        def call():
            return model(img, txt, mx.array([0.5]), img_ids, txt_ids, guidance=g, after_block=evaluate_each_block)

    def step():
        with installed(policy):
            y = call()
            mx.eval(y)
            settle()
        mx.synchronize()

    for _ in range(2):
        step()
    mx.reset_peak_memory()
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    result(part="forward", model=name, old=old, policy={"in_flight": 2, "compile_blocks": policy.compile_blocks},
           seconds=round(statistics.median(times), 5),
           all_seconds=[round(s, 5) for s in times], peak_above_weights_gb=round((mx.get_peak_memory() - weights) / 2**30, 3),
           weights_gb=round(weights / 2**30, 2), backend=f"mlx {mx.__version__} {mx.default_device()}")


# -- floor: the step's matmuls and attentions alone ---------------------------------------------------------------

def shapes(name):
    """[(count, tokens, in, out)] matmuls and [(count, batch, heads, tokens, head_dim)] attentions of one forward
    (the per-block M=1-2 modulation linears and the embedders left out: under 1% of the FLOPs)."""
    if name == "sd3.5-medium":
        d, img, ctx, b = 1536, 4096, TXT_SD3, 2
        mm = [(24 * 4, b * img, d, d), (24, b * img, d, 4 * d), (24, b * img, 4 * d, d),         # image stream
              (24 * 3 + 23, b * ctx, d, d), (23, b * ctx, d, 4 * d), (23, b * ctx, 4 * d, d),   # context stream
              (13 * 4, b * img, d, d)]                                                          # MMDiT-X attn2
        att = [(24, b, 24, img + ctx, 64), (13, b, 24, img, 64)]
        return mm, att
    d, heads, hidden, doubles, singles = ((3072, 24, 9216, 5, 20) if name == "klein-4b" else (6144, 48, 18432, 8, 48))
    img, txt, s = (SIZE // 16) ** 2, TXT_FLUX, (SIZE // 16) ** 2 + TXT_FLUX
    mm = [(doubles * 4, img, d, d), (doubles * 4, txt, d, d), (doubles, img, d, 2 * hidden),
          (doubles, txt, d, 2 * hidden), (doubles, img, hidden, d), (doubles, txt, hidden, d),
          (singles, s, d, 3 * d), (singles, s, d, 2 * hidden), (singles, s, d + hidden, d)]
    att = [(doubles + singles, 1, heads, s, 128)]
    return mm, att


def floor(name):
    mm, att = shapes(name)
    rows, total = [], 0.0
    for count, m, k, n in mm:
        x, w = rand((m, k)), rand((n, k), scale=0.02, seed=1)
        mx.eval(x, w)
        ms = batched(lambda: x @ w.T)
        tflops = 2 * m * k * n / ms / 1e9
        rows.append({"count": count, "m": m, "k": k, "n": n, "ms": ms, "tflop_s": round(tflops, 1)})
        total += count * ms
        if name == "dev-q4":      # the per-layer dequantize (kernel) on top of the bf16 matmul
            qw, s, b = mx.quantize(w, group_size=32, bits=4)
            with kernels(True):
                dq = batched(lambda: Q.affine_dequantize(qw, s, b, 32, 4), calls=8)
            rows[-1]["dequantize_ms"] = dq
            total += count * dq
    for count, b, h, s, hd in att:
        q, k, v = (rand((b, h, s, hd), seed=i) for i in range(3))
        mx.eval(q, k, v)
        ms = batched(lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=hd ** -0.5))
        rows.append({"count": count, "attention": [b, h, s, hd], "ms": ms})
        total += count * ms
    result(part="floor", model=name, seconds=round(total / 1e3, 5), rows=rows)


# -- diffusers ------------------------------------------------------------------------------------------------------

def diffusers_forward(name):
    import torch
    torch.manual_seed(0)
    if name == "sd3.5-medium":
        from diffusers import SD3Transformer2DModel
        model = SD3Transformer2DModel(sample_size=128, patch_size=2, in_channels=16, num_layers=24,
                                      attention_head_dim=64, num_attention_heads=24, joint_attention_dim=4096,
                                      caption_projection_dim=1536, pooled_projection_dim=2048, out_channels=16,
                                      pos_embed_max_size=384, dual_attention_layers=tuple(range(13)),
                                      qk_norm="rms_norm").to("cuda", torch.bfloat16).eval()
        x = torch.randn(2, 16, SIZE // 8, SIZE // 8, device="cuda", dtype=torch.bfloat16)
        ctx = torch.randn(2, TXT_SD3, 4096, device="cuda", dtype=torch.bfloat16)
        pooled = torch.randn(2, 2048, device="cuda", dtype=torch.bfloat16)
        t = torch.tensor([500.0, 500.0], device="cuda")

        def call():
            model(hidden_states=x, encoder_hidden_states=ctx, pooled_projections=pooled, timestep=t,
                  return_dict=False)
    else:
        from diffusers import Flux2Transformer2DModel
        cfg = dict(patch_size=1, in_channels=128, num_layers=5, num_single_layers=20, attention_head_dim=128,
                   num_attention_heads=24, joint_attention_dim=7680, timestep_guidance_channels=256,
                   mlp_ratio=3.0, axes_dims_rope=(32, 32, 32, 32), rope_theta=2000, eps=1e-6,
                   guidance_embeds=False)
        model = Flux2Transformer2DModel(**cfg).to("cuda", torch.bfloat16).eval()
        img, img_ids, txt_ids = (torch.from_numpy(a).cuda() for a in flux_inputs())
        img = img.bfloat16()
        txt = torch.randn(1, TXT_FLUX, 7680, device="cuda", dtype=torch.bfloat16)

        def call():
            model(hidden_states=img, encoder_hidden_states=txt, timestep=torch.tensor([0.5], device="cuda"),
                  img_ids=img_ids[0], txt_ids=txt_ids[0], guidance=None, return_dict=False)

    with torch.no_grad():
        for _ in range(2):
            call()
        torch.cuda.synchronize()
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            call()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
    result(part="diffusers", model=name, seconds=round(statistics.median(times), 5),
           all_seconds=[round(s, 5) for s in times], backend=f"torch {torch.__version__} cuda")


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("part", choices=("exact", "ops", "forward", "floor", "diffusers", "rest"))
    p.add_argument("model", nargs="?", default="klein-4b", choices=("klein-4b", "sd3.5-medium", "dev-q4"))
    p.add_argument("--old", action="store_true")
    a = p.parse_args()
    if a.part == "exact":
        sys.exit(exact())
    if a.part == "ops":
        ops()
    elif a.part == "forward":
        forward(a.model, a.old)
    elif a.part == "floor":
        floor(a.model)
    elif a.part == "rest":
        rest()
    else:
        diffusers_forward(a.model)
