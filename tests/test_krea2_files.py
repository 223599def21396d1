"""Krea 2's files and runs beside its diffusers folder (tests/family_files_helpers.py): the transformer as ComfyUI
carries it (krea-ai's original names under `model.diffusion_model.`, as diffusers'
convert_krea2_transformer_checkpoint_to_diffusers reads them; and its fp8_e4m3fn variant) read to the folder's
weights; a run streamed under a memory limit below the transformer's bytes the resident run bit for bit; convert's
round trip; the CLI (the folder and the fp8 file, streamed) the API's image. Parity with diffusers is
tests/test_krea2_pipeline.py's (the folder, a GGUF) and tests/test_krea2_lora.py's."""

import numpy as np
import pytest
import torch

import mlxdiff  # noqa: F401  (OpenBLAS preload before mlx)
import mlx.core as mx

from mlxdiff.loading import streaming

from family_files_helpers import (STREAMED, assert_identical, assert_same_weights, cli_image, comfy_files,
                                  converted_run, streamed_run, weights)
from krea2_helpers import H, SEQ, TRANSFORMER, W, Z, save_pipeline, to_original
import fixture_guard

# eight blocks: the repeated weights most of the transformer, as in the real model, so that they can stream
STREAM = dict(TRANSFORMER, num_layers=8)
PROMPT = "a red fox sitting in the snow at dawn"
NOISE = np.random.default_rng(2).standard_normal((1, (H // 8) * (W // 8), 4 * Z)).astype(np.float32)
RUN = dict(width=W, height=H, steps=2, guidance=0.0, latents=NOISE, max_sequence_length=SEQ, progress_bar=False)


@pytest.fixture(autouse=True)
def _shared_fixtures_unchanged(request):
    """The module's shared fixtures are left as built (fixture_guard)."""
    yield from fixture_guard.unchanged(request, ["krea", "resident"])


@pytest.fixture(scope="module")
def krea(tmp_path_factory):
    """(the tiny folder with an 8-block transformer, its ComfyUI files (plain, fp8), the fp8 file's names, the
    float32 bytes of the folder's transformer and of the fp8 file's)."""
    root = tmp_path_factory.mktemp("krea2_files")
    folder, pipe = save_pipeline(root, STREAM)
    state = {k: v.detach().clone() for k, v in pipe.transformer.state_dict().items()}
    paths, _, names = comfy_files(to_original(state, prefix=""), root, "krea2",
                                  lambda name: name.startswith("blocks."))
    need = [mlxdiff.load(str(folder), transformer=t).components["transformer"].loaded_nbytes(
        compute_dtype=mx.float32) for t in (None, str(paths[1]))]
    return folder, paths, names, need


@pytest.fixture(scope="module")
def resident(krea):
    """The folder's run of PROMPT and the same under a memory limit of 0.7 x its transformer's bytes (streamed)."""
    folder, _, _, (need, _) = krea
    return streamed_run(folder, PROMPT, RUN, need)


def test_comfyui_files_read_to_the_folders_weights(krea):
    """krea2.safetensors: every weight the folder's, bit for bit; krea2_fp8_e4m3fn.safetensors: its blocks' linear
    layers kept at 8 bits (Fp8Linear), decoded the folder's weights cast to float8, the rest the folder's."""
    folder, (plain, cast), names, _ = krea
    want, _ = weights(mlxdiff.load(str(folder), dtype="float32"))
    got, layers = weights(mlxdiff.load(str(folder), transformer=str(plain), dtype="float32"))
    assert not layers
    assert_same_weights(got, want, "the ComfyUI file")
    got, layers = weights(mlxdiff.load(str(folder), transformer=str(cast), dtype="float32"))
    assert len(layers) == len(names) == 8 * STREAM["num_layers"]    # q, k, v, o, gate; the SwiGLU's gate, up, down
    cast_want = {k: torch.from_numpy(v).to(torch.float8_e4m3fn).float().numpy()
                 if k.rsplit(".", 1)[0] in layers and k.endswith(".weight") else v for k, v in want.items()}
    assert_same_weights(got, cast_want, "the fp8_e4m3fn file")
    assert any(not np.array_equal(cast_want[k], want[k]) for k in want)     # the cast shows


def test_streamed_run_is_the_resident_one(resident):
    assert_identical(*resident, "streamed")
    assert np.asarray(resident[0].image).std() > 5


def test_convert_round_trip(krea, resident, tmp_path):
    """mlxdiff.convert of the folder with the ComfyUI file as its transformer, loaded back: the folder's run."""
    folder, (plain, _), _, _ = krea
    assert_identical(converted_run(folder, tmp_path / "krea2-native", PROMPT, RUN, transformer=str(plain)),
                     resident[0], "converted from the ComfyUI file")


def test_cli_streams_the_fp8_file(krea, tmp_path, monkeypatch, capsys):
    """mlxdiff.generate --model FOLDER --transformer krea2_fp8_e4m3fn.safetensors --memory-limit (below the fp8
    transformer's bytes, its blocks streamed from the fp8 file): the API's resident image of the same seed. At 8 bits the
    twin's float embedders are most of it, so the activations' reserve is set aside here."""
    monkeypatch.setattr(streaming, "RESERVE_SHARE", 0.0)
    folder, (_, cast), _, (_, need) = krea
    limit = 0.8 * need / 2 ** 30
    image = cli_image(["--model", folder, "--transformer", cast, "--memory-limit", limit, "--prompt", PROMPT,
                       "--steps", 1, "--guidance", 0, "--width", W, "--height", H, "--seed", 3], tmp_path / "out.png")
    printed = capsys.readouterr()
    assert STREAMED in printed.out + printed.err, printed
    api = mlxdiff.load(str(folder), transformer=str(cast)).generate(
        PROMPT, width=W, height=H, steps=1, guidance=0.0, seed=3, progress_bar=False)
    assert not any(STREAMED in n for n in api.notes), api.notes        # resident: the CLI's streamed run equals it
    assert np.array_equal(image, np.asarray(api.image))
