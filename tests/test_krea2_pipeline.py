"""End to end: mlxdiff's Krea 2 pipeline against diffusers' Krea2Pipeline on the same injected noise, at a tiny
config read from a folder that save_pretrained wrote (via mlxdiff.load): the prompt embeddings and masks against
diffusers' encode_prompt (the fixed-length [prefix | prompt | PAD | suffix] layout, the positions that skip the
padding, the tapped layers stacked, the prefix dropped); text-to-image with Krea's CFG (the prompt, the guidance and
the negative prompt each move diffusers' output past the tolerances) and without (guidance 0); the schedule (base
and distilled); a Q8_0 GGUF transformer in krea-ai's original names (kept quantized) against diffusers on the file's
decoded values; bad input."""

import numpy as np
import pytest
import torch

import mlxdiff
import parity
from gguf_helpers import dequantized, write_q8_0_gguf
from helpers import max_rel_err
from mlxdiff.errors import MlxdiffError
from krea2_helpers import H, SCHEDULER, SEQ, TAPS, TRANSFORMER, W, Z, save_pipeline, to_original
import fixture_guard

PROMPT, OTHER, NEGATIVE = "a red fox sitting in the snow at dawn", "a watercolor painting of a lighthouse", "blurry"
STEPS = 2


@pytest.fixture(autouse=True)
def _shared_fixtures_unchanged(request):
    """The module's shared fixtures are left as built (fixture_guard)."""
    yield from fixture_guard.unchanged(request, ['krea_tiny', 'gguf'])


@pytest.fixture(scope="module")
def krea_tiny(tmp_path_factory):
    """The tiny Krea2Pipeline (krea2_helpers.save_pipeline), saved, and read back by mlxdiff.load."""
    folder, pipe = save_pipeline(tmp_path_factory.mktemp("krea2"))
    return folder, pipe, mlxdiff.load(str(folder), dtype="float32")


