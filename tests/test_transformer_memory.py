"""A mid-size FLUX.2 transformer forward stays within its weights plus an activation allowance derived from shapes,
and the fused (compiled) elementwise pieces give the same numbers as the plain MLX ops.

The allowance: CPU attention holds its scores and their softmax (2 x heads x S^2 float32) and a block holds about
two of its largest projection outputs (2 x S x widest row count, float32). Before pacing (mlxdiff/pacing.py) a block
was evaluated as one graph and this forward (then two blocks of each kind) peaked at 343 MiB above its weights
against an allowance of 260 MiB; now 176-181 MiB (this CPU, mlx 0.32.4), and 156 MiB with one block of each kind.
"""

import numpy as np

import mlx.core as mx
import mlx.nn as nn

from mlxdiff.models import flux2
from mlxdiff.pipelines.base import evaluate_each_block
from mlxdiff.policy import RunPolicy, installed

from helpers import in_fresh_process, mlx_peak_above_live

N_IMG, N_TXT = 1024, 256
# one block of each kind: the allowance is one block's work (its attention scores and projections), and blocks are
# evaluated one at a time (after_block)
ARGS = dict(num_layers=1, num_single_layers=1, attention_head_dim=64, num_attention_heads=16,
            joint_attention_dim=512, axes_dims_rope=(16, 16, 16, 16), in_channels=64)


def _inputs(n_img, n_txt, in_channels, joint):
    mx.random.seed(1)
    img, txt = mx.random.normal((1, n_img, in_channels)), mx.random.normal((1, n_txt, joint))
    side = int(np.sqrt(n_img))
    img_ids = np.zeros((1, n_img, 4), np.int32)
    img_ids[0, :, 1], img_ids[0, :, 2] = np.arange(n_img) // side, np.arange(n_img) % side
    txt_ids = np.zeros((1, n_txt, 4), np.int32)
    txt_ids[0, :, 3] = np.arange(n_txt)
    mx.eval(img, txt)
    return img, txt, img_ids, txt_ids


@in_fresh_process
def test_mid_size_forward_peak_is_weights_plus_activations():
    args = flux2.ModelArgs(**ARGS)
    model = flux2.Model(args)
    mx.eval(model.parameters())
    img, txt, img_ids, txt_ids = _inputs(N_IMG, N_TXT, args.in_channels, args.joint_attention_dim)
    s, heads = N_IMG + N_TXT, args.num_attention_heads
    dim = heads * args.attention_head_dim
    widest = 2 * int(dim * args.mlp_ratio)                 # the single block's SwiGLU input rows
    allowance = 2 * heads * s * s * 4 + 2 * s * widest * 4
    with mlx_peak_above_live() as measured, installed(RunPolicy()):   # as the denoise phase runs it on the CPU
        y = model(img, txt, mx.array([0.5]), img_ids, txt_ids, guidance=mx.array([4.0]),
                  after_block=evaluate_each_block)
        mx.eval(y)
    peak = measured.bytes
    print(f"\nmid-size FLUX.2 forward: {peak / 2**20:.0f} MiB above the weights, allowance {allowance / 2**20:.0f} MiB")
    assert peak <= allowance, (peak, allowance)


def test_fused_and_plain_pieces_agree():
    args = flux2.ModelArgs(num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=3,
                           joint_attention_dim=40, axes_dims_rope=(4, 4, 4, 4), in_channels=12)
    mx.random.seed(0)
    model = flux2.Model(args)
    model.update(nn.utils.tree_map(lambda a: a * 4, model.parameters()))     # larger than init, so pieces matter
    img, txt, img_ids, txt_ids = _inputs(36, 7, args.in_channels, args.joint_attention_dim)
    outs = {}
    for fuse in (True, False):
        with installed(RunPolicy(fuse=fuse)):
            outs[fuse] = np.array(model(img, txt, mx.array([0.3]), img_ids, txt_ids, guidance=mx.array([3.0])))
    err = np.abs(outs[True] - outs[False]).max() / np.abs(outs[False]).max()
    assert err <= 1e-6, err


def test_swiglu_in_two_ranges_equals_one_matmul(monkeypatch):
    """At the memory floor (one piece in flight) the SwiGLU runs in two ranges of the hidden axis
    (flux2.swiglu_rows); with room to spare as one matmul. Both give the same forward."""
    from mlxdiff import pacing
    args = flux2.ModelArgs(num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=3,
                           joint_attention_dim=40, axes_dims_rope=(4, 4, 4, 4), in_channels=12, mlp_ratio=3.0)
    mx.random.seed(2)
    model = flux2.Model(args)
    model.update(nn.utils.tree_map(lambda a: a * 4, model.parameters()))
    img, txt, img_ids, txt_ids = _inputs(36, 7, args.in_channels, args.joint_attention_dim)
    outs, pieces = {}, {}
    real = flux2.swiglu_rows
    for depth in (1, 2):
        def counted(*a, depth=depth):
            out = real(*a)
            pieces.setdefault(depth, []).append(len(out))
            return out
        monkeypatch.setattr(flux2, "swiglu_rows", counted)
        with installed(RunPolicy(in_flight=depth)):
            outs[depth] = np.array(model(img, txt, mx.array([0.3]), img_ids, txt_ids, guidance=mx.array([3.0])))
            pacing.settle()
    assert set(pieces[1]) == {2} and set(pieces[2]) == {1} and len(pieces[1]) == 3   # 2 feed-forwards + 1 single
    err = np.abs(outs[1] - outs[2]).max() / np.abs(outs[2]).max()
    assert err <= 1e-6, err


def test_cpu_attention_in_query_chunks_keeps_one_chunk_of_scores(monkeypatch):
    """models/fused.attention on the CPU: the queries in chunks whose B x H x rows x S float32 scores stay under
    CPU_SCORE_BYTES, one chunk alive at a time, with the same numbers as one SDPA call (each row's softmax is its
    own). Whole, the scores of this size are 128 MiB; in 8 MiB chunks the peak stays far below that."""
    from mlxdiff.models import fused
    rng = np.random.default_rng(0)
    q, k, v = (mx.array(rng.standard_normal((1, 8, 2048, 32)).astype(np.float32)) for _ in range(3))
    mx.eval(q, k, v)

    def peak_of(fn):
        mx.synchronize()
        mx.clear_cache()
        mx.reset_peak_memory()
        base = mx.get_active_memory()
        out = fn()
        mx.eval(out)
        return out, mx.get_peak_memory() - base

    whole, whole_peak = peak_of(lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=32 ** -0.5))
    monkeypatch.setattr(fused, "CPU_SCORE_BYTES", 8 << 20)
    with installed(RunPolicy()):    # as a pipeline phase runs it on the CPU: each chunk paced
        chunked, chunked_peak = peak_of(lambda: fused.attention(q, k, v, 32 ** -0.5))
    print(f"attention peak: whole {whole_peak / 2**20:.0f} MiB, chunked {chunked_peak / 2**20:.0f} MiB")
    assert whole_peak >= 128 << 20                     # the matrix is really held whole by one call
    assert chunked_peak <= 3 * (8 << 20) + 2 * whole.nbytes
    assert np.abs(np.array(chunked) - np.array(whole)).max() <= 1e-6 * np.abs(np.array(whole)).max()
