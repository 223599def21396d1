"""End to end: mlxdiff's UNet family (SD 1.x, SD 2.x, SDXL) against diffusers' StableDiffusionPipeline /
StableDiffusionXLPipeline and their Img2Img twins, on tiny random models saved with save_pretrained (every
dimension distinct; tests/ldm_helpers.py), from the same injected noise: final latents within 1e-4 (float32) and
images within 2 levels (tests/parity.py), conditioning within 1e-4. Each pipeline test proves that every input it
claims to cover reaches diffusers' own result (the prompt, the negative prompt, guidance, the sampler, SDXL's sizes,
the init image, the strength): changed alone, it moves diffusers' latents and image by more than those tolerances.
The shared fixtures' diffusers pipelines are never changed by a test (checked after each one)."""

import numpy as np
import pytest
import torch

import fixture_guard
import mlxdiff
from helpers import max_rel_err
from ldm_helpers import (BIG_G, CLIP_L, FAMILIES, _checkpoint, clip_tokenizer as _tokenizer, reference, sd2_components,
                         sd15_components, sdxl_components, showing_moves, twin_)
from mlxdiff.errors import MlxdiffError
from parity import IMAGE_LEVELS, LATENT_TOL, assert_inputs_matter, levels

H, W = 48, 40     # latents 12 x 10 (the VAE's factor is 4 here: two levels... of three: 2**2)
PROMPT, OTHER_PROMPT = "a red fox in the snow", "a blue boat on a lake"
SHARED = {}       # fixture name -> (its (folder, diffusers pipeline), fixture_guard.state_of it when built)


def _shared(name, folder, pipe):
    SHARED[name] = ((folder, pipe), fixture_guard.state_of((folder, pipe)))
    return folder, pipe


@pytest.fixture(autouse=True)
def shared_pipelines_unchanged():
    """Fixtures are immutable: a test that needs another scheduler builds its own pipeline (ldm_helpers.
    with_scheduler). After each test, every shared fixture built so far (the tests reach most of them through
    request.getfixturevalue, which fixture_guard.unchanged does not see) is as built: folder files, components,
    scheduler config, weights."""
    yield
    for name, (value, state) in SHARED.items():
        assert fixture_guard.state_of(value) == state, f"a test changed the shared {name} fixture"


@pytest.fixture(scope="module")
def sd15(tmp_path_factory):
    from diffusers import StableDiffusionPipeline
    folder = tmp_path_factory.mktemp("sd15_tiny")
    StableDiffusionPipeline(**sd15_components()).save_pretrained(str(folder))
    return _shared("sd15", folder, StableDiffusionPipeline.from_pretrained(str(folder), safety_checker=None,
                                                                           requires_safety_checker=False))


@pytest.fixture(scope="module")
def sd2(tmp_path_factory):
    from diffusers import StableDiffusionPipeline
    folder = tmp_path_factory.mktemp("sd2_tiny")
    StableDiffusionPipeline(**sd2_components()).save_pretrained(str(folder))
    return _shared("sd2", folder, StableDiffusionPipeline.from_pretrained(str(folder), safety_checker=None,
                                                                          requires_safety_checker=False))


@pytest.fixture(scope="module")
def sdxl(tmp_path_factory):
    from diffusers import StableDiffusionXLPipeline
    folder = tmp_path_factory.mktemp("sdxl_tiny")
    StableDiffusionXLPipeline(**sdxl_components()).save_pretrained(str(folder))
    return _shared("sdxl", folder, StableDiffusionXLPipeline.from_pretrained(str(folder)))


