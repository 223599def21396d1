"""End to end: mlxdiff's Chroma pipeline against diffusers' ChromaPipeline / ChromaImg2ImgPipeline on the same
injected noise: true CFG with a negative prompt, no CFG at guidance 1, image-to-image, and T5 with its mask.

diffusers 0.42.1 makes the transformer's text mask a float tensor, which its attention adds to the scores rather than
masking with (diffusers #11724, #12116); the reference runs here get diffusers' own prompt embeddings with that mask
made boolean, as ChromaPipeline's documentation (and Chroma's own code) mean it."""

import numpy as np
import pytest
import torch

import mlxdiff
from conftest import ASSETS, FIXTURES
import parity
from helpers import max_rel_err, randomize_
from mlxdiff.errors import MlxdiffError
import fixture_guard

H, W = 40, 24      # non-square; multiples of 2 (the VAE) x 2 (the patches)
LATENT = 5
SEQUENCE = 40      # T5 tokens: short prompts leave padding to mask


@pytest.fixture(autouse=True)
def _shared_fixtures_unchanged(request):
    """The module's shared fixtures are left as built (fixture_guard)."""
    yield from fixture_guard.unchanged(request, ['chroma_tiny'])


def chroma_components(seed=0):
    """A tiny ChromaPipeline, every dimension distinct: T5 44 wide, a transformer 48 wide (3 heads of 16, RoPE axes
    4, 6, 6; approximator 28 wide over 12 input channels), a 5-channel VAE, FLUX.1-dev's scheduler."""
    from diffusers import AutoencoderKL, ChromaTransformer2DModel, FlowMatchEulerDiscreteScheduler
    from transformers import T5Config, T5EncoderModel, T5TokenizerFast
    torch.manual_seed(seed)
    t5 = T5EncoderModel(T5Config(
        vocab_size=32128, d_model=44, d_kv=10, d_ff=60, num_layers=2, num_heads=3, feed_forward_proj="gated-gelu",
        relative_attention_num_buckets=10, relative_attention_max_distance=24))
    transformer = ChromaTransformer2DModel(
        patch_size=1, in_channels=4 * LATENT, num_layers=2, num_single_layers=2, attention_head_dim=16,
        num_attention_heads=3, joint_attention_dim=44, axes_dims_rope=(4, 6, 6), approximator_num_channels=12,
        approximator_hidden_dim=28, approximator_layers=2)
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, block_out_channels=(8, 12), layers_per_block=1, latent_channels=LATENT,
        norm_num_groups=4, down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
        scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False)
    for i, m in enumerate((t5, transformer, vae)):
        randomize_(m, seed=seed * 10 + i, scale=0.15)
        m.eval()
    t5_file = FIXTURES / "t5" if (FIXTURES / "t5" / "tokenizer.json").exists() else ASSETS / "t5"
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                                                base_image_seq_len=256, max_image_seq_len=4096)
    return dict(transformer=transformer, vae=vae, text_encoder=t5, scheduler=scheduler,
                tokenizer=T5TokenizerFast(tokenizer_file=str(t5_file / "tokenizer.json"), model_max_length=512))


@pytest.fixture(scope="module")
def chroma_tiny(tmp_path_factory):
    from diffusers import ChromaPipeline
    folder = tmp_path_factory.mktemp("chroma_pipe")
    ChromaPipeline(**chroma_components()).save_pretrained(str(folder))
    return folder, ChromaPipeline.from_pretrained(str(folder))


def diffusers_prompt(pipe, prompt):
    """diffusers' own T5 embeddings and mask for a prompt, the mask made boolean (see the module's note)."""
    with torch.no_grad():
        embeds, mask = pipe._get_t5_prompt_embeds(prompt, max_sequence_length=SEQUENCE)
    return embeds, mask > 0


