"""Qwen-Image 2.1's LoRAs, files and runs beside its diffusers folder: a LoRA as diffusers / PEFT names it
(QwenImage21Pipeline.save_lora_weights) and the same as ComfyUI / Lightning name it
(`diffusion_model.transformer_blocks.0.attn.to_q.lora_down.weight`, with .alpha), on every block's attention and SwiGLU, img_in and the shared modulation, against diffusers'
QwenImage21Pipeline with the file loaded by its own load_lora_weights (QwenImageLoraLoaderMixin), images within 2
levels; the transformer as ComfyUI carries it (diffusers' names under `model.diffusion_model.`, each SwiGLU's gate
and up fused gate-first as gate_up, as convert_qwen_image21_transformer_checkpoint_to_diffusers reads it; and its
fp8_e4m3fn variant) read to the folder's weights; a run streamed under a memory limit below the transformer's bytes
the resident run bit for bit; convert's round trip; the CLI (the folder, the ComfyUI file, the ComfyUI LoRA,
streamed) the API's image. The folder's own parity and a GGUF's are tests/test_qwenimage21_pipeline.py's."""

import copy

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import mlxdiff
import mlx.core as mx

import parity
from family_files_helpers import (STREAMED, assert_identical, assert_same_weights, cli_image, comfy_files,
                                  converted_run, streamed_run, weights)
from qwenimage21_helpers import H, TRANSFORMER, W, check_parity, noise, reference, save_pipeline
import fixture_guard

# eight blocks: the repeated weights most of the transformer, as in the real model, so that they can stream
STREAM = dict(TRANSFORMER, num_layers=8)
PROMPT = "a red fox sitting in the snow at dawn"
STEPS = 2
RUN = dict(width=W, height=H, steps=STEPS, latents=noise(), progress_bar=False)
BASE = dict(prompt=PROMPT, height=H, width=W, num_inference_steps=STEPS)
LORA_RANK, LORA_ALPHA, LORA_SCALE = 3, 1.5, 0.6      # alpha / rank = 0.5; 0.6: a scale applied twice shows
LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "proj", "gate_layer", "img_mlp.out", "img_in", "modulation.1"]


@pytest.fixture(autouse=True)
def _shared_fixtures_unchanged(request):
    """The module's shared fixtures are left as built (fixture_guard)."""
    yield from fixture_guard.unchanged(request, ["qi21", "loras", "runs"])


def to_comfy(state: dict) -> dict:
    """diffusers' names -> ComfyUI's (bare): each block's img_mlp gate_layer and proj fused gate-first as gate_up."""
    out = {}
    for key, value in state.items():
        if key.endswith("img_mlp.gate_layer.weight"):
            out[key.replace("gate_layer", "gate_up")] = torch.cat([value, state[key.replace("gate_layer", "proj")]])
        elif not key.endswith("img_mlp.proj.weight"):
            out[key] = value
    return out


@pytest.fixture(scope="module")
def qi21(tmp_path_factory):
    """(the tiny folder with an 8-block transformer, the diffusers pipeline, its ComfyUI files (plain, fp8), the fp8
    file's names, the float32 bytes of the folder's transformer)."""
    from diffusers.loaders.single_file_utils import convert_qwen_image21_transformer_checkpoint_to_diffusers
    root = tmp_path_factory.mktemp("qi21_files")
    folder, pipe = save_pipeline(root, STREAM)
    state = {k: v.detach().clone() for k, v in pipe.transformer.state_dict().items()}
    comfy = to_comfy(state)
    back = convert_qwen_image21_transformer_checkpoint_to_diffusers(dict(comfy))    # what diffusers reads
    assert sorted(back) == sorted(state) and all(torch.equal(back[k], state[k]) for k in state)
    paths, _, names = comfy_files(comfy, root, "qwen_image_2.1", lambda name: name.startswith("transformer_blocks."))
    need = mlxdiff.load(str(folder)).components["transformer"].loaded_nbytes(compute_dtype=mx.float32)
    return folder, pipe, paths, names, need


@pytest.fixture(scope="module")
def loras(qi21, tmp_path_factory):
    """A random PEFT LoRA on LORA_TARGETS of a copy of the transformer, written as diffusers writes it and in
    ComfyUI's; {naming: path}."""
    from diffusers import QwenImage21Pipeline
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict
    _, pipe, _, _, _ = qi21
    root = tmp_path_factory.mktemp("qi21_loras")
    adapted = copy.deepcopy(pipe.transformer)
    config = LoraConfig(r=LORA_RANK, lora_alpha=LORA_ALPHA, target_modules=LORA_TARGETS, init_lora_weights=False)
    adapted.add_adapter(config)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in adapted.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    state = {k: v.detach().clone().contiguous() for k, v in get_peft_model_state_dict(adapted).items()}
    assert len(state) == 2 * (7 * STREAM["num_layers"] + 2)
    files = {"peft": root / "qwen-image-2.1-lora.safetensors", "comfy": root / "qwen-image-2.1-comfy.safetensors"}
    QwenImage21Pipeline.save_lora_weights(str(root), transformer_lora_layers=state, weight_name=files["peft"].name,
                                          transformer_lora_adapter_metadata=config.to_dict())
    comfy = {}
    for key, a in state.items():
        if key.endswith(".lora_A.weight"):
            layer = key[:-len(".lora_A.weight")]
            name = "diffusion_model." + layer
            comfy[f"{name}.lora_down.weight"], comfy[f"{name}.lora_up.weight"] = a, state[layer + ".lora_B.weight"]
            comfy[f"{name}.alpha"] = torch.tensor(LORA_ALPHA)
    save_file(comfy, str(files["comfy"]))
    return files


