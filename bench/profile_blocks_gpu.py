"""Where FLUX 3 Klein's transformer forward spends its time, mlxdiff beside diffusers, piece by piece (issue 41: the
16% mlxdiff's forward takes over diffusers' in bench/RESULTS.md "Krea 2 and FLUX 3 Klein transformer steps").

    python bench/profile_blocks_gpu.py mlxdiff|diffusers [--model flux3-klein] [--size 1024] [--text-tokens 80]
                                       [--repeat 5] [--device cuda]
    python bench/profile_blocks_gpu.py table LOG...      # a markdown table of the RESULT lines in the LOG files

Each side is one process as bench/forward_gpu.py's (its mlxdiff_model / diffusers_model: random bf16 weights built
in memory; its flux3_inputs: one flow-map forward over 80 text + 4096 image tokens, 1024x1024) and prints one RESULT
json line with
  forward_s        the plain forward, median of 5 after 2 warm-ups (forward_gpu.py's timing: the same number);
  pieces_ms        then --repeat forwards with a synchronising timer around each piece, the median of each piece's
                   total per forward, per region: txt (the 5 text per-mode blocks, 80 tokens), image (the 5 image
                   per-mode blocks, 4096), single (the 28 joint blocks, 4176), and in each: block (the whole block),
                   attn (the attention module), qk_norm_rope (q and k RMS-normed and rotated), sdpa (the attention
                   kernel), ff (the feed-forward); `table` shows them exclusive: attention projections = attn less
                   qk_norm_rope and sdpa, norm/modulate/residual = block less attn and ff;
  final_ms         the last block's end to the output (norm_out, proj_out);
  embed_ms         the rest of the instrumented forward: the time and modulation embedders, x / context embedders,
                   RoPE tables, and whatever runs between blocks.
Timers. mlxdiff (lazy): a piece's inputs are evaluated and the stream synchronised before its clock starts, its
outputs evaluated and synchronised before it stops (class-level wrappers of flux3.TransformerBlock / Attention,
flux2.FeedForward and flux3's norm_rope / attention functions), under the policy forward_gpu.py runs with block
compilation off (a timer cannot evaluate inside a compiled block; eager is the CUDA default). diffusers:
torch.cuda.synchronize in forward pre / post hooks of the blocks, attn, ff, norm_q / norm_k and around
transformer_flux3's apply_rotary_emb / dispatch_attention_fn. The synchronisations cost time and remove the overlap
between pieces: an instrumented forward is slower than forward_s; compare a piece between the sides.
bench/round4_gpu.sh (ONLY=f3prof) runs the sides alternating. CPU chain check at tiny size (no GPU):
    python bench/profile_blocks_gpu.py mlxdiff --model flux3-klein-tiny --size 64 --device cpu > /tmp/p_m.txt
    python bench/profile_blocks_gpu.py diffusers --model flux3-klein-tiny --size 64 --device cpu > /tmp/p_d.txt
    python bench/profile_blocks_gpu.py table /tmp/p_m.txt /tmp/p_d.txt
"""

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import forward_gpu  # noqa: E402  (bench/: the models and inputs of the transformer steps)

PIECES = ("block", "attn", "qk_norm_rope", "sdpa", "ff")
REGIONS = ("txt", "image", "single")


class Clock:
    """Each piece's seconds in the forward being timed, by (region, piece); the region from a piece's token count."""

    def __init__(self, n_txt, n_img):
        self.by_tokens = {n_txt: "txt", n_img: "image"}
        self.reset()

    def reset(self):
        self.seconds, self.blocks, self.last_block_end = defaultdict(float), defaultdict(int), None

    def add(self, tokens, piece, seconds, single=False):
        region = "single" if single else self.by_tokens.get(tokens, "single")
        self.seconds[region, piece] += seconds
        if piece == "block":
            self.blocks[region] += 1
            self.last_block_end = time.perf_counter()


def summary(forwards, plain, backend, side):
    """The RESULT row: each piece's median over the timed forwards (ms)."""
    median = lambda key: 1000 * statistics.median(f[key] for f in forwards)
    pieces = {r: {p: median((r, p)) for p in PIECES if (r, p) in forwards[0]} for r in REGIONS}
    return {"side": side, "backend": backend, "forward_s": plain, "instrumented_ms": median("total"),
            "pieces_ms": pieces, "final_ms": median("final"),
            "embed_ms": median("total") - median("final") - sum(p.get("block", 0) for p in pieces.values()),
            "blocks": forwards[0]["blocks"]}


def timed_forwards(forward, clock, repeat):
    """`forward()` -> (seconds to its output, the clock's pieces), --repeat times, the clock reset before each."""
    forwards = []
    for _ in range(repeat):
        clock.reset()
        seconds = forward()
        end = clock.last_block_end
        row = dict(clock.seconds)
        row.update(total=seconds, final=seconds - (end - clock.start), blocks=dict(clock.blocks))
        forwards.append(row)
    return forwards


