"""End to end: mlxdiff's FLUX.2 pipelines against diffusers' Flux2Pipeline (dev: Mistral3 encoder, embedded
guidance) and Flux2KleinPipeline (Qwen3 encoder; base with CFG, distilled without), on the same injected noise."""

import numpy as np
import pytest
import torch

import mlxdiff
from mlxdiff.errors import MlxdiffError
from twins import H, SEQ, TAPS, W, build_pipeline


@pytest.fixture(scope="module", params=["klein_base", "klein_distilled", "dev"])
def saved_pipeline(request, tmp_path_factory):
    return build_pipeline(request.param, tmp_path_factory.mktemp(f"flux2_{request.param}"))


def test_flux2_pipeline_matches_diffusers(saved_pipeline):
    kind, folder, pipe = saved_pipeline
    noise = np.random.default_rng(2).standard_normal((1, 20, H // 4, W // 4)).astype(np.float32)
    guidance = 1.0 if kind == "klein_distilled" else 3.5
    ref = pipe(prompt="a red fox in the snow", height=H, width=W, num_inference_steps=3, guidance_scale=guidance,
               latents=torch.from_numpy(noise), max_sequence_length=SEQ, text_encoder_out_layers=TAPS,
               output_type="np").images[0]
    ours = mlxdiff.load(str(folder)).generate("a red fox in the snow", width=W, height=H, steps=3,
                                              guidance=guidance, latents=noise, max_sequence_length=SEQ,
                                              text_encoder_out_layers=TAPS, progress_bar=False)
    img = np.asarray(ours.image).astype(np.float32) / 255.0
    assert img.shape == ref.shape
    assert np.abs(img - (ref * 255).round() / 255.0).max() <= 2 / 255
    assert ours.latents.shape == noise.shape


def test_joint_attention_mismatch_is_one_clear_line(tmp_path):
    _, folder, _ = build_pipeline("klein_base", tmp_path)
    with pytest.raises(MlxdiffError, match="joint_attention_dim"):
        mlxdiff.load(str(folder)).generate("a cat", width=W, height=H, steps=1, max_sequence_length=SEQ,
                                           text_encoder_out_layers=(1, 3), progress_bar=False)
