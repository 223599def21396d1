"""Input images: FLUX.2 reference images (editing) and the init image of image-to-image, prepared as the pipelines
whose behaviour mlxdiff follows prepare them, then encoded by the family's VAE.

- FLUX.2 references (diffusers' Flux2Pipeline / Flux2KleinPipeline with `image=`): an image larger than 1024x1024
  pixels in area is scaled (LANCZOS, aspect kept) to that area, each side is cut down to a multiple of the VAE
  factor x 2 by a centred crop (never a squash), the pixels go to [-1, 1]; the VAE's latent mean is patchified and
  normalised with the VAE's `bn` statistics, packed into tokens, and reference i gets the position ids
  (t = 10 + 10 i, row, column, 0). The transformer sees [noise tokens, reference tokens] and only the noise tokens'
  output is used.
- SD3.5 img2img (diffusers' StableDiffusion3Img2ImgPipeline): the image resized (LANCZOS) to the output size, a
  sample of the VAE posterior (mean + std x noise, as `latent_dist.sample`), (z - shift) x scaling.
- FLUX.2 img2img (mflux's `--image-path` recipe, see `flux2_img2img_start`): the image, alpha composited over white,
  resized (LANCZOS) to the output size; the latent mean, patchified and normalised as a reference is.
- Latent-blend inpainting (diffusers' ZImageInpaintPipeline, QwenImageInpaintPipeline): the mask as their
  mask_processor prepares it, at the latent size (`latent_mask`); after each step the kept area is put back
  (`inpaint_blend`). `take_mask` is the check both families' check_inputs make.
"""

import math

import numpy as np
import PIL.Image

from .. import backend  # noqa: F401  (OpenBLAS preload before mlx)
import mlx.core as mx

from ..arguments import check_images
from ..errors import MlxdiffError
from ..memory import budget_bytes
from ..pacing import pace
from ..policy import RunPolicy, current

REFERENCE_MAX_AREA = 1024 * 1024      # diffusers' Flux2Pipeline: larger references are scaled to this area
REFERENCE_T_OFFSET = 10               # the time-axis position of reference i: 10 + 10 i (_prepare_image_ids)


def to_array(image) -> np.ndarray:
    """A PIL image -> [1, 3, H, W] float32 in [-1, 1] (diffusers' convert RGB, pil_to_numpy, normalize)."""
    pixels = np.asarray(image.convert("RGB")).astype(np.float32) / 255.0
    return (2.0 * pixels - 1.0).transpose(2, 0, 1)[None]


def flux2_reference(image, multiple):
    """One reference image as diffusers' FLUX.2 pipelines prepare it: scaled to at most REFERENCE_MAX_AREA pixels,
    then centre-cropped so that each side is a multiple of `multiple` (the VAE factor x the patch size)."""
    width, height = image.size
    if width * height > REFERENCE_MAX_AREA:
        scale = math.sqrt(REFERENCE_MAX_AREA / (width * height))
        image = image.resize((int(width * scale), int(height * scale)), PIL.Image.Resampling.LANCZOS)
        width, height = image.size
    w, h = width // multiple * multiple, height // multiple * multiple
    left, top = (width - w) // 2, (height - h) // 2
    return image.crop((left, top, left + w, top + h))


def resized(image, width, height):
    """diffusers' VaeImageProcessor.resize (resize_mode "default"): LANCZOS to exactly width x height."""
    if image.size == (width, height):
        return image
    return image.resize((width, height), resample=PIL.Image.Resampling.LANCZOS, reducing_gap=None)


def over_white(image):
    """mflux's ImageUtil.load_image: an image with transparency composited over opaque white, then RGB."""
    if image.has_transparency_data:
        rgba = (image.convert("LA") if image.mode == "La" else image).convert("RGBA")
        white = PIL.Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return PIL.Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")