def mlxdiff_side(a, cfg):
    import mlxdiff  # noqa: F401  (OpenBLAS preload before mlx)
    import mlx.core as mx
    from mlxdiff.models import flux2, flux3
    from mlxdiff.pacing import settle
    from mlxdiff.pipelines.base import evaluate_each_block
    from mlxdiff.policy import from_switches, installed
    policy = replace(from_switches(), compile_blocks=False)
    model, _ = forward_gpu.mlxdiff_model(a.model, cfg)
    img, txt, img_ids, txt_ids = forward_gpu.flux3_inputs(a.size, cfg, a.text_tokens)
    img_ids, txt_ids = mx.array(img_ids), mx.array(txt_ids)
    t, target = (mx.array([v], dtype=mx.float32).astype(mx.bfloat16) for v in forward_gpu.FLUX3_TIMESTEPS)
    img, txt = mx.array(img).astype(mx.bfloat16), mx.array(txt).astype(mx.bfloat16)
    mx.eval(img, txt, img_ids, txt_ids, t, target)
    clock = Clock(txt.shape[1], img.shape[1])

    def forward():
        start = time.perf_counter()
        clock.start = start
        with installed(policy):
            y = model(img, txt, t, img_ids, txt_ids, target_timestep=target, after_block=evaluate_each_block)
            mx.eval(y)
            settle()
        mx.synchronize()
        return time.perf_counter() - start

    plain = forward_gpu.timed(forward, mx.synchronize)

    def arrays(tree):
        if isinstance(tree, mx.array):
            return [tree]
        if isinstance(tree, (tuple, list)):
            return [x for item in tree for x in arrays(item)]
        return []

    def settled(*trees):
        mx.eval(arrays(trees))
        mx.synchronize()

    def timer(fn, piece, tokens, single=lambda args: False):
        """fn wrapped: its array arguments settled, the clock, its result settled; tokens(args): the token count."""
        def wrapped(*args, **kw):
            settled(args, list(kw.values()))
            start = time.perf_counter()
            out = fn(*args, **kw)
            settled(out)
            clock.add(tokens(args), piece, time.perf_counter() - start, single(args))
            return out
        return wrapped
    # TransformerBlock(x, mod, cos, sin, context, ...): a joint block has the context; x (B, S, D)
    flux3.TransformerBlock.__call__ = timer(flux3.TransformerBlock.__call__, "block", lambda args: args[1].shape[1],
                                            lambda args: len(args) > 5 and args[5] is not None)
    flux3.Attention.__call__ = timer(flux3.Attention.__call__, "attn", lambda args: args[1].shape[1])
    flux2.FeedForward.__call__ = timer(flux2.FeedForward.__call__, "ff", lambda args: args[1].shape[1])
    # norm_rope([(x (B, S, H, hd), norm)], cos, sin, rope); attention(q (B, H, S, hd), k, v)
    flux3.norm_rope = timer(flux3.norm_rope, "qk_norm_rope", lambda args: args[0][0][0].shape[1])
    flux3.attention = timer(flux3.attention, "sdpa", lambda args: args[0].shape[2])
    forwards = timed_forwards(forward, clock, a.repeat)
    row = summary(forwards, plain, f"mlx {mx.__version__} {mx.default_device()}", "mlxdiff")
    row.update(in_flight=str(policy.in_flight), fuse=str(int(policy.fuse)), compile_blocks="0",
               cuda_kernels=str(int(policy.cuda_kernels)))
    return row


def diffusers_side(a, cfg):
    import torch
    from diffusers.models.transformers import transformer_flux3 as tf3
    cuda = a.device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    model = forward_gpu.diffusers_model(a.model, cfg, a.device)
    dev = lambda x: torch.from_numpy(x).to(a.device)
    img, txt, img_ids, txt_ids = forward_gpu.flux3_inputs(a.size, cfg, a.text_tokens)
    img, txt, img_ids, txt_ids = dev(img).bfloat16(), dev(txt).bfloat16(), dev(img_ids), dev(txt_ids)
    t, target = (torch.tensor([v], device=a.device).bfloat16() for v in forward_gpu.FLUX3_TIMESTEPS)
    clock = Clock(txt.shape[1], img.shape[1])

    @torch.no_grad()
    def forward():
        sync()
        start = time.perf_counter()
        clock.start = start
        model(hidden_states=img, encoder_hidden_states=txt, timestep=t, target_timestep=target, img_ids=img_ids,
              txt_ids=txt_ids, return_dict=False)
        sync()
        return time.perf_counter() - start

    plain = forward_gpu.timed(forward, sync)
    starts = {}

    def hook(module, piece, tokens, single=False):
        def pre(mod, args, kwargs):
            sync()
            starts[id(mod)] = time.perf_counter()

        def post(mod, args, kwargs, out):
            sync()
            clock.add(tokens(args, kwargs), piece, time.perf_counter() - starts.pop(id(mod)), single)
        module.register_forward_pre_hook(pre, with_kwargs=True)
        module.register_forward_hook(post, with_kwargs=True)

    first = lambda args, kwargs: (args[0] if args else kwargs["hidden_states"]).shape[1]   # (B, S, ...)
    for block in (*model.txt_mode_blocks, *model.mode_blocks["image"], *model.mode_blocks["image_cond"]):
        hook(block, "block", first)
    for block in model.single_transformer_blocks:
        hook(block, "block", first, single=True)
    for block in (*model.txt_mode_blocks, *model.mode_blocks["image"], *model.mode_blocks["image_cond"],
                  *model.single_transformer_blocks):
        hook(block.attn, "attn", first)
        hook(block.ff, "ff", first)
        hook(block.attn.norm_q, "qk_norm_rope", first)     # (B, S, H, hd)
        hook(block.attn.norm_k, "qk_norm_rope", first)

    def timer(fn, piece):
        def wrapped(x, *args, **kw):
            sync()
            start = time.perf_counter()
            out = fn(x, *args, **kw)
            sync()
            clock.add(x.shape[1], piece, time.perf_counter() - start)     # (B, S, H, hd)
            return out
        return wrapped
    tf3.apply_rotary_emb = timer(tf3.apply_rotary_emb, "qk_norm_rope")
    tf3.dispatch_attention_fn = timer(tf3.dispatch_attention_fn, "sdpa")
    forwards = timed_forwards(forward, clock, a.repeat)
    return summary(forwards, plain, f"torch {torch.__version__} {a.device}", "diffusers")


