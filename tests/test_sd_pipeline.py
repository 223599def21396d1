"""End to end: mlxdiff's UNet family (SD 1.x, SDXL) against diffusers' StableDiffusionPipeline /
StableDiffusionXLPipeline and their Img2Img twins, on tiny random models saved with save_pretrained (every
dimension distinct), from the same injected noise: images within 2/255, conditioning within 1e-4."""

import numpy as np
import pytest
import torch

import mlxdiff
from conftest import ASSETS, FIXTURES
from helpers import max_rel_err, randomize_
from mlxdiff.errors import MlxdiffError

H, W = 48, 40     # latents 12 x 10 (the VAE's factor is 4 here: two levels... of three: 2**2)


def _clip(with_projection, hidden, layers, heads, inter, projection=None, act="quick_gelu", seed=0):
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection
    config = CLIPTextConfig(vocab_size=49408, hidden_size=hidden, intermediate_size=inter,
                            projection_dim=projection or hidden, num_hidden_layers=layers, num_attention_heads=heads,
                            max_position_embeddings=77, hidden_act=act, bos_token_id=49406, eos_token_id=49407,
                            pad_token_id=1)
    torch.manual_seed(seed)
    return (CLIPTextModelWithProjection if with_projection else CLIPTextModel)(config)


def _tokenizer(pad="<|endoftext|>"):
    from transformers import CLIPTokenizer
    vocab = FIXTURES / "clip" if (FIXTURES / "clip" / "vocab.json").exists() else ASSETS / "clip"
    return CLIPTokenizer(str(vocab / "vocab.json"), str(vocab / "merges.txt"), model_max_length=77, pad_token=pad)


def _vae(scaling, seed):
    from diffusers import AutoencoderKL
    torch.manual_seed(seed)
    return AutoencoderKL(in_channels=3, out_channels=3, block_out_channels=(8, 12, 16), layers_per_block=1,
                         latent_channels=4, norm_num_groups=4, down_block_types=("DownEncoderBlock2D",) * 3,
                         up_block_types=("UpDecoderBlock2D",) * 3, scaling_factor=scaling, sample_size=64)


def sd15_components(scheduler="PNDMScheduler"):
    import diffusers
    from diffusers import UNet2DConditionModel
    torch.manual_seed(0)
    unet = UNet2DConditionModel(
        sample_size=12, in_channels=4, out_channels=4, block_out_channels=(16, 24), norm_num_groups=8,
        layers_per_block=1, down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=20, attention_head_dim=4)
    text_encoder = _clip(False, 20, 2, 4, 36, seed=1)
    vae = _vae(0.18215, 2)
    for i, m in enumerate((unet, text_encoder, vae)):
        randomize_(m, seed=10 + i, scale=0.15)
        m.eval()
    sched = getattr(diffusers, scheduler).from_config(dict(  # SD 1.5's scheduler_config.json
        beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", steps_offset=1, skip_prk_steps=True,
        set_alpha_to_one=False, clip_sample=False))
    return dict(unet=unet, vae=vae, text_encoder=text_encoder, tokenizer=_tokenizer(), scheduler=sched,
                safety_checker=None, feature_extractor=None, requires_safety_checker=False)


def sdxl_components():
    from diffusers import EulerDiscreteScheduler, UNet2DConditionModel
    torch.manual_seed(0)
    text_encoder = _clip(False, 16, 2, 2, 28, seed=1)
    text_encoder_2 = _clip(True, 24, 3, 3, 40, projection=12, act="gelu", seed=2)
    unet = UNet2DConditionModel(
        sample_size=12, in_channels=4, out_channels=4, block_out_channels=(16, 32), norm_num_groups=8,
        layers_per_block=(1, 2), down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), cross_attention_dim=40, attention_head_dim=(2, 4),
        transformer_layers_per_block=(1, 2), use_linear_projection=True, addition_embed_type="text_time",
        addition_time_embed_dim=8, projection_class_embeddings_input_dim=12 + 6 * 8)
    vae = _vae(0.13025, 3)
    for i, m in enumerate((unet, text_encoder, text_encoder_2, vae)):
        randomize_(m, seed=20 + i, scale=0.15)
        m.eval()
    sched = EulerDiscreteScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", steps_offset=1,
                                   timestep_spacing="leading")
    return dict(unet=unet, vae=vae, text_encoder=text_encoder, text_encoder_2=text_encoder_2,
                tokenizer=_tokenizer(), tokenizer_2=_tokenizer("!"), scheduler=sched)


@pytest.fixture(scope="module")
def sd15(tmp_path_factory):
    from diffusers import StableDiffusionPipeline
    folder = tmp_path_factory.mktemp("sd15_tiny")
    StableDiffusionPipeline(**sd15_components()).save_pretrained(str(folder))
    return folder, StableDiffusionPipeline.from_pretrained(str(folder), safety_checker=None,
                                                           requires_safety_checker=False)


