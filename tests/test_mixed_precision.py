"""`dtype="float16-mixed"` (issue 29): float16 weights and arithmetic with the transformers' residual streams kept in
float32 (backend.stream_dtype). FLUX.2's streams reach ~1e5, past float16's 65504, where pure float16 breaks.

- A tiny FLUX.2 transformer whose adaLN gates are scaled up so that its float32 streams pass 1e5: pure float16 turns
  them into infinities (NaN output); float16-mixed stays as close to float32 as float16 is on the same model with
  unscaled gates. The streams are float32 between blocks.
- A tiny SD3.5 transformer: the streams are float32 between blocks and the output is as close to float32 as pure
  float16's.
- Pipelines: the embedded default draws under float16-mixed (its image beside float32's), the run's metadata says
  float16-mixed; the UNet family refuses it in one line; an unknown dtype's message names it.
"""

import numpy as np
import pytest

import mlxdiff  # noqa: F401  (OpenBLAS preload before mlx)
import mlx.core as mx
import mlx.nn as nn

from mlxdiff import backend, default_model
from mlxdiff.errors import MlxdiffError
from mlxdiff.models import flux2, mmdit
from ldm_helpers import sd15_components

FLUX = dict(patch_size=1, in_channels=16, out_channels=12, num_layers=2, num_single_layers=3, attention_head_dim=32,
            num_attention_heads=2, joint_attention_dim=40, timestep_guidance_channels=256, mlp_ratio=3.0,
            axes_dims_rope=(8, 8, 8, 8), rope_theta=2000, eps=1e-6, guidance_embeds=False)


def _random(model, seed):
    mx.random.seed(seed)
    model.update(nn.utils.tree_map(lambda a: mx.random.normal(a.shape) * 0.2 + (1.0 if a.ndim == 1 else 0.0),
                                   model.parameters()))
    return model


def _rel(a, ref):
    a = np.array(a.astype(mx.float32))
    return float(np.abs(a - ref).max() / np.abs(ref).max()) if np.isfinite(a).all() else float("inf")


def _flux_run(model, dtype, stream_dtype=None):
    """(output float32 numpy, [max |stream| after each block], {stream dtypes seen})."""
    rng = np.random.default_rng(0)
    h, w, n_txt = 5, 6, 7
    img = mx.array(rng.standard_normal((1, h * w, 16)).astype(np.float32))
    txt = mx.array(rng.standard_normal((1, n_txt, 40)).astype(np.float32))
    img_ids = np.stack(np.meshgrid(np.zeros(1), np.arange(h), np.arange(w), np.zeros(1), indexing="ij"), -1)
    txt_ids = np.zeros((1, n_txt, 4), np.int32)
    txt_ids[..., 3] = np.arange(n_txt)
    peaks, dtypes = [], set()

    def track(*outs):
        peaks.append(max(float(mx.abs(o.astype(mx.float32)).max()) for o in outs))
        dtypes.update(o.dtype for o in outs)
    model.update(nn.utils.tree_map(lambda a: a.astype(dtype), model.parameters()))
    model.compute_dtype = dtype
    out = model(img, txt, mx.array([0.5]), mx.array(img_ids.reshape(1, -1, 4).astype(np.int32)), mx.array(txt_ids),
                after_block=track, stream_dtype=stream_dtype)
    return out, peaks, dtypes


def _flux_model(gate_scale):
    model = _random(flux2.Model(flux2.ModelArgs(**FLUX)), seed=3)
    d = FLUX["num_attention_heads"] * FLUX["attention_head_dim"]
    for name, sets in (("double_stream_modulation_img", 2), ("double_stream_modulation_txt", 2),
                       ("single_stream_modulation", 1)):
        layer = getattr(model, name).linear
        w = np.array(layer.weight)
        for s in range(sets):                      # each set's rows: shift, scale, gate
            w[(3 * s + 2) * d:(3 * s + 3) * d] *= gate_scale
        layer.weight = mx.array(w)
    return model