def encode_tiling(vae, pixels_shape, dtype) -> bool:
    """Whether an encode must tile: only when an untiled one would not fit the memory budget (diffusers never tiles
    unless asked; the estimate is decode_bytes' for the same latent size, the encoder's widest full-resolution
    activations being of the same order)."""
    factor = 2 ** (len(vae.args.block_out_channels) - 1)
    b, _, h, w = pixels_shape
    return vae.decode_bytes((b, vae.args.latent_channels, h // factor, w // factor), dtype) > \
        budget_bytes(current() or RunPolicy())


def encode_moments(vae, pixels, dtype):
    """VAE (mean, logvar) of [1, 3, H, W] pixels in [-1, 1], within the memory budget (stage by stage, exact conv
    row bands where large; tiles only when even that does not fit)."""
    vae.set_memory_policy(after_stage=pace, band_bytes=(current() or RunPolicy()).conv_band)
    x = mx.array(pixels).astype(dtype)
    mean, logvar = vae.encode_moments(x, tiling=encode_tiling(vae, pixels.shape, dtype))
    mx.eval(mean, logvar)
    return mean, logvar


def flux2_latents(vae, image, dtype):
    """A prepared image -> its FLUX.2 transformer latents [1, 4 * latent channels, H/16, W/16] (float32): the
    posterior's mode, patchified, normalised by the `bn` statistics (Flux2Pipeline._encode_vae_image)."""
    mean, _ = encode_moments(vae, to_array(image), dtype)
    latents = vae.patchify_and_normalize(mean).astype(mx.float32)
    mx.eval(latents)
    return latents


def reference_tokens(vae, images, batch, dtype):
    """Prepared reference images -> (tokens [batch, N_ref, C] float32, position ids [batch, N_ref, 4] int32), in
    the order given (Flux2Pipeline.prepare_image_latents)."""
    tokens, ids = [], []
    for i, image in enumerate(images):
        latents = flux2_latents(vae, image, dtype)                  # [1, C, h, w]
        _, c, h, w = latents.shape
        tokens.append(latents.reshape(c, h * w).transpose(1, 0))
        hh, ww = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
        t = np.full(h * w, REFERENCE_T_OFFSET + REFERENCE_T_OFFSET * i)
        ids.append(np.stack([t, hh.ravel(), ww.ravel(), np.zeros(h * w)], axis=-1))
    tokens = mx.concatenate(tokens, axis=0)
    tokens = mx.broadcast_to(tokens[None], (batch, *tokens.shape))
    ids = np.concatenate(ids, axis=0).astype(np.int32)
    mx.eval(tokens)
    return tokens, mx.array(np.broadcast_to(ids, (batch, *ids.shape)))


def reference_token_count(images, multiple) -> int:
    """Tokens the prepared references add to the transformer's sequence (one per multiple x multiple pixels)."""
    return sum((im.width // multiple) * (im.height // multiple) for im in images)


def sd3_init_latents(vae, image, width, height, dtype, noise):
    """StableDiffusion3Img2ImgPipeline's init latents: the image resized to the output size, a sample of the VAE
    posterior with the given standard-normal `noise` (mean + exp(logvar / 2) * noise), then (z - shift) * scaling."""
    mean, logvar = encode_moments(vae, to_array(resized(image, width, height)), dtype)
    mean, logvar = mean.astype(mx.float32), logvar.astype(mx.float32)
    if tuple(noise.shape) != tuple(mean.shape):
        raise MlxdiffError(f"image_noise has shape {tuple(noise.shape)}, expected {tuple(mean.shape)} (the VAE "
                           "posterior of the resized image)")
    z = mean + mx.exp(0.5 * logvar) * noise
    return vae.scale_latents(z).astype(mx.float32)


def sd3_start(steps, strength) -> int:
    """StableDiffusion3Img2ImgPipeline.get_timesteps: the index of the first step run (steps - that are run)."""
    init_timestep = min(steps * strength, steps)
    return int(max(steps - init_timestep, 0))


def flux2_img2img_start(steps, strength) -> int:
    """FLUX.2 img2img's first step, mflux's `init_time_step` (Config.init_time_step, mflux 0.24) with its
    `--image-strength` s_m = 1 - strength: max(1, int(steps * s_m)), and 0 (pure noise: text-to-image) at
    strength 1, where mflux's image strength 0 turns img2img off. mlxdiff's `strength` keeps diffusers' sense in both
    families (the share of the schedule that is denoised; 1 starts from pure noise), so it is mflux's
    1 - image_strength: mflux `--image-strength 0.4` is mlxdiff `strength=0.6`. steps x (1 - strength) within 1e-9
    of an integer counts as that integer (1 - 0.8 is 0.19999999999999996 in binary; 50 steps at strength 0.8 start
    at step 10, as mflux's 50 x 0.2 does, not at 9)."""
    if strength >= 1:
        return 0
    kept = steps * (1.0 - strength)
    kept = round(kept) if abs(kept - round(kept)) < 1e-9 else int(kept)
    return max(1, kept)


# -- latent-blend inpainting (ZImageInpaintPipeline, QwenImageInpaintPipeline) ------------------------------------
def take_mask(run):
    """check_inputs' part: generate()'s `mask` (run.options) read and checked, only with the one init image ->
    run.state's mask (PIL) and mask_name."""
    if run.options["mask"] is None:
        return
    if not run.images:
        raise MlxdiffError("mask: a mask says where to repaint an image; give image= (--image) too, or leave the "
                           "mask out")
    names, masks = check_images(run.options["mask"])
    if len(masks) > 1:
        raise MlxdiffError(f"mask: {len(masks)} masks; give one mask for the one image")
    run.state.update(mask=masks[0], mask_name=names[0])


def latent_mask(mask, width, height, factor) -> np.ndarray:
    """The inpainting pipelines' mask: their mask_processor (VaeImageProcessor with do_normalize=False,
    do_binarize=True, do_convert_grayscale=True: resized LANCZOS to the output size, then grayscale, in [0, 1],
    binarized at 0.5), then interpolate "nearest" to the latent size, which at a whole factor takes every factor-th
    pixel -> (1, 1, height / factor, width / factor) float32 of 0 and 1 (1: repaint)."""
    values = np.asarray(resized(mask, width, height).convert("L")).astype(np.float32) / 255.0
    return (values >= 0.5).astype(np.float32)[None, None, ::factor, ::factor]


def inpaint_blend(run, i, latents):
    """The step's blend after step i, where run.state has the latent_mask (and the image_latents and the noise, in the
    latents' layout): (1 - mask) * the init latents noised to the next sigma (0 after the last: clean) + mask *
    latents. White repaints, black keeps. Without a mask the latents unchanged."""
    st = run.state
    if "latent_mask" not in st:
        return latents
    mask = st["latent_mask"]
    return (1 - mask) * run.sampler.add_noise(st["image_latents"], st["noise"], i + 1) + mask * latents


def inpaint_note(run, note) -> str:
    """images_note's line with a mask."""
    return note if "mask" not in run.state else f"inpainting where {run.state['mask_name']} is white; {note}"


class LatentInpainting:
    """The step and note hooks of a family that inpaints by blending latents (ZImageInpaintPipeline,
    QwenImageInpaintPipeline): after each step the kept area is the init latents at the next sigma (0: clean).
    Mixed in before Pipeline; the family's encode_images puts the mask's state on the run (inpaint_blend)."""

    def step(self, run, i, x, prediction):
        return inpaint_blend(run, i, super().step(run, i, x, prediction))

    def images_note(self, run, seconds):
        return inpaint_note(run, super().images_note(run, seconds))
