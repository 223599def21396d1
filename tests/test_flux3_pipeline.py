"""End to end: mlxdiff's FLUX 3 pipeline against diffusers' modular pipelines (Flux3DistilledAutoBlocks here,
Flux3AutoBlocks in test_flux3_files.py; the prompt upsampler popped, as mlxdiff runs without it) on the same injected
noise, at a tiny config: text-to-image and with two reference images; final latents within 1e-4 and images within 2
levels (tests/parity.py), the prompt and each reference shown to move diffusers' output. The folder is written by
ModularPipeline.save_pretrained (modular_model_index.json) and read through mlxdiff.load. A single reference's
padding to its canvas and the crop back, and the one-line refusals."""

import numpy as np
import pytest
import torch

import mlxdiff
from flux3_helpers import H, NOISE, OTHER, PROMPT, REFERENCES, STEPS, TAPS, W, Z, check, reference, save_folder
from mlxdiff.errors import MlxdiffError
from parity import IMAGE_LEVELS, LATENT_TOL, assert_inputs_matter, levels, rel_diff
from twins import picture
import fixture_guard


@pytest.fixture(autouse=True)
def _shared_fixtures_unchanged(request):
    """The module's shared fixtures are left as built (fixture_guard)."""
    yield from fixture_guard.unchanged(request, ["tiny"])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return {"distilled": save_folder("distilled", tmp_path_factory.mktemp("flux3_distilled"))}


def test_distilled_matches_diffusers(tiny):
    folder, pipe = tiny["distilled"]
    runs = {}

    def run_reference(**kw):
        runs[kw["prompt"], tuple(map(id, kw.get("image", [])))] = out = reference(pipe, **kw)
        return out
    # from the run with both references: the prompt, the references (none: text-to-image) and the second reference
    assert_inputs_matter(run_reference, dict(prompt=PROMPT, image=REFERENCES),
                         {"the prompt": dict(prompt=OTHER), "the references": dict(image=[]),
                          "the second reference": dict(image=REFERENCES[:1] + [REFERENCES[0]])})
    ours_pipe = mlxdiff.load(str(folder), keep="all")
    assert ours_pipe.is_distilled
    # text-to-image, and the other prompt with the references: a prompt dropped, swapped or cached wrong cannot match
    check(ours_pipe.generate(PROMPT, width=W, height=H, steps=STEPS, latents=NOISE, text_encoder_out_layers=TAPS,
                             progress_bar=False), runs[PROMPT, ()])
    ours = ours_pipe.generate(OTHER, width=W, height=H, steps=STEPS, latents=NOISE, image=REFERENCES,
                              text_encoder_out_layers=TAPS, progress_bar=False)
    check(ours, runs[OTHER, tuple(map(id, REFERENCES))])
    assert "2 reference images (32x48, 64x48): 288 tokens" in " ".join(ours.notes)


def test_a_single_reference_is_padded_and_cropped_back(tiny):
    """One reference is kept whole: reflect-padded to its 16-pixel canvas (as Flux3ImageProcessor pads it), the
    output size its canvas, the decoded image cropped back to the reference (Flux3DecodeStep): against the modular
    pipeline, the size left out."""
    from diffusers.modular_pipelines.flux3.image_processor import Flux3ImageProcessor
    from mlxdiff.pipelines.flux3.pipeline import fill_reference
    image = picture(45, 37, 3)                     # canvas 64 x 64 (the smallest side is 64)
    want, kwargs = Flux3ImageProcessor().preprocess(image, resize_mode="fill")
    ref = fill_reference(image)
    assert ref.box == kwargs["reference_crop"] and ref.image.size == (64, 64)
    pixels = np.asarray(ref.image).astype(np.float32) / 127.5 - 1
    assert np.abs(pixels.transpose(2, 0, 1)[None] - want.numpy()).max() <= 1e-6
    folder, pipe = tiny["distilled"]
    noise = np.random.default_rng(4).standard_normal((1, 4 * Z, 64 // 4, 64 // 4)).astype(np.float32)
    out = pipe(latents=torch.from_numpy(noise), num_inference_steps=1, text_encoder_out_layers=TAPS, prompt=PROMPT,
               image=image, output_type="np", output=["latents", "images"])
    ours = mlxdiff.load(str(folder)).generate(PROMPT, steps=1, latents=noise, image=image,
                                              text_encoder_out_layers=TAPS, progress_bar=False)
    assert ours.image.size == (45, 37) and out["images"][0].shape == (37, 45, 3)
    assert rel_diff(ours.latents, out["latents"].numpy()) <= LATENT_TOL
    assert levels(ours.image, out["images"][0]) <= IMAGE_LEVELS


def test_bad_requests_are_one_line(tiny):
    folder, _ = tiny["distilled"]
    pipe = mlxdiff.load(str(folder))
    with pytest.raises(MlxdiffError, match="prompt upsampler"):
        pipe.generate(PROMPT, width=W, height=H, steps=1, upsample_prompt=True, progress_bar=False)
    with pytest.raises(MlxdiffError, match="without guidance"):
        pipe.generate(PROMPT, width=W, height=H, steps=1, guidance=3.0, progress_bar=False)
    with pytest.raises(MlxdiffError, match="no negative prompt"):
        pipe.generate(PROMPT, negative_prompt="blurry", width=W, height=H, steps=1, progress_bar=False)
    with pytest.raises(MlxdiffError, match="one prompt per call"):
        pipe.generate([PROMPT, OTHER], width=W, height=H, steps=1, text_encoder_out_layers=TAPS, progress_bar=False)
    with pytest.raises(MlxdiffError, match="joint_attention_dim"):
        pipe.generate(PROMPT, width=W, height=H, steps=1, text_encoder_out_layers=(1, 2), progress_bar=False)
    with pytest.raises(MlxdiffError, match="at least 16 pixels"):
        pipe.generate(PROMPT, width=W, height=H, steps=1, image=[REFERENCES[0], picture(12, 40, 5)],
                      progress_bar=False)
    with pytest.raises(MlxdiffError, match="references, not as an init image"):
        pipe.generate(PROMPT, width=W, height=H, steps=1, image=REFERENCES[0], strength=0.5, progress_bar=False)


