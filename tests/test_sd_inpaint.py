"""UNet-family inpainting: mlxdiff's StableDiffusionPipeline with image= and mask= against diffusers'
StableDiffusionInpaintPipeline (SD 1.5's 9-channel inpainting UNet, and latent blending for a 4-channel UNet) and
StableDiffusionXLInpaintPipeline (latent blending; its 0.9999 default strength and denoising_start), on tiny twins
(tests/ldm_helpers.py) from the same noise: final latents within 1e-4 and images within 2 levels (tests/parity.py),
each input the test claims (the mask, the init image, the prompt, the strength, denoising_start) moving diffusers'
own result by more than the latent tolerance. Outpainting (outpaint=) equals inpainting the canvas built independently
(tests/inpaint_helpers.py), bit for bit, and matches StableDiffusionXLInpaintPipeline on that canvas; mask_blur=
matches diffusers given `mask_processor.blur(mask)`, the blur moving its result; bad outpainting input is one line.

Noise: diffusers' inpainting with `latents=` ignores the init image below strength 1 (it starts from the noise
alone), so below 1 it gets a torch Generator and the test draws what it draws, in its order: the init image's VAE
posterior noise (when the init latents are needed), the noise, then the masked image's posterior noise; mlxdiff takes
them as image_noise=, latents= and masked_image_noise=."""

import re

import numpy as np
import PIL.Image
import PIL.ImageFilter
import pytest
import torch

import fixture_guard
import mlxdiff
from helpers import max_rel_err
from ldm_helpers import reference, sd15_components, sdxl_components, twin_
from mlxdiff.errors import MlxdiffError
from parity import IMAGE_LEVELS, LATENT_TOL, assert_inputs_matter, levels
from twins import picture

