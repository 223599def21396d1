"""End to end: mlxdiff's Qwen-Image 2.1 pipeline against diffusers' QwenImage21Pipeline on the same injected noise, at a
tiny config read from a folder that save_pretrained wrote (via mlxdiff.load): the prompt embeddings and mask against
diffusers' encode_prompt (left padding, the last layer before the final norm, the system turn dropped, right-padded
rows); text-to-image without guidance (its default; the prompt moves diffusers' output past the tolerances) and with
true CFG and a negative prompt (the guidance moves it), the prefix KV cache on (diffusers'
default) and off; a Q8_0 GGUF transformer in ComfyUI's names (fused gate_up, kept quantized) against diffusers on
the file's decoded values; the schedule; bad input. The tiny pipeline and the reference run are
tests/qwenimage21_helpers.py's."""

import numpy as np
import pytest
import torch
from PIL import Image

import mlxdiff
import parity
from gguf_helpers import dequantized, write_q8_0_gguf
from helpers import max_rel_err
from mlxdiff.errors import MlxdiffError
from mlxdiff.formats.gguf import RawLinear
from mlxdiff.pipelines.qwenimage21.pipeline import qwenimage21_sigmas
from qwenimage21_helpers import H, SCHEDULER, TRANSFORMER, W, check_parity, noise, reference, save_pipeline
import fixture_guard

PROMPT, OTHER, NEGATIVE = "a red fox sitting in the snow at dawn", "a watercolor painting of a lighthouse", "blurry"
STEPS = 2


@pytest.fixture(autouse=True)
def _shared_fixtures_unchanged(request):
    """The module's shared fixtures are left as built (fixture_guard)."""
    yield from fixture_guard.unchanged(request, ['qi21_tiny', 'gguf', 't2i_reference'])


@pytest.fixture(scope="module")
def qi21_tiny(tmp_path_factory):
    """The tiny QwenImage21Pipeline (qwenimage21_helpers.save_pipeline), saved, and read back by mlxdiff.load."""
    folder, pipe = save_pipeline(tmp_path_factory.mktemp("qwenimage21"))
    return folder, pipe, mlxdiff.load(str(folder), dtype="float32")


def test_encode_prompt_matches_diffusers(qi21_tiny):
    """Two prompts of different lengths (left-padded together, then right-padded rows), and one alone (no mask)."""
    _, pipe, ours = qi21_tiny
    for prompts in ([PROMPT, "a lighthouse"], [OTHER]):
        with torch.no_grad():
            embeds, mask, _ = pipe.encode_prompt(list(prompts), device="cpu")
        got = ours.encode_prompt(prompts).as_numpy()
        assert got["prompt_embeds"].shape == tuple(embeds.shape)
        if mask is None:
            assert got["prompt_embeds_mask"] is None and len(prompts) == 1
        else:
            np.testing.assert_array_equal(got["prompt_embeds_mask"], mask.numpy().astype(np.int32))
        err = max_rel_err(got["prompt_embeds"], embeds.numpy())
        print(f"{len(prompts)} prompts: prompt_embeds max_rel_err {err:.2e}")
        assert err <= 1e-4


BASE = dict(prompt=PROMPT, height=H, width=W, num_inference_steps=STEPS)


@pytest.fixture(scope="module")
def t2i_reference(qi21_tiny):
    """diffusers' run of BASE at guidance 1 (its default); the prompt moves its output past the latent tolerance (tests/parity.py)."""
    _, pipe, _ = qi21_tiny
    return parity.assert_inputs_matter(lambda **kw: reference(pipe, **kw),
                                       dict(BASE, latents=torch.from_numpy(noise())), {"prompt": {"prompt": OTHER}})


def test_text_to_image_matches_diffusers(qi21_tiny, t2i_reference):
    """guidance 1 (the default): one forward a step; the KV cache on and off."""
    _, _, ours = qi21_tiny
    ref = t2i_reference
    for cache in (True, False):
        got = ours.generate(PROMPT, width=W, height=H, steps=STEPS, latents=noise(), use_kv_cache=cache)
        check_parity(got, *ref, f"no CFG, KV cache {cache}")
    assert got.image.mode == "RGBA"
    # a first-block cache that always may skips the second step's blocks (the first fills the KV cache)
    skipped = ours.generate(PROMPT, width=W, height=H, steps=STEPS, latents=noise(), cache="first-block:1e9")
    assert any("skipped in 1 of 2 cond forwards" in n for n in skipped.notes), skipped.notes


