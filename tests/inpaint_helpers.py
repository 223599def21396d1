"""Shared pieces of the inpainting and outpainting tests: SD3.5 inpainting's reference run (diffusers'
StableDiffusion3InpaintPipeline on the session's tiny SD3.5 folder) and its generator's draws, and the outpainting
canvas built independently of mlxdiff (numpy's edge padding, white over the added pixels)."""

import numpy as np
import PIL.Image
import pytest
import torch

import mlxdiff

H, W = 40, 24                 # the SD3 tiny pipeline's test size (tests/test_sd3_pipeline.py)
SHAPE = (1, 16, H // 2, W // 2)
IMAGE, MASK = (30, 44), (22, 34)      # both resized to 24 x 40 (the output); the mask of another aspect ratio
PROMPT = "a red fox in the snow"
STEPS = 4


def draws(seed):
    """(image_noise, noise): StableDiffusion3InpaintPipeline's first two draws from its generator."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(SHAPE, generator=g).numpy(), torch.randn(SHAPE, generator=g).numpy()


def reference(inpaint, seed, **kw):
    """diffusers' run: (final latents, its VAE's decode of them with the shift (see the module's docstring))."""
    with torch.no_grad():
        latents = inpaint(height=H, width=W, num_inference_steps=STEPS, generator=torch.Generator().manual_seed(seed),
                          output_type="latent", **kw).images
        vae = inpaint.vae
        image = vae.decode(latents / vae.config.scaling_factor + vae.config.shift_factor, return_dict=False)[0]
    return latents.numpy(), inpaint.image_processor.postprocess(image, output_type="np")[0]


@pytest.fixture(scope="module")
def sd3_inpaint(sd3_tiny):
    """(folder, diffusers' StableDiffusion3InpaintPipeline on the fixture's components, mlxdiff's pipeline)."""
    from diffusers import StableDiffusion3InpaintPipeline
    folder, pipe = sd3_tiny
    return folder, StableDiffusion3InpaintPipeline(**pipe.components), mlxdiff.load(str(folder), dtype="float32")


PAD = (4, 6, 0, 4)            # outpainting's left, top, right, bottom


def canvas_of(image, mask=None):
    """The padded canvas (edge pixels) and its mask (white over the padding; inside, `mask` or black), built
    here."""
    left, top, right, bottom = PAD
    pixels = np.asarray(image.convert("RGB"))
    canvas = np.pad(pixels, ((top, bottom), (left, right), (0, 0)), mode="edge")
    inner = np.zeros(pixels.shape[:2], np.uint8) if mask is None else np.asarray(mask.convert("L"))
    full = np.full(canvas.shape[:2], 255, np.uint8)
    full[top:top + pixels.shape[0], left:left + pixels.shape[1]] = inner
    return PIL.Image.fromarray(canvas), PIL.Image.fromarray(full)
