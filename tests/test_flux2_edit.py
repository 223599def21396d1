"""FLUX.2 editing with reference images: mlxdiff against diffusers' Flux2Pipeline (dev) and Flux2KleinPipeline
(klein base, CFG: the references ride in both passes) with one and two references, on the same injected noise
(latents within 1e-4, images within 2 levels; the prompt, the last reference and the guidance each shown to move
diffusers' output: tests/parity.py);
the reference preparation against diffusers' image processor; the memory the references add, bounded by their
token count."""

import gc

import numpy as np
import pytest

import mlxdiff
import mlx.core as mx     # after mlxdiff: its OpenBLAS preload comes first
from mlxdiff.pipelines import image_inputs
from parity import IMAGE_LEVELS, LATENT_TOL, assert_inputs_matter, levels, rel_diff
from twins import H, TAPS, W, build_pipeline, flux2_reference, picture, text_length

PROMPT, OTHER = "a red fox in the snow", "a lighthouse by the sea"


REFS = [picture(64, 72, 1), picture(81, 66, 2)]    # the second is cropped to 80x64 (multiples of 4)


@pytest.fixture(scope="module", params=["klein_base", "dev"])
def saved_pipeline(request, tmp_path_factory):
    return build_pipeline(request.param, tmp_path_factory.mktemp(f"edit_{request.param}"))