H, W = 32, 24               # latents 8 x 6 (the tiny VAE's factor is 4)
SHAPE = (1, 4, H // 4, W // 4)
PROMPT, OTHER = "a red fox in the snow", "a blue boat on a lake"
STEPS = 3


def mask_picture(width, height, flip=False):
    """A white (repaint) rectangle on black, of another size than the output (resized by both sides)."""
    pixels = np.zeros((height, width), np.uint8)
    rows, cols = (slice(height // 5, 3 * height // 5), slice(width // 4, 5 * width // 6))
    pixels[(cols, rows) if flip else (rows, cols)] = 255
    return PIL.Image.fromarray(pixels, mode="L")


MASK, OTHER_MASK = mask_picture(80, 96), mask_picture(80, 96).transpose(PIL.Image.Transpose.FLIP_LEFT_RIGHT)
IMAGE, OTHER_IMAGE = picture(60, 72, seed=4), picture(60, 72, seed=5)


def quiet(pipe):
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """diffusers' twins on one thread for this module (restored after): at these sizes a second intra-op thread only
    waits, and beside MLX's own threads on a busy machine its convolutions ran 20 ms each."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _shared_fixtures_unchanged(request):
    yield from fixture_guard.unchanged(request, ["sd15_inpaint", "sd15", "sdxl", "sdxl_inpaint"])


@pytest.fixture(scope="module")
def parts():
    """The tiny twins' components, built once: the text-to-image and the inpainting folders share all but the UNet
    (saving a pipeline changes none of them)."""
    return {"sd15": sd15_components(), "sdxl": sdxl_components()}


def with_unet(components, in_channels, seed, scale=0.15):
    """The components with a UNet of the same config but `in_channels` (9: an inpainting UNet)."""
    from diffusers import UNet2DConditionModel
    config = {k: v for k, v in components["unet"].config.items() if not k.startswith("_")}
    torch.manual_seed(0)
    return {**components, "unet": twin_(UNet2DConditionModel(**{**config, "in_channels": in_channels}), seed=seed,
                                        scale=scale)}


def saved(tmp_path_factory, name, save_as, run_as, components):
    """(the folder `save_as` writes, diffusers' `run_as` pipeline over the same models)."""
    folder = tmp_path_factory.mktemp(name)
    save_as(**components).save_pretrained(str(folder))
    extra = {"safety_checker": None, "feature_extractor": None, "requires_safety_checker": False} \
        if "text_encoder_2" not in components else {}
    return folder, quiet(run_as(**{**components, **extra}))


@pytest.fixture(scope="module")
def sd15_inpaint(tmp_path_factory, parts):
    """An SD 1.5 inpainting folder (StableDiffusionInpaintPipeline, a 9-channel UNet) and diffusers' pipeline."""
    from diffusers import StableDiffusionInpaintPipeline
    return saved(tmp_path_factory, "sd15_inpaint", StableDiffusionInpaintPipeline, StableDiffusionInpaintPipeline,
                 with_unet(parts["sd15"], 9, seed=17))


@pytest.fixture(scope="module")
def sd15(tmp_path_factory, parts):
    """A text-to-image SD 1.5 folder (4-channel UNet) and diffusers' inpainting pipeline over its models."""
    from diffusers import StableDiffusionInpaintPipeline, StableDiffusionPipeline
    return saved(tmp_path_factory, "sd15_blend", StableDiffusionPipeline, StableDiffusionInpaintPipeline,
                 parts["sd15"])


@pytest.fixture(scope="module")
def sdxl(tmp_path_factory, parts):
    from diffusers import StableDiffusionXLInpaintPipeline, StableDiffusionXLPipeline
    return saved(tmp_path_factory, "sdxl_blend", StableDiffusionXLPipeline, StableDiffusionXLInpaintPipeline,
                 parts["sdxl"])


@pytest.fixture(scope="module")
def sdxl_inpaint(tmp_path_factory, parts):
    """An SDXL inpainting folder (StableDiffusionXLInpaintPipeline with a 9-channel UNet, as
    sdxl-1.0-inpainting-0.1) and diffusers' pipeline."""
    from diffusers import StableDiffusionXLInpaintPipeline
    return saved(tmp_path_factory, "sdxl_inpaint", StableDiffusionXLInpaintPipeline, StableDiffusionXLInpaintPipeline,
                 with_unet(parts["sdxl"], 9, seed=27, scale=0.1))


@pytest.fixture(scope="module")
def ours(sd15_inpaint, sd15, sdxl, sdxl_inpaint):
    """mlxdiff's pipelines of the four folders, built once and kept loaded (keep="all": the runs load nothing
    twice; generate changes nothing else on them)."""
    return {name: mlxdiff.load(str(folder), keep="all")
            for name, (folder, _) in (("inpaint", sd15_inpaint), ("blend", sd15), ("sdxl", sdxl),
                                      ("sdxl_inpaint", sdxl_inpaint))}


def draws(seed, count):
    """The first `count` standard-normal draws of SHAPE from a Generator seeded `seed`, as diffusers makes them."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(SHAPE, generator=g).numpy() for _ in range(count)]


def assert_matches(what, ours, ref_latents, ref_image):
    err, shift = max_rel_err(ours.latents, ref_latents), levels(ours.image, ref_image)
    print(f"{what}: latents max_rel_err {err:.1e}, image {shift} levels")
    assert err <= LATENT_TOL, (what, err)
    assert shift <= IMAGE_LEVELS, (what, shift)


def run_reference(pipe, **kw):
    return lambda **change: reference(pipe, height=H, width=W, num_inference_steps=STEPS, guidance_scale=4.0,
                                      **{**kw, **change})


CHANGES = {"the mask": {"mask_image": OTHER_MASK}, "the init image": {"image": OTHER_IMAGE},
           "the prompt": {"prompt": OTHER}}


def test_inpainting_unet_at_strength_1(sd15_inpaint, ours):
    """The 9-channel UNet from pure noise (diffusers' default strength 1, `latents` given): its one draw is the
    masked image's posterior noise."""
    _, pipe = sd15_inpaint
    noise = np.random.default_rng(1).standard_normal(SHAPE).astype(np.float32)
    (masked_noise,) = draws(3, 1)
    run = run_reference(pipe, latents=torch.tensor(noise))
    ref_latents, ref_image = assert_inputs_matter(
        lambda **kw: run(**kw, generator=torch.Generator().manual_seed(3)),
        dict(prompt=PROMPT, image=IMAGE, mask_image=MASK), CHANGES)
    got = ours["inpaint"].generate(PROMPT, image=IMAGE, mask=MASK, width=W, height=H, steps=STEPS, guidance=4.0,
                                   latents=noise, masked_image_noise=masked_noise, progress_bar=False)
    assert_matches("sd15 inpainting UNet, strength 1", got, ref_latents, ref_image)
    assert got.image.size == (W, H)
    assert any(n.startswith("inpainting where") for n in got.notes), got.notes


def test_inpainting_unet_below_strength_1(sd15_inpaint, ours):
    """strength 0.6: the init latents noised to the first step run; three draws (init posterior, noise, masked
    posterior); the mask and the strength move diffusers' result (the image and the prompt: the test above)."""
    _, pipe = sd15_inpaint
    posterior, noise, masked_noise = draws(5, 3)
    run = run_reference(pipe)
    ref_latents, ref_image = assert_inputs_matter(
        lambda **kw: run(**kw, generator=torch.Generator().manual_seed(5)),
        dict(prompt=PROMPT, image=IMAGE, mask_image=MASK, strength=0.6),
        {"the mask": CHANGES["the mask"], "the strength": {"strength": 0.85}})
    got = ours["inpaint"].generate(PROMPT, image=IMAGE, mask=MASK, strength=0.6, width=W, height=H, steps=STEPS,
                                   guidance=4.0, latents=noise, image_noise=posterior, masked_image_noise=masked_noise,
                                   progress_bar=False)
    assert_matches("sd15 inpainting UNet, strength 0.6", got, ref_latents, ref_image)


@pytest.mark.parametrize("scheduler", [None, "ddim"])
def test_latent_blend_sd15(sd15, ours, scheduler):
    """A 4-channel UNet: after each step the kept area is the init latents at the next step (clean after the
    last), under the folder's PNDM and under DDIM (whose add_noise has no step past the last)."""
    _, pipe = sd15
    posterior, noise = draws(7, 2)
    run = run_reference(pipe, scheduler=scheduler)
    ref_latents, ref_image = assert_inputs_matter(
        lambda **kw: run(**kw, generator=torch.Generator().manual_seed(7)),
        dict(prompt=PROMPT, image=IMAGE, mask_image=MASK, strength=0.75),
        {"the mask": CHANGES["the mask"], "the init image": CHANGES["the init image"]} if scheduler is None else
        {"the mask": CHANGES["the mask"]})
    got = ours["blend"].generate(PROMPT, image=IMAGE, mask=MASK, strength=0.75, width=W, height=H, steps=STEPS,
                                 guidance=4.0, latents=noise, image_noise=posterior, scheduler=scheduler,
                                 progress_bar=False)
    assert_matches(f"sd15 latent blend {scheduler}", got, ref_latents, ref_image)


@pytest.mark.parametrize("case", ["default strength", "denoising_start"])
def test_sdxl_inpainting(sdxl, ours, case):
    """StableDiffusionXLInpaintPipeline: its default strength 0.9999 (int(steps x 0.9999) steps: one fewer, from the
    noised init latents), or denoising_start (from the clean init latents at that share; the noise only blends),
    with its own negative time ids (each negative size, the positive crop)."""
    _, pipe = sdxl
    posterior, noise = draws(9, 2)
    sizes = dict(original_size=(96, 80), crops_coords_top_left=(8, 4), negative_original_size=(64, 64))
    base = dict(prompt=PROMPT, image=IMAGE, mask_image=MASK, **sizes)
    changes = {"the mask": CHANGES["the mask"]}      # the image and the prompt: the SD 1.5 tests'
    if case == "denoising_start":
        base["denoising_start"] = 0.4
        changes["denoising_start"] = {"denoising_start": 0.7}
    else:
        changes["the strength"] = {"strength": 0.6}
        changes["the negative original size"] = {"negative_original_size": None}
    run = run_reference(pipe)
    ref_latents, ref_image = assert_inputs_matter(
        lambda **kw: run(**kw, generator=torch.Generator().manual_seed(9)), base, changes)
    got = ours["sdxl"].generate(PROMPT, image=IMAGE, mask=MASK, width=W, height=H, steps=STEPS, guidance=4.0,
                                latents=noise, image_noise=posterior, progress_bar=False, **sizes,
                                **({"denoising_start": 0.4} if case == "denoising_start" else {}))
    assert_matches(f"sdxl inpainting {case}", got, ref_latents, ref_image)


def test_sdxl_inpainting_unet(sdxl_inpaint, ours):
    """An SDXL 9-channel inpainting UNet (sdxl-1.0-inpainting-0.1's shape) at the 0.9999 default: three draws (the
    init posterior, the noise, the masked image's posterior); the mask and the image move diffusers' result."""
    _, pipe = sdxl_inpaint
    posterior, noise, masked_noise = draws(13, 3)
    run = run_reference(pipe)
    ref_latents, ref_image = assert_inputs_matter(
        lambda **kw: run(**kw, generator=torch.Generator().manual_seed(13)),
        dict(prompt=PROMPT, image=IMAGE, mask_image=MASK),
        {"the mask": CHANGES["the mask"], "the init image": CHANGES["the init image"]})
    got = ours["sdxl_inpaint"].generate(PROMPT, image=IMAGE, mask=MASK, width=W, height=H, steps=STEPS, guidance=4.0,
                                        latents=noise, image_noise=posterior, masked_image_noise=masked_noise,
                                        progress_bar=False)
    assert_matches("sdxl inpainting UNet", got, ref_latents, ref_image)


def test_bad_inpainting_input_is_one_line(ours):
    inpaint, blend = ours["inpaint"], ours["blend"]
    cases = [
        (lambda: inpaint.generate(PROMPT, width=W, height=H, steps=2), "UNet is an inpainting one"),
        (lambda: inpaint.generate(PROMPT, mask=MASK, width=W, height=H, steps=2), "give image= \\(--image\\) too"),
        (lambda: inpaint.generate(PROMPT, image=IMAGE, width=W, height=H, steps=2), "UNet is an inpainting one"),
        (lambda: blend.generate(PROMPT, image=IMAGE, mask=MASK, masked_image_noise=np.zeros(SHAPE, np.float32),
                                width=W, height=H, steps=2), "masked_image_noise: "),
        (lambda: blend.generate(PROMPT, image=IMAGE, mask=MASK, denoising_start=0.5, width=W, height=H, steps=2),
         "denoising_start: SDXL inpainting"),
        (lambda: inpaint.generate(PROMPT, image=IMAGE, mask=MASK, width=W, height=H, steps=2,
                                  masked_image_noise=np.zeros((1, 4, 3, 3), np.float32)),
         "masked_image_noise has shape"),
    ]
    for call, message in cases:
        with pytest.raises(MlxdiffError, match=message) as e:
            call()
        assert "\n" not in str(e.value)


def test_command_line(sd15_inpaint, tmp_path, capsys):
    """--image with --mask inpaints (the output size the model's when none is given, as diffusers' inpainting
    pipelines); --mask without --image, and the 9-channel UNet without a mask, are one line and exit 2."""
    from mlxdiff.generate import main
    folder, _ = sd15_inpaint
    image, mask, out = tmp_path / "image.png", tmp_path / "mask.png", tmp_path / "out.png"
    IMAGE.save(image)
    MASK.save(mask)
    args = ["--model", str(folder), "--prompt", PROMPT, "--steps", "2", "--output", str(out), "--no-progress"]
    assert main(args + ["--image", str(image), "--mask", str(mask)]) == 0
    assert PIL.Image.open(out).size == (48, 48)       # sample_size 12 x the VAE's factor 4
    for extra, message in ((["--mask", str(mask)], "give --image FILE too"),
                           (["--width", str(W), "--height", str(H)], "UNet is an inpainting one")):
        capsys.readouterr()
        assert main(args + extra) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], err


# -- outpainting and mask blur (generate(outpaint=, mask_blur=), --outpaint / --mask-blur) --------------------------
SMALL = picture(20, 22, seed=6)       # padded by inpaint_helpers.PAD (4, 6, 0, 4): 24 x 32, the output size


@pytest.mark.parametrize("name", ["inpaint", "sdxl"])
def test_outpaint_is_inpainting_the_canvas(ours, name):
    """Bit for bit, for the 9-channel UNet and SDXL's latent blending at their default strengths: outpainting (with
    a mask inside and mask_blur on the mask made) equals inpainting the canvas built here (tests/inpaint_helpers.py,
    numpy's edge padding) with its mask blurred by Pillow; the output size defaults to the canvas's."""
    from inpaint_helpers import PAD, canvas_of
    inner = mask_picture(20, 22)
    canvas, canvas_mask = canvas_of(SMALL, inner)
    posterior, noise, masked_noise = draws(21, 3)
    kw = dict(steps=STEPS, guidance=4.0, latents=noise, image_noise=posterior, progress_bar=False,
              **({"masked_image_noise": masked_noise} if name == "inpaint" else {}))
    out = ours[name].generate(PROMPT, image=SMALL, outpaint=PAD, mask=inner, mask_blur=3, **kw)
    inpainted = ours[name].generate(PROMPT, image=canvas, mask=canvas_mask.filter(PIL.ImageFilter.GaussianBlur(3)),
                                    width=W, height=H, **kw)
    assert out.image.size == (W, H)
    assert np.array_equal(out.latents, inpainted.latents)
    assert np.array_equal(np.asarray(out.image), np.asarray(inpainted.image))
    assert any("inpainting where the outpainted border (4, 6, 0, 4 pixels left, top, right, bottom)" in n
               for n in out.notes), out.notes


def test_sdxl_outpaint_matches_diffusers_on_the_canvas(sdxl, ours):
    """StableDiffusionXLInpaintPipeline given the canvas and its mask (its default strength 0.9999); the padding's
    fill (edge pixels, not grey) and the border's width move its result."""
    from inpaint_helpers import PAD, canvas_of
    _, pipe = sdxl
    canvas, canvas_mask = canvas_of(SMALL)
    grey = PIL.Image.new("RGB", (W, H), (127, 127, 127))
    grey.paste(SMALL, PAD[:2])
    narrower = canvas_mask.copy()
    narrower.paste(0, (0, 0, PAD[0], H))       # the left border kept, as a pad of (0, 6, 0, 4) with that fill
    posterior, noise = draws(23, 2)
    run = run_reference(pipe)
    ref_latents, ref_image = assert_inputs_matter(
        lambda **kw: run(**kw, generator=torch.Generator().manual_seed(23)),
        dict(prompt=PROMPT, image=canvas, mask_image=canvas_mask),
        {"the padding's fill": {"image": grey}, "the border": {"mask_image": narrower}})
    got = ours["sdxl"].generate(PROMPT, image=SMALL, outpaint=PAD, steps=STEPS, guidance=4.0, latents=noise,
                                image_noise=posterior, progress_bar=False)
    assert_matches("sdxl outpaint", got, ref_latents, ref_image)


@pytest.mark.parametrize("name", ["inpaint", "sdxl"])
def test_mask_blur_matches_diffusers(sd15_inpaint, sdxl, ours, name):
    """mask_blur=R against diffusers given `mask_processor.blur(mask, blur_factor=R)` as its mask (what diffusers
    offers for a mask blur: its inpaint pipelines take no blur argument), for the 9-channel UNet at strength 1 and
    SDXL's latent blending at 0.9999; the blur moves diffusers' result."""
    _, pipe = sd15_inpaint if name == "inpaint" else sdxl
    radius = 16      # at 12 the tiny latent mask (every 4th pixel of 24 x 32) is the unblurred one
    blurred = pipe.mask_processor.blur(MASK, blur_factor=radius)
    if name == "inpaint":
        noise = np.random.default_rng(2).standard_normal(SHAPE).astype(np.float32)
        (masked_noise,) = draws(25, 1)
        run, extra = run_reference(pipe, latents=torch.tensor(noise)), dict(latents=noise,
                                                                            masked_image_noise=masked_noise)
    else:
        posterior, noise = draws(25, 2)
        run, extra = run_reference(pipe), dict(latents=noise, image_noise=posterior)
    ref_latents, ref_image = assert_inputs_matter(
        lambda **kw: run(**kw, generator=torch.Generator().manual_seed(25)),
        dict(prompt=PROMPT, image=IMAGE, mask_image=blurred), {"the blur": {"mask_image": MASK}})
    got = ours[name].generate(PROMPT, image=IMAGE, mask=MASK, mask_blur=radius, width=W, height=H, steps=STEPS,
                              guidance=4.0, progress_bar=False, **extra)
    assert_matches(f"{name} mask_blur {radius}", got, ref_latents, ref_image)


def test_outpaint_cli_is_the_api(sdxl, ours, tmp_path, capsys):
    """--image --outpaint --mask-blur on SDXL: the API's image at the canvas's size, both in the PNG's metadata."""
    from mlxdiff.generate import main
    folder, _ = sdxl
    image, out = tmp_path / "in.png", tmp_path / "out.png"
    SMALL.save(image)
    args = ["--model", str(folder), "--prompt", PROMPT, "--steps", "2", "--seed", "5", "--no-progress",
            "--output", str(out)]
    assert main(args + ["--image", str(image), "--outpaint", "4,6,0,4", "--mask-blur", "2"]) == 0
    api = ours["sdxl"].generate(PROMPT, image=str(image), outpaint=(4, 6, 0, 4), mask_blur=2, steps=2, seed=5,
                                progress_bar=False)
    cli = PIL.Image.open(out)
    assert cli.size == (W, H) == api.image.size
    assert np.array_equal(np.asarray(cli.convert("RGB")), np.asarray(api.image))
    assert cli.text["mlxdiff:outpaint"] == "4,6,0,4" and cli.text["mlxdiff:mask_blur"] == "2"


def test_bad_outpaint_is_one_line(sdxl, ours, tmp_path, capsys):
    """The other families' refusals of bad outpainting and blur input, on SDXL and the 9-channel UNet: generate()
    raises one line; the CLI exits 2 with one line (its checks, before the model loads)."""
    from mlxdiff.generate import main
    folder, _ = sdxl
    image, out = tmp_path / "in.png", tmp_path / "out.png"
    SMALL.save(image)
    args = ["--model", str(folder), "--prompt", PROMPT, "--steps", "2", "--no-progress", "--output", str(out)]
    for given, needle in ((dict(image=SMALL, outpaint=(-1, 0, 0, 0)), "outpaint=(-1, 0, 0, 0): expected 4 integers"),
                          (dict(image=SMALL, outpaint=(0, 0, 0, 0)), "at least one above 0"),
                          (dict(image=SMALL, outpaint=(0, 0, 4090, 0)), "the 20x22 image padded is 4110x22, past "
                                                                        "4096 pixels a side; pad less"),
                          (dict(outpaint=(4, 0, 0, 0)), "outpaint: pads an image; give image= (--image) too"),
                          (dict(image=SMALL, mask_blur=2), "mask_blur: blurs a mask; give mask= (--mask) or "
                                                           "outpaint=")):
        for pipe in (ours["sdxl"], ours["inpaint"]):
            with pytest.raises(MlxdiffError, match=re.escape(needle)) as e:
                pipe.generate(PROMPT, steps=2, progress_bar=False, **given)
            assert "\n" not in str(e.value), str(e.value)
    for extra, needle in ((["--image", str(image), "--outpaint=-1,0,0,0"], "expected 4 integers"),
                          (["--outpaint", "4,0,0,0"], "--outpaint 4,0,0,0: pads an image; give --image FILE too"),
                          (["--image", str(image), "--mask-blur", "3"], "--mask-blur 3: blurs a mask")):
        capsys.readouterr()
        assert main(args + extra) == 2
        err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert len(err) == 1 and err[0].startswith("mlxdiff: error: ") and needle in err[0], err
        assert not out.exists()