@pytest.fixture(scope="module")
def sd2(tmp_path_factory):
    """SD 2.x's shape of the family: linear projections, 64-wide-head-like head counts per level, a v-prediction
    DDIM config (as stable-diffusion-2-1's scheduler_config.json)."""
    import diffusers
    from diffusers import StableDiffusionPipeline, UNet2DConditionModel
    parts = sd15_components()
    torch.manual_seed(0)
    parts["unet"] = randomize_(UNet2DConditionModel(
        sample_size=12, in_channels=4, out_channels=4, block_out_channels=(16, 32), norm_num_groups=8,
        layers_per_block=1, down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=20, attention_head_dim=(2, 4),
        use_linear_projection=True).eval(), seed=13, scale=0.15)
    parts["scheduler"] = diffusers.DDIMScheduler.from_config(dict(
        beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", steps_offset=1, clip_sample=False,
        set_alpha_to_one=False, prediction_type="v_prediction"))
    folder = tmp_path_factory.mktemp("sd2_tiny")
    StableDiffusionPipeline(**parts).save_pretrained(str(folder))
    return folder, StableDiffusionPipeline.from_pretrained(str(folder), safety_checker=None,
                                                           requires_safety_checker=False)


@pytest.fixture(scope="module")
def sdxl(tmp_path_factory):
    from diffusers import StableDiffusionXLPipeline
    folder = tmp_path_factory.mktemp("sdxl_tiny")
    StableDiffusionXLPipeline(**sdxl_components()).save_pretrained(str(folder))
    return folder, StableDiffusionXLPipeline.from_pretrained(str(folder))