def test_flux2_streams_past_the_float16_range():
    # float16's own error on this model, its streams well inside float16's range
    ref, peaks, _ = _flux_run(_flux_model(1.0), mx.float32)
    assert max(peaks) < 4000
    fp16_error = _rel(_flux_run(_flux_model(1.0), mx.float16)[0], np.array(ref))

    ref, peaks, _ = _flux_run(_flux_model(100.0), mx.float32)
    ref = np.array(ref)
    assert max(peaks) > 1e5          # as FLUX.2's streams do: past 65504
    pure, _, pure_dtypes = _flux_run(_flux_model(100.0), mx.float16)
    mixed, _, mixed_dtypes = _flux_run(_flux_model(100.0), mx.float16, stream_dtype=mx.float32)
    assert pure_dtypes == {mx.float16} and not np.isfinite(np.array(pure.astype(mx.float32))).all()
    assert mixed_dtypes == {mx.float32}
    assert _rel(mixed, ref) <= 2 * fp16_error, (_rel(mixed, ref), fp16_error)


def test_sd3_streams_float32_between_blocks():
    args = mmdit.ModelArgs(sample_size=8, patch_size=2, in_channels=4, num_layers=3, attention_head_dim=16,
                           num_attention_heads=2, joint_attention_dim=24, caption_projection_dim=32,
                           pooled_projection_dim=20, out_channels=4, pos_embed_max_size=16,
                           dual_attention_layers=(0,), qk_norm="rms_norm")
    rng = np.random.default_rng(1)
    x = mx.array(rng.standard_normal((2, 4, 8, 8)).astype(np.float32))
    ctx = mx.array(rng.standard_normal((2, 5, 24)).astype(np.float32))
    pooled = mx.array(rng.standard_normal((2, 20)).astype(np.float32))
    outs = {}
    for name, dtype, stream in (("f32", mx.float32, None), ("fp16", mx.float16, None),
                                ("mixed", mx.float16, mx.float32)):
        model = _random(mmdit.Model(args), seed=5)
        model.update(nn.utils.tree_map(lambda a: a.astype(dtype), model.parameters()))
        model.compute_dtype = dtype
        seen = set()
        outs[name] = model(x, ctx, pooled, mx.array([500.0, 500.0]), stream_dtype=stream,
                           after_block=lambda *o: seen.update(a.dtype for a in o if a is not None))
        outs[name + "_streams"] = seen
    assert outs["mixed_streams"] == {mx.float32} and outs["fp16_streams"] == {mx.float16}
    ref = np.array(outs["f32"])
    assert _rel(outs["mixed"], ref) <= 2 * _rel(outs["fp16"], ref)


def test_backend_names_it():
    assert backend.compute_dtype("float16-mixed") == mx.float16
    assert backend.stream_dtype("float16-mixed") == mx.float32 and backend.stream_dtype("fp16-mixed") == mx.float32
    assert backend.stream_dtype("float16") is None and backend.stream_dtype(None) is None
    with pytest.raises(MlxdiffError, match="float16-mixed"):
        backend.compute_dtype("float8")


def test_embedded_default_draws_under_float16_mixed():
    """The trained default model's streams stay inside float16's range, so pure float16 draws too: float16-mixed,
    whose streams are float32, must come at least as close to the float32 image as pure float16 does."""
    kw = dict(steps=4, guidance=4.0, seed=0, progress_bar=False)
    prompt = "a large red circle on the left and a large blue square on the right on a white background"
    folder = str(default_model.FOLDER)
    f32 = np.asarray(mlxdiff.load(folder).generate(prompt, **kw).images[0], dtype=np.int16)
    fp16 = np.asarray(mlxdiff.load(folder, dtype="float16").generate(prompt, **kw).images[0], dtype=np.int16)
    pipe = mlxdiff.load(folder, dtype="float16-mixed")
    assert pipe.dtype_name == "float16-mixed"           # what the image's metadata records
    mixed = np.asarray(pipe.generate(prompt, **kw).images[0], dtype=np.int16)
    pure_diff, mixed_diff = np.abs(fp16 - f32), np.abs(mixed - f32)
    assert 0 < pure_diff.mean() and mixed_diff.mean() <= pure_diff.mean()
    assert mixed_diff.max() <= pure_diff.max()


def test_unet_family_refuses_it(tmp_path):
    from diffusers import StableDiffusionPipeline
    StableDiffusionPipeline(**sd15_components()).save_pretrained(str(tmp_path))
    with pytest.raises(MlxdiffError, match="no such streams: use --dtype float16"):
        mlxdiff.load(str(tmp_path), dtype="float16-mixed")