ROWS = [("block", "whole block"), ("attn_proj", "attention: q/k/v/out projections and the rest"),
        ("qk_norm_rope", "attention: q/k RMSNorm + RoPE"), ("sdpa", "attention: SDPA kernel"),
        ("ff", "feed-forward (SwiGLU MLP)"), ("rest", "norm / modulate / gated residual")]


def exclusive(pieces):
    """A region's pieces with the nested ones taken out (module docstring)."""
    out = dict(pieces)
    if "attn" in pieces:
        out["attn_proj"] = pieces["attn"] - pieces.get("qk_norm_rope", 0) - pieces.get("sdpa", 0)
    if "block" in pieces:
        out["rest"] = pieces["block"] - pieces.get("attn", 0) - pieces.get("ff", 0)
    return out


def table(a):
    rows = [json.loads(line[6:]) for f in a.logs for line in Path(f).read_text().splitlines()
            if line.startswith("RESULT")]
    sides = {}
    for r in rows:
        sides.setdefault(r["side"], []).append(r)
    names = [s for s in ("mlxdiff", "diffusers") if s in sides]
    mean = lambda side, get: statistics.mean(get(r) for r in sides[side])
    runs = ", ".join(f"{s} x{len(sides[s])} ({sides[s][0]['backend']})" for s in names)
    print(f"runs: {runs}; ms per forward, the mean over runs of each run's median")
    print("\n| piece | " + " | ".join(f"{s} ms" for s in names) + " | mlxdiff less diffusers, ms |")
    print("|---|" + "---:|" * (len(names) + 1))

    def line(label, get):
        values = [mean(s, get) for s in names]
        diff = f"{values[0] - values[1]:+.2f}" if len(values) == 2 else "-"
        print(f"| {label} | " + " | ".join(f"{v:.2f}" for v in values) + f" | {diff} |")
    line("plain forward (no timers)", lambda r: 1000 * r["forward_s"])
    line("instrumented forward", lambda r: r["instrumented_ms"])
    line("embedders, RoPE, between blocks", lambda r: r["embed_ms"])
    for region in REGIONS:
        count = sides[names[0]][0]["blocks"].get(region, 0)
        for key, label in ROWS:
            if key == "block" or any(key in exclusive(r["pieces_ms"][region]) for r in sides[names[0]]):
                line(f"{region} ({count} blocks): {label}",
                     lambda r, region=region, key=key: exclusive(r["pieces_ms"][region]).get(key, 0.0))
    line("final layer (norm_out, proj_out)", lambda r: r["final_ms"])


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("side", choices=("mlxdiff", "diffusers", "table"))
    p.add_argument("logs", nargs="*", help="table: files with the sides' RESULT lines")
    p.add_argument("--model", default="flux3-klein", choices=forward_gpu.FLUX3)
    p.add_argument("--size", type=int, default=1024)
    p.add_argument("--text-tokens", type=int, default=forward_gpu.TEXT_TOKENS["flux3-klein"])
    p.add_argument("--repeat", type=int, default=5, help="instrumented forwards (after the plain ones)")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                   help="diffusers' side; mlxdiff's takes MLX's default device")
    a = p.parse_args()
    if a.side == "table":
        table(a)
    else:
        cfg = forward_gpu.CONFIGS[a.model]
        row = (mlxdiff_side if a.side == "mlxdiff" else diffusers_side)(a, cfg)
        print("RESULT" + json.dumps({"model": a.model, "size": a.size, "text_tokens": a.text_tokens, **row}),
              flush=True)