def packed_noise(seed):
    return np.random.default_rng(seed).standard_normal((1, (H // 4) * (W // 4), 4 * LATENT)).astype(np.float32)


def test_encode_prompt_matches_diffusers(chroma_tiny):
    folder, pipe = chroma_tiny
    ours = mlxdiff.load(str(folder))
    for prompt in ("a cat", "a very long prompt " * 12):       # the second is cut at SEQUENCE tokens
        embeds, mask = diffusers_prompt(pipe, prompt)
        got = ours.encode_prompt(prompt, max_sequence_length=SEQUENCE).as_numpy()
        assert max_rel_err(got["prompt_embeds"], embeds.numpy()) <= 1e-4
        assert np.array_equal(got["prompt_attention_mask"] > 0, mask.numpy())
    # T5's own padding mask matters: without it the embeddings differ
    with torch.no_grad():
        ids = pipe.tokenizer("a cat", padding="max_length", max_length=SEQUENCE, return_tensors="pt").input_ids
        unmasked = pipe.text_encoder(ids)[0].numpy()
    assert max_rel_err(unmasked, diffusers_prompt(pipe, "a cat")[0].numpy()) > 1e-3


def reference_run(pipe, noise=None, prompt=None, negative_prompt=None, generator_seed=None, **kw):
    """One diffusers run on its own prompt embeddings (mask made boolean) from the packed noise, or from a generator
    seeded afresh: (its final latents, unpacked to the VAE's layout, from the step callback; its image in [0, 1])."""
    final = {}

    def keep_latents(_, i, t, tensors):
        final["latents"] = tensors["latents"]
        return {}
    pe, pm = diffusers_prompt(pipe, prompt)
    if negative_prompt is not None:
        kw["negative_prompt_embeds"], kw["negative_prompt_attention_mask"] = diffusers_prompt(pipe, negative_prompt)
    if noise is not None:
        kw["latents"] = torch.from_numpy(noise)
    if generator_seed is not None:
        kw["generator"] = torch.Generator().manual_seed(generator_seed)
    image = pipe(prompt_embeds=pe, prompt_attention_mask=pm, height=H, width=W, output_type="np",
                 callback_on_step_end=keep_latents, **kw).images[0]
    return pipe._unpack_latents(final["latents"], H, W, pipe.vae_scale_factor).numpy(), image


def check_parity(result, ref_latents, ref_image, what):
    """mlxdiff's latents within LATENT_TOL of diffusers', its image within IMAGE_LEVELS."""
    err = max_rel_err(result.latents, ref_latents)
    shift = parity.levels(result.image, ref_image)
    print(f"{what}: latents max_rel_err {err:.2e}, image {shift}/255")
    assert err <= parity.LATENT_TOL and shift <= parity.IMAGE_LEVELS
    return err


@pytest.mark.parametrize("guidance", [4.0, 1.0])
def test_pipeline_matches_diffusers(chroma_tiny, guidance):
    """True CFG at 4 (the prompt, the negative prompt and the scale each move diffusers' result) and no CFG at 1
    (the prompt moves it)."""
    folder, pipe = chroma_tiny
    noise = packed_noise(1)
    prompt, negative = "a red fox in the snow", "blurry, low quality"
    base = dict(prompt=prompt, num_inference_steps=3, guidance_scale=guidance)
    changes = {"the prompt": dict(prompt="a blue car in the desert")}
    if guidance > 1:
        base["negative_prompt"] = negative
        changes.update({"the negative prompt": dict(negative_prompt="sharp, vivid colours"),
                        "the CFG scale": dict(guidance_scale=2.0)})
    ref_latents, ref = parity.assert_inputs_matter(lambda **kw: reference_run(pipe, noise, **kw), base, changes)
    result = mlxdiff.load(str(folder)).generate(prompt, negative_prompt=negative, steps=3, guidance=guidance,
                                               width=W, height=H, latents=noise, max_sequence_length=SEQUENCE,
                                               progress_bar=False)
    check_parity(result, ref_latents, ref, f"Chroma guidance {guidance}")


def test_img2img_matches_diffusers(chroma_tiny):
    """The init image, the strength and the prompt each move diffusers' result."""
    from diffusers import ChromaImg2ImgPipeline
    from PIL import Image
    folder, pipe = chroma_tiny
    img_pipe = ChromaImg2ImgPipeline(**pipe.components)
    # ChromaImg2ImgPipeline casts even a boolean mask to float (added to the scores); ChromaPipeline's extension
    # keeps it boolean, as the mask is meant
    img_pipe._prepare_attention_mask = lambda **kw: type(pipe)._prepare_attention_mask(img_pipe, **kw)

    def picture(seed):
        return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (H // 4, W // 4, 3), dtype=np.uint8)
                               ).resize((W, H), Image.Resampling.BILINEAR)
    # diffusers draws from its generator the VAE posterior's sample, then the noise (given latents would be taken as
    # the start itself); ours is handed both
    g, shape = torch.Generator().manual_seed(8), (1, LATENT, H // 2, W // 2)
    image_noise, noise = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    noise = pipe._pack_latents(noise, 1, LATENT, H // 2, W // 2).numpy()
    base = dict(prompt="a fox", image=picture(3), strength=0.7, guidance_scale=1.0, num_inference_steps=4,
                generator_seed=8)
    changes = {"the init image": dict(image=picture(13)), "the strength": dict(strength=0.45),
               "the prompt": dict(prompt="a lighthouse")}
    ref_latents, ref = parity.assert_inputs_matter(lambda **kw: reference_run(img_pipe, **kw), base, changes)
    result = mlxdiff.load(str(folder)).generate("a fox", image=base["image"], strength=0.7, guidance=1.0, steps=4,
                                               width=W, height=H, latents=noise, image_noise=image_noise.numpy(),
                                               max_sequence_length=SEQUENCE, progress_bar=False)
    check_parity(result, ref_latents, ref, "Chroma img2img")


def test_defaults_and_refusals(chroma_tiny):
    folder, _ = chroma_tiny
    pipe = mlxdiff.load(str(folder))
    assert pipe.defaults() == {"steps": 35, "guidance": 5.0}       # ChromaPipeline's
    with pytest.raises(MlxdiffError, match="FLUX.1"):
        pipe.generate("a cat", steps=1, width=W, height=H, true_cfg_scale=2.0)
    with pytest.raises(MlxdiffError, match="FLUX.1"):
        pipe.generate("a cat", steps=1, width=W, height=H, mask="x.png")