def _noise(seed, batch=1):
    return np.random.default_rng(seed).standard_normal((batch, 4, H // 4, W // 4)).astype(np.float32)


def _levels(ours_image, ref):
    """The largest difference in 8-bit levels between our PNG's pixels and diffusers' float image rounded as its PIL
    output is (counted in integers: 2 levels in float32 / 255 can compare above 2 / 255)."""
    ours = np.asarray(ours_image).astype(np.int32)
    assert ours.shape == ref.shape
    return int(np.abs(ours - np.round(ref * 255).astype(np.int32)).max())


def _scheduled(pipe, name):
    """The diffusers pipeline with the scheduler mlxdiff's `name` stands for (same config)."""
    import diffusers
    from mlxdiff import ldm_schedulers
    cls, _, overrides = ldm_schedulers.SCHEDULERS[name]
    plms = {"skip_prk_steps": True} if name == "pndm" else {}     # what mlxdiff's pndm is over another config
    pipe.scheduler = getattr(diffusers, cls).from_config({**pipe.scheduler.config, **overrides, **plms})
    return pipe


CASES = [("sd15", "default", 7.5, "blurry"), ("sd15", "ddim", 1.0, None), ("sd15", "dpmpp_2m_karras", 4.0, None),
         ("sd15", "euler", 6.0, "dark"), ("sdxl", "default", 5.0, None), ("sdxl", "dpmpp_2m", 3.0, "grey"),
         ("sdxl", "euler_karras", 1.0, None), ("sdxl", "pndm", 2.5, None), ("sd2", "default", 6.0, None),
         ("sd2", "euler", 3.0, "fog")]


@pytest.mark.parametrize("model,scheduler,guidance,negative", CASES)
def test_text_to_image_matches_diffusers(request, model, scheduler, guidance, negative):
    folder, pipe = request.getfixturevalue(model)
    if scheduler != "default":
        pipe = _scheduled(pipe, scheduler)
    noise = _noise(1)
    ref = pipe(prompt="a red fox in the snow", negative_prompt=negative, height=H, width=W, num_inference_steps=5,
               guidance_scale=guidance, latents=torch.from_numpy(noise), output_type="np").images[0]
    ours = mlxdiff.load(str(folder)).generate(
        "a red fox in the snow", negative_prompt=negative, width=W, height=H, steps=5, guidance=guidance,
        latents=noise, progress_bar=False, scheduler=None if scheduler == "default" else scheduler)
    assert _levels(ours.image, ref) <= 2
    assert set(ours.timings) == {"encode", "denoise", "decode"}


def test_sdxl_micro_conditioning_matches_diffusers(sdxl):
    folder, pipe = sdxl
    noise = _noise(2)
    sizes = dict(original_size=(512, 768), crops_coords_top_left=(16, 8), target_size=(640, 640),
                 negative_original_size=(256, 256), negative_target_size=(320, 192))
    ref = pipe(prompt="a lighthouse", height=H, width=W, num_inference_steps=4, guidance_scale=4.0,
               latents=torch.from_numpy(noise), output_type="np", **sizes).images[0]
    ours = mlxdiff.load(str(folder)).generate("a lighthouse", width=W, height=H, steps=4, guidance=4.0, latents=noise,
                                              progress_bar=False, **sizes)
    assert _levels(ours.image, ref) <= 2


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


def _img2img_reference(kind, folder, image, strength, seed, steps, scheduler=None):
    """diffusers' Img2Img pipeline with a seeded generator, and the two noises it drew (the posterior's, then the
    noise added to the init latents), to give mlxdiff the same."""
    import diffusers
    cls = diffusers.StableDiffusionXLImg2ImgPipeline if kind == "sdxl" else diffusers.StableDiffusionImg2ImgPipeline
    pipe = cls.from_pretrained(str(folder), **({} if kind == "sdxl" else dict(safety_checker=None,
                                                                               requires_safety_checker=False)))
    if scheduler:
        pipe = _scheduled(pipe, scheduler)
    out = pipe(prompt="a boat", image=image, strength=strength, num_inference_steps=steps, guidance_scale=3.0,
               generator=torch.Generator().manual_seed(seed), output_type="np").images[0]
    drawn = torch.Generator().manual_seed(seed)
    shape = (1, 4, image.height // 4, image.width // 4)
    posterior = torch.randn(shape, generator=drawn).numpy()
    noise = torch.randn(shape, generator=drawn).numpy()
    return out, posterior, noise


@pytest.mark.parametrize("model,strength,scheduler", [("sd15", 0.6, None), ("sdxl", 0.5, "ddim"),
                                                      ("sdxl", 0.3, None)])
def test_image_to_image_matches_diffusers(request, model, strength, scheduler):
    from twins import picture
    folder, _ = request.getfixturevalue(model)
    image = picture(W, H, seed=4)
    ref, posterior, noise = _img2img_reference(model, folder, image, strength, 7, 6, scheduler)
    ours = mlxdiff.load(str(folder)).generate("a boat", image=image, strength=strength, steps=6, guidance=3.0,
                                              latents=noise, image_noise=posterior, progress_bar=False,
                                              scheduler=scheduler)
    assert ours.image.size == (W, H)
    assert _levels(ours.image, ref) <= 2
    assert set(ours.timings) == {"encode", "reference", "denoise", "decode"}


def test_euler_ancestral_is_seeded(sd15):
    """The ancestral sampler's per-step noise comes from the seed: the same seed gives the same image, another seed
    another (its trajectory against diffusers' from the same noise is tests/test_ldm_schedulers.py's)."""
    folder, _ = sd15
    pipe = mlxdiff.load(str(folder))
    run = lambda seed: np.asarray(pipe.generate("a fox", width=W, height=H, steps=3, seed=seed, scheduler="euler_a",
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
    read back) through mlxdiff.load(file): the image equals diffusers' pipeline of the same models."""
    import diffusers
    from safetensors.numpy import save_file
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection
    from test_sd_single_file import BIG_G, CLIP_L, FAMILIES, _checkpoint
    spec = FAMILIES[name]
    real_vocab = dict(vocab_size=49408, max_position_embeddings=77)    # the released tokenizers' ids and length
    torch.manual_seed(0)
    models = {"unet": randomize_(diffusers.UNet2DConditionModel(**spec["unet"]).eval(), seed=1, scale=0.1),
              "vae": randomize_(diffusers.AutoencoderKL(**spec["vae"], scaling_factor=0.13025 if spec["big_g"]
                                                        else 0.18215).eval(), seed=2, scale=0.1),
              "text_encoder": randomize_(CLIPTextModel(CLIPTextConfig(**{**CLIP_L, **real_vocab})).eval(), seed=3,
                                         scale=0.1)}
    if spec["big_g"]:
        models["text_encoder_2"] = randomize_(CLIPTextModelWithProjection(CLIPTextConfig(
            **{**BIG_G, **real_vocab})).eval(), seed=4, scale=0.1)
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
    noise = np.random.default_rng(5).standard_normal((1, 4, h // factor, w // factor)).astype(np.float32)
    ref = pipe(prompt="a red fox", height=h, width=w, num_inference_steps=4, guidance_scale=4.0,
               latents=torch.from_numpy(noise), output_type="np").images[0]
    ours = mlxdiff.load(str(path)).generate("a red fox", width=w, height=h, steps=4, guidance=4.0, latents=noise,
                                            progress_bar=False)
    assert _levels(ours.image, ref) <= 2


def test_step_cache_is_refused_for_the_unet(sd15):
    folder, _ = sd15
    with pytest.raises(MlxdiffError, match="no transformer block sequence to skip") as e:
        mlxdiff.load(str(folder)).generate("a cat", width=32, height=32, steps=2, cache="first-block",
                                           progress_bar=False)
    assert "\n" not in str(e.value)
