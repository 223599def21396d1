"""python -m mlxdiff.convert for FLUX.2 folders: the embedded default (klein layout, Qwen3 encoder) and a tiny
FLUX.2-dev folder (Mistral3 encoder), plain and quantized; the converted folders generate identical images."""

import json

import numpy as np
import pytest

import mlxdiff
from mlxdiff import default_model
from mlxdiff.convert import convert, main
from twins import H, SEQ, TAPS, W, build_pipeline


def _same_images(a, b):
    assert np.array_equal(a.latents, b.latents)
    assert np.array_equal(np.asarray(a.image), np.asarray(b.image))


def test_convert_embedded_default(tmp_path):
    kw = dict(steps=2, seed=3, progress_bar=False)
    before = mlxdiff.load(str(default_model.folder())).generate(default_model.PROMPT, **kw)
    dest = convert(str(default_model.folder()), tmp_path / "klein-native", progress=lambda *_: None)
    index = json.loads((dest / "model_index.json").read_text())
    assert index["text_encoder"] == ["transformers", "Qwen3ForCausalLM"]
    assert index["text_encoder_out_layers"] == [1, 2, 3]
    for name in ("transformer", "vae"):
        assert json.loads((dest / name / "config.json").read_text())["_mlxdiff_native"] is True
    _same_images(before, mlxdiff.load(str(dest)).generate(default_model.PROMPT, **kw))


@pytest.mark.parametrize("quantize", [None, {"text_encoder": 8, "transformer": 4}])
def test_convert_flux2_dev(tmp_path, quantize):
    _, folder, _ = build_pipeline("dev", tmp_path / "src")
    noise = np.random.default_rng(2).standard_normal((1, 20, H // 4, W // 4)).astype(np.float32)
    kw = dict(width=W, height=H, steps=2, guidance=3.5, latents=noise, max_sequence_length=SEQ,
              text_encoder_out_layers=TAPS, progress_bar=False)
    before = mlxdiff.load(str(folder), quantize=quantize).generate("a red fox", **kw)
    dest = convert(str(folder), tmp_path / "dev-native", quantize=quantize, progress=lambda *_: None)
    after = mlxdiff.load(str(dest))
    if quantize:
        assert after.components["text_encoder"].config["quantization"]["bits"] == 8
    _same_images(before, after.generate("a red fox", **kw))
    # the encoder is written whole, so other taps than the run's still load from the converted folder
    other = dict(kw, text_encoder_out_layers=(2, 6))
    with pytest.raises(mlxdiff.MlxdiffError, match="joint_attention_dim"):
        after.generate("a red fox", **other)


def test_convert_cli_on_flux2(tmp_path, capsys):
    _, folder, _ = build_pipeline("klein_distilled", tmp_path / "src")
    assert main([str(folder), str(tmp_path / "out")]) == 0
    assert "wrote" in capsys.readouterr().out
    assert (tmp_path / "out" / "text_encoder" / "model.safetensors").exists()