@pytest.mark.parametrize("count", [1, 2])
def test_edit_matches_diffusers(saved_pipeline, count):
    kind, folder, pipe = saved_pipeline
    refs, seq = REFS[:count], text_length(kind)
    sized = count == 2        # one reference: the output size defaults to the reference's, as in diffusers
    h, w = (H, W) if sized else (72, 64)
    noise = np.random.default_rng(3).standard_normal((1, 20, h // 4, w // 4)).astype(np.float32)
    size = dict(height=H, width=W) if sized else {}
    base = dict(prompt=PROMPT, image=list(refs), num_inference_steps=2, guidance_scale=3.5, max_sequence_length=seq,
                text_encoder_out_layers=TAPS, **size)
    # the last reference replaced by another picture of its size: each reference's tokens reach the output
    other = refs[:-1] + [picture(refs[-1].width, refs[-1].height, 9)]
    changes = {"the last reference image": dict(image=other)}
    if count == 2:   # the prompt and guidance paths are the same with one reference: shown once, to save runs
        changes.update({"the prompt": dict(prompt=OTHER),
                        "guidance": dict(guidance_scale=5.0)})   # dev: embedded guidance; klein base: CFG's scale
    ref_latents, ref = assert_inputs_matter(lambda **kw: flux2_reference(pipe, noise, **kw), base, changes)
    ours = mlxdiff.load(str(folder)).generate(PROMPT, image=refs if count > 1 else refs[0], steps=2, guidance=3.5,
                                              latents=noise, max_sequence_length=seq, text_encoder_out_layers=TAPS,
                                              progress_bar=False, **size)
    assert ref.shape == (h, w, 3)
    # the latents too: the VAE decode can hide a small error (e.g. a reference's time position)
    assert rel_diff(ours.latents, ref_latents) <= LATENT_TOL
    assert levels(ours.image, ref) <= IMAGE_LEVELS
    assert "reference" in ours.timings and any("reference image" in n for n in ours.notes)


def test_reference_preparation_matches_diffusers():
    """Scaled to 1024x1024 pixels of area (LANCZOS, aspect kept), then centre-cropped to multiples of 16: pixel for
    pixel what Flux2Pipeline's image processing gives, for a large and a small image."""
    from diffusers.pipelines.flux2.image_processor import Flux2ImageProcessor
    processor = Flux2ImageProcessor(vae_scale_factor=16)
    for image in (picture(1100, 1000, 4), picture(100, 75, 5)):
        img = image
        if img.width * img.height > 1024 * 1024:
            img = processor._resize_to_target_area(img, 1024 * 1024)
        width, height = img.width // 16 * 16, img.height // 16 * 16
        theirs = processor.preprocess(img, height=height, width=width, resize_mode="crop").numpy()
        ours = image_inputs.to_array(image_inputs.flux2_reference(image, 16))
        assert ours.shape == theirs.shape
        assert np.array_equal(ours, theirs)


def test_reference_memory_is_bounded_by_its_tokens(saved_pipeline):
    """The memory one reference adds to the denoise phase stays within what its tokens need: per token, the
    activations a block keeps (hidden states of both streams' widths, the MLP's, q/k/v and the attention output:
    at most 16 hidden-widths of float32), plus the attention scores of the longer sequence (heads x L^2 float32),
    twice over for the CFG pass. The "reference" phase (the VAE encoding them, one at a time) holds at most the
    VAE mid-block's attention scores over the largest reference's latent pixels (float32) and 16 activations of
    its pixels at the VAE's widest channel count.
    A phase's "peak" is MLX's active peak in the whole process, so it also counts what the process held before the
    run: arrays earlier tests in this pytest-xdist worker left alive. The clean-clone suite read the 1-image phase
    at 8.6-8.7 MiB, about 3 MiB above its 5.6-5.8 MiB alone (as the 3.2 MB earlier tests left in test_sd3_pipeline's
    worker); alone with a 3 MiB array held it read 8.85 MiB, over 8.44. What the process held before a run: not its."""
    kind, folder, _ = saved_pipeline    # klein base: CFG, two passes over the references; dev: one
    pipe = mlxdiff.load(str(folder))
    args = pipe.components["transformer"].args
    hidden = args.num_attention_heads * args.attention_head_dim
    noise = np.random.default_rng(4).standard_normal((1, 20, H // 4, W // 4)).astype(np.float32)
    kw = dict(width=W, height=H, steps=1, guidance=3.5, latents=noise, max_sequence_length=text_length(kind),
              text_encoder_out_layers=TAPS, progress_bar=False)
    pipe.generate(PROMPT, **kw)                      # warm-up (compiled kernels, caches)
    peaks = {}
    for count in (0, 1, 2):
        gc.collect()
        held = mx.get_active_memory()                # the process's before the run (a run leaves nothing in MLX)
        result = pipe.generate(PROMPT, image=REFS[:count] or None, **kw)
        peaks[count] = result.memory["denoise"]["peak"] - result.memory["denoise"]["floor"] - held
        if count:   # references are encoded one at a time: the phase holds what the largest one needs
            m = result.memory["reference"]
            vae = pipe.components["vae"].args
            f = 2 ** (len(vae.block_out_channels) - 1)
            pixels = max(r.width // 4 * 4 * (r.height // 4 * 4) for r in REFS[:count])
            vae_allowance = 4 * (pixels // f ** 2) ** 2 + 16 * 4 * pixels * max(vae.block_out_channels)
            above = m["peak"] - m["floor"] - held
            print(f"reference phase, {count} image(s): {above / 2**20:.2f} MiB above the VAE weights and the "
                  f"{held / 2**20:.2f} MiB held before the run (allowance {vae_allowance / 2**20:.2f} MiB)")
            assert above <= vae_allowance, (count, above, vae_allowance)
    n_img, n_txt = (H // 4) * (W // 4), text_length(kind)
    tokens = {0: 0, 1: 16 * 18, 2: 16 * 18 + 20 * 16}
    for count in (1, 2):
        longer = n_img + n_txt + tokens[count]
        allowance = 2 * (16 * 4 * hidden * tokens[count]
                         + 4 * args.num_attention_heads * (longer ** 2 - (n_img + n_txt) ** 2))
        extra = peaks[count] - peaks[0]
        print(f"{count} reference(s), {tokens[count]} tokens: denoise peak +{extra / 2**20:.2f} MiB "
              f"(allowance {allowance / 2**20:.2f} MiB)")
        assert extra <= allowance, (count, extra, allowance)