def test_true_cfg_matches_diffusers(qi21_tiny):
    """true_cfg_scale 4 with a negative prompt: neg + g (cond - neg); the guidance moves diffusers' output."""
    _, pipe, ours = qi21_tiny
    ref = parity.assert_inputs_matter(
        lambda **kw: reference(pipe, **kw),
        dict(BASE, negative_prompt=NEGATIVE, true_cfg_scale=4.0, latents=torch.from_numpy(noise(3))),
        {"guidance": {"true_cfg_scale": 2.0}})
    got = ours.generate(PROMPT, negative_prompt=NEGATIVE, width=W, height=H, steps=STEPS, guidance=4.0,
                        latents=noise(3))
    check_parity(got, *ref, "true CFG 4")


def test_defaults_and_schedule(qi21_tiny):
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.qwenimage21.pipeline_qwenimage21 import calculate_shift, retrieve_timesteps
    _, _, ours = qi21_tiny
    assert ours.defaults() == {"steps": 40, "guidance": 1.0} and ours.default_size() == 1024
    for steps, seq, sample in ((3, 24, None), (40, 4096, None), (4, 4096, [1.0, 0.9, 0.6, 0.3])):
        scheduler = FlowMatchEulerDiscreteScheduler(**SCHEDULER)
        mu = calculate_shift(seq, 256, 8192, 0.5, 0.9)
        timesteps, _ = retrieve_timesteps(scheduler, steps, "cpu", mu=mu,
                                          sigmas=sample or np.linspace(1.0, 1 / steps, steps))
        sigmas, ours_t = qwenimage21_sigmas(steps, seq, SCHEDULER, sample)
        np.testing.assert_allclose(ours_t, timesteps.numpy(), rtol=1e-6)
        np.testing.assert_allclose(sigmas, scheduler.sigmas.numpy(), rtol=1e-6)


def test_bad_input(qi21_tiny, tmp_path):
    _, _, ours = qi21_tiny
    with pytest.raises(MlxdiffError, match="multiples of"):
        ours.generate(PROMPT, width=80, height=H, steps=1)
    image = tmp_path / "in.png"
    Image.new("RGB", (W, H)).save(image)
    with pytest.raises(MlxdiffError, match="condition images"):
        ours.generate(PROMPT, width=W, height=H, steps=1, image=str(image))
    with pytest.raises(MlxdiffError, match="latents"):
        ours.generate(PROMPT, width=W, height=H, steps=1, latents=noise()[:, :-1])
    got = ours.generate(PROMPT, width=W, height=H, steps=1, guidance=3.0)      # no negative prompt: no CFG
    assert any("true CFG needs a negative prompt" in n for n in got.notes), got.notes


# -- a Q8_0 GGUF transformer ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def gguf(qi21_tiny, tmp_path_factory):
    """The transformer as a GGUF in ComfyUI's names (bare; each block's SwiGLU gate and up fused, gate first), Q8_0
    for the blocks' 2-D weights, and diffusers' pipeline on the values gguf-py decodes from it."""
    from diffusers import QwenImage21Pipeline, QwenImage21Transformer2DModel
    from diffusers.loaders.single_file_utils import convert_qwen_image21_transformer_checkpoint_to_diffusers
    _, pipe, _ = qi21_tiny
    sd = pipe.transformer.state_dict()
    comfy = {}
    for key, value in sd.items():
        if key.endswith("img_mlp.gate_layer.weight"):
            comfy[key.replace("gate_layer", "gate_up")] = torch.cat([value, sd[key.replace("gate_layer", "proj")]])
        elif not key.endswith("img_mlp.proj.weight"):
            comfy[key] = value
    path = tmp_path_factory.mktemp("qi21_gguf") / "qwen-image-2.1-Q8_0.gguf"
    quantized = write_q8_0_gguf(path, comfy, "qwen_image", lambda name: name.startswith("transformer_blocks."))
    assert len(quantized) == 6 * TRANSFORMER["num_layers"]      # q, k, v, o, the fused gate_up, out
    twin = QwenImage21Transformer2DModel(**TRANSFORMER)
    decoded = {k: torch.from_numpy(v.copy()) for k, v in dequantized(path).items()}
    twin.load_state_dict(convert_qwen_image21_transformer_checkpoint_to_diffusers(decoded))
    components = {k: v for k, v in pipe.components.items() if k != "transformer"}
    return path, QwenImage21Pipeline(**components, transformer=twin.eval())


def test_q8_gguf_matches_diffusers_on_its_values(qi21_tiny, gguf, t2i_reference):
    folder, _, _ = qi21_tiny
    path, gguf_pipe = gguf
    ours = mlxdiff.load(str(folder), transformer=str(path), dtype="float32")
    ref = reference(gguf_pipe, **BASE, latents=torch.from_numpy(noise()))
    parity.assert_moves("the Q8_0 rounding", t2i_reference[0], ref[0])      # the file's values, not the folder's
    check_parity(ours.generate(PROMPT, width=W, height=H, steps=STEPS, latents=noise()), *ref, "Q8_0 GGUF")
    with ours.use(ours.components["transformer"]) as transformer:
        assert isinstance(transformer.transformer_blocks[0].attn.to_q, RawLinear)