def _noise(seed, batch=1, h=H, w=W, factor=4):
    return np.random.default_rng(seed).standard_normal((batch, 4, h // factor, w // factor)).astype(np.float32)


def assert_matches(what, ours, ref_latents, ref_image):
    """mlxdiff's Result against diffusers' run: the final latents (both scaled, before the VAE undoes its scaling)
    within LATENT_TOL, the image within IMAGE_LEVELS."""
    err, shift = max_rel_err(ours.latents, ref_latents), levels(ours.image, ref_image)
    print(f"{what}: latents max_rel_err {err:.1e}, image {shift} levels")
    assert err <= LATENT_TOL, (what, err)
    assert shift <= IMAGE_LEVELS, (what, shift)


STEPS = 4
CASES = [("sd15", "default", 7.5, "blurry"), ("sd15", "ddim", 1.0, None), ("sd15", "dpmpp_2m_karras", 4.0, None),
         ("sd15", "euler", 6.0, "dark"), ("sdxl", "default", 5.0, None), ("sdxl", "dpmpp_2m", 3.0, "grey"),
         ("sdxl", "euler_karras", 1.0, None), ("sdxl", "pndm", 2.5, None), ("sd2", "default", 6.0, None),
         ("sd2", "euler", 3.0, "fog")]


@pytest.mark.parametrize("model,scheduler,guidance,negative", CASES)
def test_text_to_image_matches_diffusers(request, model, scheduler, guidance, negative):
    """The prompt always; the negative prompt where the case has one (dropped: SD encodes "", SDXL zeros); guidance
    where CFG runs (its uncond branch); the sampler where the case names one (against the folder's own)."""
    folder, pipe = request.getfixturevalue(model)
    noise = _noise(1)
    named = None if scheduler == "default" else scheduler
    run = lambda **kw: reference(pipe, height=H, width=W, num_inference_steps=STEPS, latents=torch.tensor(noise),
                                 **kw)
    changes = {"the prompt": {"prompt": OTHER_PROMPT}}
    if negative:
        changes["the negative prompt"] = {"negative_prompt": None}
    if guidance > 1:
        changes["guidance"] = {"guidance_scale": guidance + 2}
    if named:
        changes["the sampler"] = {"scheduler": None}
    run = showing_moves(f"{model} {scheduler}", run)
    ref_latents, ref_image = assert_inputs_matter(run, dict(prompt=PROMPT, negative_prompt=negative,
                                                            guidance_scale=guidance, scheduler=named), changes)
    ours = mlxdiff.load(str(folder)).generate(PROMPT, negative_prompt=negative, width=W, height=H, steps=STEPS,
                                              guidance=guidance, latents=noise, progress_bar=False, scheduler=named)
    assert_matches(f"{model} {scheduler}", ours, ref_latents, ref_image)
    assert set(ours.timings) == {"encode", "denoise", "decode"}


def test_sdxl_micro_conditioning_matches_diffusers(sdxl):
    """Each of SDXL's sizes reaches the UNet's added time ids in its place: original and target size swapped,
    original_size's height and width swapped, the crop moved, the negative sizes dropped (CFG's uncond ids) each
    move diffusers' result."""
    folder, pipe = sdxl
    noise = _noise(2)
    sizes = dict(original_size=(512, 768), crops_coords_top_left=(16, 8), target_size=(640, 640),
                 negative_original_size=(256, 256), negative_target_size=(320, 192))
    run = lambda **kw: reference(pipe, prompt="a lighthouse", height=H, width=W, num_inference_steps=STEPS,
                                 guidance_scale=4.0, latents=torch.tensor(noise), **kw)
    ref_latents, ref_image = assert_inputs_matter(showing_moves("sdxl sizes", run), sizes, {
        "original and target size swapped": {"original_size": (640, 640), "target_size": (512, 768)},
        "original_size's height and width": {"original_size": (768, 512)},
        "crops_coords_top_left": {"crops_coords_top_left": (8, 16)},
        "the negative sizes": {"negative_original_size": None, "negative_target_size": None}})
    ours = mlxdiff.load(str(folder)).generate("a lighthouse", width=W, height=H, steps=STEPS, guidance=4.0,
                                              latents=noise, progress_bar=False, **sizes)
    assert_matches("sdxl sizes", ours, ref_latents, ref_image)


@pytest.mark.parametrize("model,clip_skip", [("sd15", None), ("sd15", 1), ("sdxl", None), ("sdxl", 1)])
def test_encode_prompt_matches_diffusers(request, model, clip_skip):
    folder, pipe = request.getfixturevalue(model)
    ours = mlxdiff.load(str(folder)).encode_prompt("a cat on a mat " * 12, "a dog", clip_skip=clip_skip).as_numpy()
    if model == "sd15" and clip_skip:   # diffusers reaches text_encoder.text_model, gone in transformers 5: its steps
        ids = pipe.tokenizer(["a cat on a mat " * 12, "a dog"], padding="max_length", max_length=77,
                             truncation=True, return_tensors="pt").input_ids
        with torch.no_grad():
            out = pipe.text_encoder(ids, output_hidden_states=True)
            ref = {"prompt_embeds": pipe.text_encoder.text_model.final_layer_norm(
                       out.hidden_states[-(clip_skip + 1)][:1]) if hasattr(pipe.text_encoder, "text_model") else
                   pipe.text_encoder.final_layer_norm(out.hidden_states[-(clip_skip + 1)][:1]),
                   "negative_prompt_embeds": out.last_hidden_state[1:]}
    elif model == "sd15":
        ref = dict(zip(("prompt_embeds", "negative_prompt_embeds"), pipe.encode_prompt(
            "a cat on a mat " * 12, "cpu", 1, True, "a dog", clip_skip=clip_skip)))
    else:
        ref = dict(zip(("prompt_embeds", "negative_prompt_embeds", "pooled_prompt_embeds",
                        "negative_pooled_prompt_embeds"), pipe.encode_prompt(
            "a cat on a mat " * 12, negative_prompt="a dog", clip_skip=clip_skip)))
    for name, value in ref.items():
        assert max_rel_err(ours[name], value.detach().numpy()) <= 1e-4, name


def _img2img_pipe(kind, folder):
    import diffusers
    if kind == "sdxl":
        return diffusers.StableDiffusionXLImg2ImgPipeline.from_pretrained(str(folder))
    return diffusers.StableDiffusionImg2ImgPipeline.from_pretrained(str(folder), safety_checker=None,
                                                                    requires_safety_checker=False)


def _drawn(seed, shape):
    """The two noises diffusers' Img2Img pipeline draws from a generator seeded `seed` (the posterior's, then the
    noise added to the init latents), to give mlxdiff the same."""
    drawn = torch.Generator().manual_seed(seed)
    posterior = torch.randn(shape, generator=drawn).numpy()
    return posterior, torch.randn(shape, generator=drawn).numpy()


@pytest.mark.parametrize("model,strength,scheduler", [("sd15", 0.6, None), ("sdxl", 0.5, "ddim"),
                                                      ("sdxl", 0.3, None)])
def test_image_to_image_matches_diffusers(request, model, strength, scheduler):
    """The prompt, the init image, the strength and (where named) the sampler each move diffusers' result."""
    from twins import picture
    folder, _ = request.getfixturevalue(model)
    pipe, image, steps = _img2img_pipe(model, folder), picture(W, H, seed=4), 6
    run = lambda **kw: reference(pipe, num_inference_steps=steps, guidance_scale=3.0,
                                 generator=torch.Generator().manual_seed(7), **kw)
    changes = {"the prompt": {"prompt": OTHER_PROMPT}, "the init image": {"image": picture(W, H, seed=5)},
               "the strength": {"strength": strength + 0.2}}
    if scheduler:
        changes["the sampler"] = {"scheduler": None}
    run = showing_moves(f"{model} img2img {strength}", run)
    ref_latents, ref_image = assert_inputs_matter(run, dict(prompt="a boat", image=image, strength=strength,
                                                            scheduler=scheduler), changes)
    posterior, noise = _drawn(7, (1, 4, H // 4, W // 4))
    ours = mlxdiff.load(str(folder)).generate("a boat", image=image, strength=strength, steps=steps, guidance=3.0,
                                              latents=noise, image_noise=posterior, progress_bar=False,
                                              scheduler=scheduler)
    assert ours.image.size == (W, H)
    assert_matches(f"{model} img2img {strength}", ours, ref_latents, ref_image)
    assert set(ours.timings) == {"encode", "reference", "denoise", "decode"}


def test_euler_ancestral_is_seeded(sd15):
    """The ancestral sampler's per-step noise comes from the seed: the same seed gives the same image, another seed
    another (its trajectory against diffusers' from the same noise is tests/test_ldm_schedulers.py's)."""
    folder, _ = sd15
    pipe = mlxdiff.load(str(folder))
    # 2 steps: the first adds the ancestral noise (the last, to sigma 0, adds none)
    run = lambda seed: np.asarray(pipe.generate("a fox", width=W, height=H, steps=2, seed=seed, scheduler="euler_a",
                                                progress_bar=False).image)
    first, again, other = run(3), run(3), run(4)
    assert np.array_equal(first, again) and not np.array_equal(first, other)


def test_bad_requests_are_one_line(sd15, sdxl):
    sd_pipe, xl_pipe = mlxdiff.load(str(sd15[0])), mlxdiff.load(str(sdxl[0]))
    with pytest.raises(MlxdiffError, match="scheduler='dpm_5m' does not exist; use one of euler"):
        sd_pipe.generate("a", width=W, height=H, steps=2, scheduler="dpm_5m")
    with pytest.raises(MlxdiffError, match="original_size: SDXL's micro-conditioning; this is an SD 1.x"):
        sd_pipe.generate("a", width=W, height=H, steps=2, original_size=(64, 64))
    with pytest.raises(MlxdiffError, match=r"target_size=\(0, 64\): expected two whole numbers"):
        xl_pipe.generate("a", width=W, height=H, steps=2, target_size=(0, 64))
    with pytest.raises(MlxdiffError, match="skip_guidance_layers: an option of SD3.5 models only"):
        xl_pipe.generate("a", width=W, height=H, steps=2, skip_guidance_layers=[1])
    with pytest.raises(MlxdiffError, match="width and height must be positive multiples of 4"):
        sd_pipe.generate("a", width=42, height=H, steps=2)


@pytest.mark.parametrize("name", ["sd15", "sdxl"])
def test_single_file_pipeline_matches_diffusers(name, tmp_path):
    """An original single file (ldm / SGM names, as tests/test_sd_single_file.py writes and diffusers' converters
    read back) through mlxdiff.load(file): the latents and image of diffusers' pipeline of the same models (the
    released model's scheduler, as mlxdiff reads the file), whose result the prompt and guidance each move."""
    import diffusers
    from safetensors.numpy import save_file
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection
    spec = FAMILIES[name]
    real_vocab = dict(vocab_size=49408, max_position_embeddings=77)    # the released tokenizers' ids and length
    torch.manual_seed(0)
    models = {"unet": twin_(diffusers.UNet2DConditionModel(**spec["unet"]), seed=1, scale=0.1),
              "vae": twin_(diffusers.AutoencoderKL(**spec["vae"], scaling_factor=0.13025 if spec["big_g"]
                                                   else 0.18215), seed=2, scale=0.1),
              "text_encoder": twin_(CLIPTextModel(CLIPTextConfig(**{**CLIP_L, **real_vocab})), seed=3, scale=0.1)}
    if spec["big_g"]:
        models["text_encoder_2"] = twin_(CLIPTextModelWithProjection(CLIPTextConfig(**{**BIG_G, **real_vocab})),
                                         seed=4, scale=0.1)
    path = tmp_path / f"{name}.safetensors"
    save_file(_checkpoint(models, spec), str(path))
    from mlxdiff.pipelines.stable_diffusion.single_file import sd_single_file
    scheduler = sd_single_file(path).scheduler_config      # the released model's, as mlxdiff reads the file
    sched = getattr(diffusers, scheduler["_class_name"]).from_config(
        {k: v for k, v in scheduler.items() if not k.startswith("_")})
    if spec["big_g"]:
        pipe = diffusers.StableDiffusionXLPipeline(**models, tokenizer=_tokenizer(), tokenizer_2=_tokenizer("!"),
                                                   scheduler=sched)
    else:
        pipe = diffusers.StableDiffusionPipeline(**models, tokenizer=_tokenizer(), scheduler=sched,
                                                 safety_checker=None, feature_extractor=None,
                                                 requires_safety_checker=False)
    factor = 2 ** (len(spec["vae"]["block_out_channels"]) - 1)
    h, w = 32, 24          # multiples of 8 (diffusers' check) and of the VAE's factor
    noise = _noise(5, h=h, w=w, factor=factor)
    run = lambda **kw: reference(pipe, height=h, width=w, num_inference_steps=STEPS, latents=torch.tensor(noise),
                                 **kw)
    ref_latents, ref_image = assert_inputs_matter(showing_moves(f"{name} single file", run),
                                                  dict(prompt="a red fox", guidance_scale=4.0), {
        "the prompt": {"prompt": OTHER_PROMPT}, "guidance": {"guidance_scale": 6.0}})
    ours = mlxdiff.load(str(path)).generate("a red fox", width=w, height=h, steps=STEPS, guidance=4.0, latents=noise,
                                            progress_bar=False)
    assert_matches(f"{name} single file", ours, ref_latents, ref_image)


def test_step_cache_is_refused_for_the_unet(sd15):
    folder, _ = sd15
    with pytest.raises(MlxdiffError, match="no transformer block sequence to skip") as e:
        mlxdiff.load(str(folder)).generate("a cat", width=32, height=32, steps=2, cache="first-block",
                                           progress_bar=False)
    assert "\n" not in str(e.value)
