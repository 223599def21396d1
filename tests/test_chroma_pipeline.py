"""End to end: mlxdiff's Chroma pipeline against diffusers' ChromaPipeline / ChromaImg2ImgPipeline on the same
injected noise: true CFG with a negative prompt, no CFG at guidance 1, image-to-image, and T5 with its mask.

diffusers 0.42.1 makes the transformer's text mask a float tensor, which its attention adds to the scores rather than
masking with (diffusers #11724, #12116); the reference runs here get diffusers' own prompt embeddings with that mask
made boolean, as ChromaPipeline's documentation (and Chroma's own code) mean it."""

import numpy as np
import pytest
import torch

import mlxdiff
import parity
from helpers import max_rel_err
from mlxdiff.errors import MlxdiffError
import fixture_guard
from chroma_helpers import H, LATENT, SEQUENCE, W, check_parity, diffusers_prompt, packed_noise, reference_run
from chroma_helpers import chroma_tiny  # noqa: F401  (the fixture)


@pytest.fixture(autouse=True)
def _shared_fixtures_unchanged(request):
    """The module's shared fixtures are left as built (fixture_guard)."""
    yield from fixture_guard.unchanged(request, ['chroma_tiny'])


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
