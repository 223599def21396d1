"""What every family has, on FLUX.1: the transformer streamed from its file under a budget (the same output, bit
for bit), quantizing while loading, convert's round trip, the first-block cache and the split of a run's phases."""

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import mlxdiff
import mlx.core as mx

from flux1_helpers import GGUF_CONFIG as CONFIG, H, W, flux1_components, gguf_inputs as inputs, packed_noise
from gguf_helpers import SCALE, torch_state
from helpers import max_rel_err, randomize_
from memory_helpers import streamed_count
from mlxdiff.convert import convert
from mlxdiff.loading import sources
from mlxdiff.loading.component import load_component
from mlxdiff.models import flux1
from mlxdiff.policy import RunPolicy, installed
from twins import flux1_to_bfl

RUN = dict(width=W, height=H, steps=2, guidance=3.5, progress_bar=False)
# enough blocks that the repeated ones are most of the weights, as in the real model (19 + 38 blocks)
STREAM_CONFIG = dict(CONFIG, num_layers=3, num_single_layers=8)


@pytest.fixture(scope="module")
def bfl_file(tmp_path_factory):
    from diffusers import FluxTransformer2DModel
    torch.manual_seed(12)
    model = randomize_(FluxTransformer2DModel(**STREAM_CONFIG), seed=12, scale=SCALE).eval()
    path = tmp_path_factory.mktemp("flux1_stream") / "flux1-tiny.safetensors"
    save_file({k: v.contiguous() for k, v in flux1_to_bfl(torch_state(model), STREAM_CONFIG).items()}, str(path))
    return path


@pytest.fixture(scope="module")
def dev_folder(tmp_path_factory):
    """A tiny FLUX.1 dev folder saved by diffusers, read (never written) by the tests below."""
    from diffusers import FluxPipeline
    folder = tmp_path_factory.mktemp("flux1_dev") / "dev"
    FluxPipeline(**flux1_components("dev", seed=4)).save_pretrained(str(folder))
    return folder


def forward(loaded, policy, x):
    with installed(policy):
        return np.array(loaded.model(**{k: mx.array(v) for k, v in x.items()}).astype(mx.float32))


def test_streamed_transformer_is_exact(bfl_file):
    """Under 85% of its weights the FLUX.1 transformer streams most of its blocks from the BFL file (linear1 split
    on the way), and its output is the resident one, bit for bit."""
    spec = sources.transformer_from_file(bfl_file, flux1)
    need = spec.loaded_nbytes(compute_dtype=mx.float32)
    x = inputs(seed=2)
    resident = load_component(spec, RunPolicy())
    expected = forward(resident, RunPolicy(), x)
    del resident
    policy = RunPolicy(memory_limit=int(0.85 * need))
    loaded = load_component(spec, policy)
    assert streamed_count(loaded.model) > 0 and loaded.model.block_stream.bytes_read == 0
    assert any("blocks streamed from the file" in n for n in loaded.notes), loaded.notes
    got = forward(loaded, policy, x)
    assert np.array_equal(got, expected), np.abs(got - expected).max()
    assert loaded.model.block_stream.bytes_read > 0


def test_quantize_convert_and_cache(dev_folder, tmp_path):
    """On a tiny dev folder (the mechanisms are the family's, not the variant's)."""
    folder = dev_folder
    noise = packed_noise(3)
    plain = mlxdiff.load(str(folder)).generate("a red fox", latents=noise, **RUN)
    # 8-bit transformer and encoders while loading: close to the float result, not equal to it
    quantized = mlxdiff.load(str(folder), quantize=8).generate("a red fox", latents=noise, **RUN)
    moved = max_rel_err(quantized.latents, plain.latents)
    assert 0 < moved < 0.1, moved
    # convert: mlxdiff's own checkpoint gives the same image
    dest = convert(str(folder), tmp_path / "flux1-native", progress=lambda *_: None)
    again = mlxdiff.load(str(dest)).generate("a red fox", latents=noise, **RUN)
    assert np.array_equal(np.asarray(again.image), np.asarray(plain.image))
    assert np.array_equal(again.latents, plain.latents)     # the same float32 weights, re-saved
    # the first-block cache runs through FLUX.1's blocks (threshold 1: every step after the first reuses)
    cached = mlxdiff.load(str(folder)).generate("a red fox", latents=noise, cache="first-block:1", **dict(RUN, steps=3))
    assert cached.cached_steps and np.isfinite(cached.latents).all()


def test_footprint_compare_runs_both_sides(dev_folder, tmp_path):
    """footprint compare on a FLUX.1 folder: mlxdiff, diffusers as is and the sequential recipe, one ruler."""
    import json
    from mlxdiff.footprint import main
    folder = dev_folder
    rc = main(["compare", "--model", str(folder), "--width", "32", "--height", "32", "--steps", "2", "--out",
               str(tmp_path / "fp")])
    assert rc in (0, None)
    report = json.loads((tmp_path / "fp" / "footprint.json").read_text())
    text = json.dumps(report)
    assert "diffusers" in text and "sequential" in text
