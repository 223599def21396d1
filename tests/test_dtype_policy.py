"""No weight changes the dtype the activations are computed in (issue: GGUF and ComfyUI files keep norm scales in
float32; under bfloat16 compute `rms_norm(bf16 x, f32 weight)` returned float32, and with it q, k, the attention
and the whole residual stream ran in float32, at several times the memory)."""

import numpy as np
from mlx.utils import tree_flatten

from mlxdiff import backend  # noqa: F401  (OpenBLAS preload before mlx)
import mlx.core as mx

from mlxdiff.loading.build import build
from mlxdiff.models import flux2
from mlxdiff.policy import RunPolicy, installed

from helpers import in_fresh_process, mlx_peak_above_live

CONFIG = dict(patch_size=1, in_channels=32, num_layers=2, num_single_layers=2, attention_head_dim=64,
              num_attention_heads=4, joint_attention_dim=96, timestep_guidance_channels=64, mlp_ratio=3.0,
              axes_dims_rope=(16, 16, 16, 16), guidance_embeds=False)
SIDE, N_TXT = 24, 64
N_IMG = SIDE * SIDE


def _weights(norms_dtype):
    """A random FLUX.2 transformer's weights in bf16, with the qk-norm scales in `norms_dtype` (as GGUF stores
    1-D tensors: F32)."""
    mx.random.seed(0)
    model = flux2.Model(flux2.ModelArgs.from_dict(CONFIG))
    weights = {}
    for name, w in tree_flatten(model.parameters()):
        w = (w * 0.5 + (1.0 if "norm" in name else 0.0)).astype(mx.bfloat16)   # every value a bf16 value
        weights[name] = w.astype(norms_dtype) if "norm" in name else w
    mx.eval(weights)
    return weights


def _forward(weights):
    with installed(RunPolicy(compute_dtype=mx.bfloat16)):
        model = build(flux2, CONFIG, weights, "test")
    mx.eval(model.parameters())
    rng = np.random.default_rng(0)
    x = mx.array(rng.standard_normal((1, N_IMG, CONFIG["in_channels"])).astype(np.float32))
    ctx = mx.array(rng.standard_normal((1, N_TXT, CONFIG["joint_attention_dim"])).astype(np.float32))
    img_ids = np.stack(np.meshgrid(np.arange(1), np.arange(SIDE), np.arange(SIDE), np.arange(1), indexing="ij"),
                       -1).reshape(1, N_IMG, 4)
    txt_ids = np.zeros((1, N_TXT, 4), np.int32)
    txt_ids[..., 3] = np.arange(N_TXT)
    dtypes = []

    def after_block(*outputs):
        dtypes.extend(o.dtype for o in outputs if o is not None)
        mx.eval([o for o in outputs if o is not None])

    with mlx_peak_above_live() as measured, installed(RunPolicy()):   # as the denoise phase runs it on the CPU
        out = model(x.astype(mx.bfloat16), ctx.astype(mx.bfloat16), mx.array([0.5]), img_ids, txt_ids,
                    after_block=after_block)
        mx.eval(out)
    peak = measured.bytes
    return out, dtypes, peak, model


def _measured(weights):
    """The lower of two forwards' peaks (blocks are paced asynchronously, mlxdiff/pacing.py, so a peak varies by a
    few %), after a warm-up forward in the process: its first call also holds the fused pieces' compilation."""
    first, second = _forward(weights), _forward(weights)
    return (first[0], first[1], min(first[2], second[2]), first[3])


@in_fresh_process
def test_float32_norm_scales_keep_bf16_activations_and_memory():
    bf16_weights = _weights(mx.bfloat16)
    _forward(bf16_weights)       # the warm-up, for both: after the cast at load both models hold the same dtypes
    bf16_out, bf16_dtypes, bf16_peak, _ = _measured(bf16_weights)
    out, dtypes, peak, model = _measured(_weights(mx.float32))
    assert out.dtype == mx.bfloat16
    assert set(dtypes) == {mx.bfloat16} and set(bf16_dtypes) == {mx.bfloat16}
    # the float32 scales were cast at load: the model holds bf16 only, and the forward needs what the bf16 one does
    assert {w.dtype for _, w in tree_flatten(model.parameters())} == {mx.bfloat16}
    assert peak <= 1.05 * bf16_peak, (peak, bf16_peak)
    # the same numbers: casting a float32 scale that came from bf16 is exact
    assert np.array_equal(np.array(out.astype(mx.float32)), np.array(bf16_out.astype(mx.float32)))


def test_float32_compute_keeps_bf16_weights_as_stored():
    """Under float32 compute nothing is cast: bf16 weights promote to float32 anyway, and stay bf16 in memory."""
    weights = _weights(mx.float32)
    model = build(flux2, CONFIG, weights, "test")     # float32: no policy installed
    stored = {name: w.dtype for name, w in weights.items()}
    assert {name: w.dtype for name, w in tree_flatten(model.parameters())} == stored