def with_lora(pipe, path):
    """A QwenImage21Pipeline of `pipe`'s components, a copy of its transformer, `path` loaded by diffusers'
    load_lora_weights at LORA_SCALE (the fixture's pipeline stays as built)."""
    from diffusers import QwenImage21Pipeline
    out = QwenImage21Pipeline(**{**pipe.components, "transformer": copy.deepcopy(pipe.transformer)})
    out.load_lora_weights(str(path), adapter_name="lora")
    out.set_adapters(["lora"], adapter_weights=[LORA_SCALE])
    return out


def deltas(transformer) -> dict:
    """{layer: the weight delta PEFT adds (alpha / rank and the adapter's weight applied)} of adapter "lora"."""
    return {name: m.get_delta_weight("lora").detach() for name, m in transformer.named_modules()
            if "lora" in getattr(m, "lora_A", {})}


@pytest.fixture(scope="module")
def runs(qi21):
    """The folder's run of PROMPT and the same under a memory limit of 0.7 x its transformer's bytes (streamed)."""
    folder, _, _, _, need = qi21
    return streamed_run(folder, PROMPT, RUN, need)


def test_lora_matches_diffusers(qi21, loras):
    """Each naming at LORA_SCALE against diffusers with the PEFT file; diffusers reads the ComfyUI file to the same
    adapter (the reference is what diffusers loads); the LoRA moves diffusers' output."""
    folder, pipe, _, _, _ = qi21
    lora_pipe = with_lora(pipe, loras["peft"])
    ref = reference(lora_pipe, **BASE, latents=torch.from_numpy(noise()))
    parity.assert_moves("the LoRA", ref[0], reference(pipe, **BASE, latents=torch.from_numpy(noise()))[0])
    want, got = deltas(lora_pipe.transformer), deltas(with_lora(pipe, loras["comfy"]).transformer)
    assert len(want) == 7 * STREAM["num_layers"] + 2 and sorted(got) == sorted(want)
    assert all(torch.allclose(got[k], want[k], rtol=1e-5, atol=1e-7) for k in want)
    for naming, path in loras.items():
        ours = mlxdiff.load(str(folder), loras=[(str(path), LORA_SCALE)], dtype="float32")
        check_parity(ours.generate(PROMPT, **RUN), *ref, f"LoRA ({naming}) at {LORA_SCALE}")


def test_comfyui_files_read_to_the_folders_weights(qi21):
    """qwen_image_2.1.safetensors: every weight the folder's, bit for bit (gate_up split back); its fp8_e4m3fn
    variant: the blocks' linear layers kept at 8 bits (Fp8Linear; the fused gate_up split into two), decoded the
    folder's weights cast to float8, the rest the folder's."""
    folder, _, (plain, cast), names, _ = qi21
    want, _ = weights(mlxdiff.load(str(folder), dtype="float32"))
    got, layers = weights(mlxdiff.load(str(folder), transformer=str(plain), dtype="float32"))
    assert not layers
    assert_same_weights(got, want, "the ComfyUI file")
    got, layers = weights(mlxdiff.load(str(folder), transformer=str(cast), dtype="float32"))
    assert len(names) == 6 * STREAM["num_layers"] and len(layers) == 7 * STREAM["num_layers"]
    cast_want = {k: torch.from_numpy(v).to(torch.float8_e4m3fn).float().numpy()
                 if k.rsplit(".", 1)[0] in layers and k.endswith(".weight") else v for k, v in want.items()}
    assert_same_weights(got, cast_want, "the fp8_e4m3fn file")


def test_streamed_run_is_the_resident_one(runs):
    assert_identical(*runs, "streamed")
    assert np.asarray(runs[0].image).std() > 5


def test_convert_round_trip(qi21, runs, tmp_path):
    """mlxdiff.convert of the folder with the ComfyUI file as its transformer, loaded back: the folder's run."""
    folder, _, (plain, _), _, _ = qi21
    assert_identical(converted_run(folder, tmp_path / "qi21-native", PROMPT, RUN, transformer=str(plain)), runs[0],
                     "converted from the ComfyUI file")


def test_cli_streams_the_comfyui_file_with_a_lora(qi21, loras, tmp_path, capsys):
    """mlxdiff.generate --model FOLDER --transformer qwen_image_2.1.safetensors --lora comfy.safetensors:0.6
    --memory-limit (0.75 x the transformer's bytes, its blocks streamed from the file): the API's resident image of
    the same seed."""
    folder, _, (plain, _), _, need = qi21
    limit = 0.75 * need / 2 ** 30
    image = cli_image(["--model", folder, "--transformer", plain, "--lora", f"{loras['comfy']}:{LORA_SCALE}",
                       "--memory-limit", limit, "--prompt", PROMPT, "--steps", 1, "--width", W, "--height", H,
                       "--seed", 3], tmp_path / "out.png")
    printed = capsys.readouterr()
    assert STREAMED in printed.out + printed.err, printed
    api = mlxdiff.load(str(folder), transformer=str(plain), loras=[(str(loras["comfy"]), LORA_SCALE)]).generate(
        PROMPT, width=W, height=H, steps=1, seed=3, progress_bar=False)
    assert not any(STREAMED in n for n in api.notes), api.notes
    assert np.array_equal(image, np.asarray(api.image))
