"""FLUX 3's files and runs beside its modular folder (tests/family_files_helpers.py), on the distilled twin with more
single blocks: the transformer as a ComfyUI single file (diffusers' names, which are FLUX 3's own, under
`model.diffusion_model.`; and its fp8_e4m3fn variant) read to the folder's weights; a run under a memory limit below
the transformer's bytes, its blocks streamed from the ComfyUI file, the resident run (the folder's) bit for bit;
convert's round trip. (The CLI cannot run this twin: its 3-layer encoder needs text_encoder_out_layers, which the CLI
does not take; tests/test_krea2_files.py and tests/test_qwenimage21_files.py run theirs.) Parity with the modular
pipeline is tests/test_flux3_pipeline.py's (two reference images included) and tests/test_flux3_files.py's (base,
GGUF, LoRA)."""

import numpy as np
import pytest
import torch

import mlxdiff
import mlx.core as mx

from family_files_helpers import assert_identical, assert_same_weights, comfy_files, converted_run, streamed_run, weights
from flux3_helpers import H, NOISE, PROMPT, STEPS, TAPS, TRANSFORMER, W, save_folder
import fixture_guard

# ten single blocks: the repeated weights most of the transformer, as in the real model, so that they can stream
STREAM = dict(TRANSFORMER, num_single_layers=10)
RUN = dict(width=W, height=H, steps=STEPS, latents=NOISE, text_encoder_out_layers=TAPS, progress_bar=False)


@pytest.fixture(autouse=True)
def _shared_fixtures_unchanged(request):
    """The module's shared fixtures are left as built (fixture_guard)."""
    yield from fixture_guard.unchanged(request, ["flux3", "runs"])


@pytest.fixture(scope="module")
def flux3(tmp_path_factory):
    """(the distilled folder with 10 single blocks, its ComfyUI files (plain, fp8), the fp8 file's names, the
    transformer's float32 bytes)."""
    root = tmp_path_factory.mktemp("flux3_comfy")
    folder, pipe = save_folder("distilled", root, STREAM)
    state = {k: v.detach().clone().float() for k, v in pipe.transformer.state_dict().items()}
    paths, _, names = comfy_files(state, root, "flux-3-klein", lambda name: "blocks." in name)
    need = mlxdiff.load(str(folder)).components["transformer"].loaded_nbytes(compute_dtype=mx.float32)
    return folder, paths, names, need


@pytest.fixture(scope="module")
def runs(flux3):
    """The run of PROMPT with the ComfyUI file as transformer= resident, and under a memory limit of 0.7 x its
    bytes (its blocks streamed from the file, its names mapped block by block)."""
    folder, (plain, _), _, need = flux3
    return streamed_run(folder, PROMPT, RUN, need, transformer=str(plain))


def test_comfyui_files_read_to_the_folders_weights(flux3):
    folder, (plain, cast), names, _ = flux3
    want, _ = weights(mlxdiff.load(str(folder), dtype="float32"))
    got, layers = weights(mlxdiff.load(str(folder), transformer=str(plain), dtype="float32"))
    assert not layers
    assert_same_weights(got, want, "the ComfyUI file")
    got, layers = weights(mlxdiff.load(str(folder), transformer=str(cast), dtype="float32"))
    assert len(layers) == len(names) > 2 * STREAM["num_single_layers"]
    cast_want = {k: torch.from_numpy(v).to(torch.float8_e4m3fn).float().numpy()
                 if k.rsplit(".", 1)[0] in layers and k.endswith(".weight") else v for k, v in want.items()}
    assert_same_weights(got, cast_want, "the fp8_e4m3fn file")


def test_streamed_run_is_the_resident_one(flux3, runs):
    """Streamed from the ComfyUI file: the resident run bit for bit, which is the folder's."""
    folder = flux3[0]
    assert_identical(*runs, "streamed from the ComfyUI file")
    assert np.asarray(runs[0].image).std() > 5
    assert_identical(mlxdiff.load(str(folder), dtype="float32").generate(PROMPT, **RUN), runs[0], "the folder's run")


def test_convert_round_trip(flux3, runs, tmp_path):
    """mlxdiff.convert of the modular folder with the ComfyUI file as its transformer, loaded back: the same run."""
    folder, (plain, _), _, _ = flux3
    assert_identical(converted_run(folder, tmp_path / "flux3-native", PROMPT, RUN, transformer=str(plain)), runs[0],
                     "converted from the ComfyUI file")