def noise(seed=2):
    return np.random.default_rng(seed).standard_normal((1, (H // 8) * (W // 8), 4 * Z)).astype(np.float32)


def test_encode_prompt_matches_diffusers(krea_tiny):
    """Two prompts of different lengths (the shorter padded in the middle of the template), and a long one that the
    fixed length cuts."""
    _, pipe, ours = krea_tiny
    for prompts in ([PROMPT, "a lighthouse"], [PROMPT + ", " + OTHER * 4]):
        with torch.no_grad():
            embeds, mask = pipe.encode_prompt(list(prompts), device="cpu", max_sequence_length=SEQ)
        got = ours.encode_prompt(prompts, max_sequence_length=SEQ).as_numpy()
        assert got["prompt_embeds"].shape == tuple(embeds.shape) == (len(prompts), SEQ + 7, len(TAPS), 40)
        np.testing.assert_array_equal(got["prompt_embeds_mask"], mask.numpy().astype(np.int32))
        assert not mask.all() or len(prompts) == 1      # padding in the first case
        err = max_rel_err(got["prompt_embeds"], embeds.numpy())
        print(f"{len(prompts)} prompts: prompt_embeds max_rel_err {err:.2e}")
        assert err <= 1e-4


def reference(pipe, **kwargs):
    """One diffusers run: (its final packed latents, from the step callback, and its image)."""
    final = {}

    def keep_latents(_, i, t, tensors):
        final["latents"] = tensors["latents"]
        return {}
    with torch.no_grad():
        image = pipe(**kwargs, output_type="np", callback_on_step_end=keep_latents).images[0]
    return final["latents"].numpy(), image


def check_parity(got, ref_latents, ref_image, what):
    latents = np.asarray(got.latents).astype(np.float32)
    b, n, c = ref_latents.shape      # ours are unpacked (the VAE's layout): pack them as diffusers does
    packed = latents.reshape(b, c // 4, H // 8, 2, W // 8, 2).transpose(0, 2, 4, 1, 3, 5).reshape(b, n, c)
    err = max_rel_err(packed, ref_latents)
    shift = parity.levels(got.image, ref_image)
    print(f"{what}: latents max_rel_err {err:.2e}, image {shift}/255, notes {got.notes}")
    assert err <= parity.LATENT_TOL and shift <= parity.IMAGE_LEVELS


BASE = dict(prompt=PROMPT, negative_prompt=NEGATIVE, height=H, width=W, num_inference_steps=STEPS, guidance_scale=4.5,
            max_sequence_length=SEQ)


@pytest.fixture(scope="module")
def cfg_reference(krea_tiny):
    """diffusers' run of BASE (Krea's CFG with a negative prompt); the prompt, the guidance and the negative prompt
    each move its output past the latent tolerance (tests/parity.py) (parity.assert_inputs_matter)."""
    _, pipe, _ = krea_tiny
    return parity.assert_inputs_matter(
        lambda **kw: reference(pipe, **kw), dict(BASE, latents=torch.from_numpy(noise())),
        {"prompt": {"prompt": OTHER}, "guidance": {"guidance_scale": 1.5}, "negative prompt": {"negative_prompt": ""}})


def generate(ours):
    return ours.generate(PROMPT, negative_prompt=NEGATIVE, width=W, height=H, steps=STEPS, guidance=4.5,
                         latents=noise(), max_sequence_length=SEQ)


def test_text_to_image_matches_diffusers(krea_tiny, cfg_reference):
    """Krea's CFG, cond + g (cond - uncond), with a negative prompt."""
    check_parity(generate(krea_tiny[2]), *cfg_reference, "CFG 4.5")


def test_without_guidance_matches_diffusers(krea_tiny):
    """guidance 0: one forward a step (the distilled checkpoint's setting), the negative prompt unused."""
    _, pipe, ours = krea_tiny
    ref = reference(pipe, prompt=PROMPT, height=H, width=W, num_inference_steps=STEPS, guidance_scale=0.0,
                    max_sequence_length=SEQ, latents=torch.from_numpy(noise(3)))
    got = ours.generate(PROMPT, negative_prompt=NEGATIVE, width=W, height=H, steps=STEPS, guidance=0.0,
                        latents=noise(3), max_sequence_length=SEQ)
    check_parity(got, *ref, "no CFG")
    assert any("negative prompt unused" in n for n in got.notes)


def test_defaults_are_krea2s(krea_tiny):
    _, _, ours = krea_tiny
    assert ours.defaults() == {"steps": 28, "guidance": 4.5} and ours.default_size() == 1024


def test_schedule_matches_diffusers():
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.krea2.pipeline_krea2 import calculate_shift, retrieve_timesteps
    from mlxdiff.pipelines.krea2.pipeline import krea2_sigmas
    for steps, seq, distilled in ((3, 24, False), (28, 4096, False), (8, 4096, True), (20, 9000, False)):
        scheduler = FlowMatchEulerDiscreteScheduler(**SCHEDULER)
        mu = 1.15 if distilled else calculate_shift(seq, 256, 6400, 0.5, 1.15)
        timesteps, _ = retrieve_timesteps(scheduler, steps, "cpu", sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)
        sigmas, ours = krea2_sigmas(steps, seq, SCHEDULER, distilled)
        np.testing.assert_allclose(ours, timesteps.numpy(), rtol=1e-6)
        np.testing.assert_allclose(sigmas, scheduler.sigmas.numpy(), rtol=1e-6)


def test_bad_input(krea_tiny, tmp_path):
    _, _, ours = krea_tiny
    with pytest.raises(MlxdiffError, match="multiples of 8"):
        ours.generate(PROMPT, width=36, height=H, steps=1, max_sequence_length=SEQ)
    image = tmp_path / "in.png"
    from PIL import Image
    Image.new("RGB", (W, H)).save(image)
    with pytest.raises(MlxdiffError, match="text alone"):
        ours.generate(PROMPT, width=W, height=H, steps=1, image=str(image), max_sequence_length=SEQ)
    with pytest.raises(MlxdiffError, match="latents"):
        ours.generate(PROMPT, width=W, height=H, steps=1, latents=noise()[:, :-1], max_sequence_length=SEQ)


# -- a Q8_0 GGUF transformer ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def gguf(krea_tiny, tmp_path_factory):
    """The transformer as a GGUF in krea-ai's original names (bare, as ComfyUI-GGUF files carry a model's own
    names), Q8_0 for the blocks' 2-D weights, and diffusers' pipeline on the values gguf-py decodes from it."""
    from diffusers import Krea2Pipeline, Krea2Transformer2DModel
    from diffusers.loaders.single_file_utils import convert_krea2_transformer_checkpoint_to_diffusers
    folder, pipe, _ = krea_tiny
    path = tmp_path_factory.mktemp("krea2_gguf") / "krea2-Q8_0.gguf"
    quantized = write_q8_0_gguf(path, to_original(pipe.transformer.state_dict(), prefix=""), "krea2",
                                lambda name: name.startswith("blocks."))
    assert len(quantized) == 7 * TRANSFORMER["num_layers"]       # q, k, v, o, gate; the SwiGLU's gate and up
    twin = Krea2Transformer2DModel(**TRANSFORMER)
    decoded = {k: torch.from_numpy(v.copy()) for k, v in dequantized(path).items()}
    twin.load_state_dict(convert_krea2_transformer_checkpoint_to_diffusers(decoded))
    return path, Krea2Pipeline(**{**pipe.components, "transformer": twin.eval()}, text_encoder_select_layers=TAPS)


def test_q8_gguf_matches_diffusers_on_its_values(krea_tiny, gguf, cfg_reference):
    from mlxdiff.formats.gguf import RawLinear
    folder, _, _ = krea_tiny
    path, gguf_pipe = gguf
    ours = mlxdiff.load(str(folder), transformer=str(path), dtype="float32")
    ref = reference(gguf_pipe, **BASE, latents=torch.from_numpy(noise()))
    parity.assert_moves("the Q8_0 rounding", cfg_reference[0], ref[0])      # the file's values, not the folder's
    check_parity(generate(ours), *ref, "Q8_0 GGUF")
    with ours.use(ours.components["transformer"]) as transformer:
        assert isinstance(transformer.transformer_blocks[0].attn.to_q, RawLinear)
