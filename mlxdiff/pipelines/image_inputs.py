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
- Masks (every family that takes one): `take_mask` is the check their check_inputs make: the mask read (any size),
  blurred as diffusers' VaeImageProcessor.blur (`mask_blur`), outpainting's canvas and mask made (`outpaint`:
  `outpaint_canvas`), an all-black mask refused, a mask of another aspect ratio noted (resized all the same, as
  diffusers does). The inpaint pipelines' mask_processor is `binary_mask` (resized to the output size, grayscale,
  binarized at 0.5); the latent mask is it at every factor-th pixel (`latent_mask`: interpolate "nearest";
  SD3.5, FLUX.1, Z-Image, Qwen-Image) or interpolated bilinearly to the token grid (`bilinear_mask`: FLUX.2 klein).
- Qwen-Image-Edit's and Qwen-Image 2.1's condition images: `calculate_dimensions` (their ~1 MP sizes),
  `expand_image_pads` (the Qwen-VL processors' <|image_pad|> expansion), `image_digest` (the prompt cache's key).
- Latent-blend inpainting (diffusers' StableDiffusion3InpaintPipeline, FluxInpaintPipeline,
  Flux2KleinInpaintPipeline, ZImageInpaintPipeline, QwenImageInpaintPipeline): after each step the kept area is put
  back (`inpaint_blend`, the `LatentInpainting` mixin's step).
"""

import hashlib
import math

import numpy as np
import PIL.Image
import PIL.ImageFilter

from .. import backend  # noqa: F401  (OpenBLAS preload before mlx)
import mlx.core as mx

from ..arguments import MAX_SIZE, check_images, check_number, check_outpaint
from ..errors import MlxdiffError
from ..memory import budget_bytes
from ..pacing import pace
from ..policy import RunPolicy, current, current_dtype

REFERENCE_MAX_AREA = 1024 * 1024      # diffusers' Flux2Pipeline: larger references are scaled to this area
REFERENCE_T_OFFSET = 10               # the time-axis position of reference i: 10 + 10 i (_prepare_image_ids)


IMAGE_PAD = "<|image_pad|>"           # the Qwen-VL processors' image placeholder token


def calculate_dimensions(target_area, ratio) -> tuple:
    """diffusers' calculate_dimensions (QwenImageEdit*Pipeline, QwenImage21Pipeline): (width, height) of about
    `target_area` pixels at aspect `ratio` (w / h), each rounded to a multiple of 32."""
    width = math.sqrt(target_area * ratio)
    height = width / ratio
    return round(width / 32) * 32, round(height / 32) * 32


def expand_image_pads(text, counts) -> str:
    """Qwen2VLProcessor's / Qwen3VLProcessor's expansion: the i-th <|image_pad|> repeated as many times as image i
    has merged tokens."""
    parts = text.split(IMAGE_PAD)
    if len(parts) - 1 != len(counts):
        raise MlxdiffError(f"the prompt holds {len(parts) - 1} {IMAGE_PAD} tokens for {len(counts)} images; leave "
                           f"{IMAGE_PAD} out of the prompt")
    return parts[0] + "".join(IMAGE_PAD * n + part for n, part in zip(counts, parts[1:]))


def image_digest(images) -> str:
    """What the prompt cache keys the images by: their sizes, modes and pixels."""
    digest = hashlib.sha1()
    for image in images:
        digest.update(repr((image.size, image.mode)).encode())
        digest.update(np.asarray(image).tobytes())
    return digest.hexdigest()


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


def encode_tiling(vae, pixels) -> bool:
    """Whether an encode must tile: only when an untiled one would not fit the memory budget (diffusers never tiles
    unless asked; the estimate is decode_bytes' for the same latent size, the encoder's widest full-resolution
    activations being of the same order), in the pixels' dtype."""
    factor = 2 ** (len(vae.args.block_out_channels) - 1)
    b, _, h, w = pixels.shape
    return vae.decode_bytes((b, vae.args.latent_channels, h // factor, w // factor), pixels.dtype) > \
        budget_bytes(current() or RunPolicy())


def encode_moments(vae, pixels):
    """VAE (mean, logvar) of [1, 3, H, W] pixels in [-1, 1], in the installed policy's compute dtype, within its
    memory budget (stage by stage, exact conv row bands where large; tiles only when even that does not fit)."""
    vae.set_memory_policy(after_stage=pace, band_bytes=(current() or RunPolicy()).conv_band)
    x = mx.array(pixels).astype(current_dtype())
    mean, logvar = vae.encode_moments(x, tiling=encode_tiling(vae, x))
    mx.eval(mean, logvar)
    return mean, logvar


def flux2_latents(vae, image):
    """A prepared image -> its FLUX.2 transformer latents [1, 4 * latent channels, H/16, W/16] (float32): the
    posterior's mode, patchified, normalised by the `bn` statistics (Flux2Pipeline._encode_vae_image)."""
    mean, _ = encode_moments(vae, to_array(image))
    latents = vae.patchify_and_normalize(mean).astype(mx.float32)
    mx.eval(latents)
    return latents


def latents_reference(latents, i, batch):
    """FLUX.2 transformer latents [1, C, h, w] -> reference i's (tokens [batch, h * w, C] float32, position ids
    [batch, h * w, 4] int32: t = 10 + 10 i, row, column, 0), as Flux2Pipeline.prepare_image_latents makes them."""
    _, c, h, w = latents.shape
    tokens = latents.reshape(c, h * w).transpose(1, 0)
    hh, ww = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
    t = np.full(h * w, REFERENCE_T_OFFSET + REFERENCE_T_OFFSET * i)
    ids = np.stack([t, hh.ravel(), ww.ravel(), np.zeros(h * w)], axis=-1).astype(np.int32)
    tokens = mx.broadcast_to(tokens[None], (batch, *tokens.shape))
    mx.eval(tokens)
    return tokens, mx.array(np.broadcast_to(ids, (batch, *ids.shape)))


def reference_tokens(vae, images, batch):
    """Prepared reference images -> (tokens [batch, N_ref, C] float32, position ids [batch, N_ref, 4] int32), in
    the order given (Flux2Pipeline.prepare_image_latents)."""
    pairs = [latents_reference(flux2_latents(vae, image), i, batch) for i, image in enumerate(images)]
    tokens = mx.concatenate([t for t, _ in pairs], axis=1)
    mx.eval(tokens)
    return tokens, mx.concatenate([ids for _, ids in pairs], axis=1)


def reference_token_count(images, multiple) -> int:
    """Tokens the prepared references add to the transformer's sequence (one per multiple x multiple pixels)."""
    return sum((im.width // multiple) * (im.height // multiple) for im in images)


def sd3_init_latents(vae, image, width, height, noise):
    """StableDiffusion3Img2ImgPipeline's init latents: the image resized to the output size, a sample of the VAE
    posterior with the given standard-normal `noise` (mean + exp(logvar / 2) * noise), then (z - shift) * scaling."""
    mean, logvar = encode_moments(vae, to_array(resized(image, width, height)))
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


# -- masks: inpainting and outpainting, for every family that takes a mask ----------------------------------------
MASK_OPTIONS = {"mask": None, "mask_blur": None, "outpaint": None}     # generate()'s keywords of such a family


def inpainting(options) -> bool:
    """Whether generate()'s family keywords ask for inpainting: a mask, or outpainting (which makes one)."""
    return options.get("mask") is not None or options.get("outpaint") is not None


def take_mask(run, multiple=None):
    """check_inputs' part for a family that takes a mask: generate()'s `mask`, `mask_blur` and `outpaint`
    (run.options) checked, only with the one init image, before anything loads. Outpainting pads the image
    (outpaint_canvas: run.images[0] becomes the canvas, and, given `multiple`, the output size left out is the
    canvas's cut down to that multiple, as the inpaint pipelines cut an image's); the mask is blurred where asked
    (blur_mask) -> run.state's mask (a PIL image), mask_name and, for a mask of another aspect ratio than the image,
    mask_note (diffusers stretches it to the output size; so does mlxdiff)."""
    o = run.options
    mask, blur, pad = o.get("mask"), check_number("mask_blur", o.get("mask_blur")), check_outpaint(o.get("outpaint"))
    if mask is None and pad is None:
        if blur is not None:
            raise MlxdiffError("mask_blur: blurs a mask; give mask= (--mask) or outpaint= (--outpaint) too, or leave "
                               "it out")
        return
    if not run.images:
        what = "mask: a mask says where to repaint" if mask is not None else "outpaint: pads"
        raise MlxdiffError(f"{what} an image; give image= (--image) too, or leave the "
                           f"{'mask' if mask is not None else 'outpaint'} out")
    name = None
    if mask is not None:
        try:
            names, masks = check_images(mask)
        except MlxdiffError as e:     # check_images says "image ..."; this is the mask
            raise MlxdiffError("mask" + str(e)[len("image"):] if str(e).startswith("image") else str(e)) from None
        if len(masks) > 1:
            raise MlxdiffError(f"mask: {len(masks)} masks; give one mask for the one image")
        mask, name = masks[0], names[0]
        note = aspect_note(name, mask, run.image_names[0], run.images[0],
                           "the output size" if pad is None else "the image's size inside the canvas")
        if note:
            run.state["mask_note"] = note
    if pad is not None:
        run.images[0], mask = outpaint_canvas(run.images[0], mask, pad)
        border = f"the outpainted border ({', '.join(map(str, pad))} pixels left, top, right, bottom)"
        name = border if name is None else f"{border} and {name}"
        if multiple and run.width is None and run.height is None:
            w, h = run.images[0].size
            run.width, run.height = max(multiple, w // multiple * multiple), max(multiple, h // multiple * multiple)
    if blur:
        mask = blur_mask(mask, blur)
    if max(mask.convert("L").getextrema()) < 128:
        raise MlxdiffError(f"mask {name}: all black (no pixel at or above mid grey, 128): nothing to repaint; white "
                           "marks where to repaint, or leave the mask out for image-to-image")
    run.state.update(mask=mask, mask_name=name)


def aspect_note(mask_name, mask, image_name, image, onto="the output size") -> str | None:
    """A Result note when the mask's aspect ratio is not the image's (more than a pixel off at the mask's width):
    diffusers' mask_processor resizes it to the output size all the same, stretching it; so does mlxdiff (`onto`:
    where it goes)."""
    (mw, mh), (iw, ih) = mask.size, image.size
    if abs(mw * ih / iw - mh) <= 1:
        return None
    return (f"mask {mask_name} is {mw}x{mh} and image {image_name} {iw}x{ih}: another aspect ratio, so the mask is "
            f"stretched to {onto} (as diffusers' mask_processor resizes it)")


def outpaint_canvas(image, mask, pad):
    """Outpainting's canvas and mask: `pad` = (left, top, right, bottom) pixels added to the RGB image, filled with
    its edge pixels (each new pixel takes the nearest edge pixel's colour, numpy's pad mode "edge"); the mask white
    over the added pixels and, inside, the given mask (resized to the image's size as diffusers resizes a mask,
    grayscale) or black -> (canvas RGB, mask "L"). Edge pixels rather than ComfyUI's mid grey (ImagePadForOutpaint):
    where strength < 1 the new area starts from the canvas noised, and grey would start it grey, with a seam at the
    border; FLUX.2 klein also sees the canvas as its reference image."""
    left, top, right, bottom = pad
    w, h = image.size
    width, height = w + left + right, h + top + bottom
    if width > MAX_SIZE or height > MAX_SIZE:
        raise MlxdiffError(f"outpaint=({left}, {top}, {right}, {bottom}): the {w}x{h} image padded is {width}x{height}"
                           f", past {MAX_SIZE} pixels a side; pad less")
    pixels = np.pad(np.asarray(image.convert("RGB")), ((top, bottom), (left, right), (0, 0)), mode="edge")
    inner = PIL.Image.new("L", (w, h), 0) if mask is None else resized(mask, w, h).convert("L")
    canvas_mask = PIL.Image.new("L", (width, height), 255)
    canvas_mask.paste(inner, (left, top))
    return PIL.Image.fromarray(pixels), canvas_mask


def blur_mask(mask, radius):
    """diffusers' VaeImageProcessor.blur(mask, blur_factor=radius): Pillow's GaussianBlur of that radius, on the
    mask as given (before the inpaint pipeline resizes and binarizes it, so the blur moves and rounds the mask's
    edge at 0.5; it does not make a soft blend)."""
    return mask.filter(PIL.ImageFilter.GaussianBlur(radius))


def binary_mask(mask, width, height) -> np.ndarray:
    """The inpainting pipelines' mask_processor (VaeImageProcessor with do_normalize=False, do_binarize=True,
    do_convert_grayscale=True): resized LANCZOS to the output size, then grayscale, in [0, 1], binarized at 0.5 ->
    (height, width) float32 of 0 and 1 (1: repaint)."""
    values = np.asarray(resized(mask, width, height).convert("L")).astype(np.float32) / 255.0
    return (values >= 0.5).astype(np.float32)


def latent_mask(mask, width, height, factor) -> np.ndarray:
    """binary_mask, then interpolate "nearest" to the latent size, which at a whole factor takes every factor-th
    pixel -> (1, 1, height / factor, width / factor) float32 of 0 and 1 (SD3.5, FLUX.1, Z-Image, Qwen-Image)."""
    return binary_mask(mask, width, height)[None, None, ::factor, ::factor]


def bilinear_mask(mask, width, height, factor) -> np.ndarray:
    """binary_mask, then interpolate "bilinear" (align_corners=False, no antialias) to (height / factor, width /
    factor), as Flux2KleinInpaintPipeline.prepare_mask_latents: each output pixel blends the pixels around its
    centre, so the mask's edges are 0.25, 0.5 or 0.75 -> (1, 1, h, w) float32."""
    values = binary_mask(mask, width, height)

    def along(x, axis):
        n = x.shape[axis]
        src = np.maximum((np.arange(n // factor, dtype=np.float32) + 0.5) * factor - 0.5, 0)
        low = np.floor(src).astype(np.int64)
        high, lam = np.minimum(low + 1, n - 1), (src - low).astype(np.float32)
        shape = [1, 1]
        shape[axis] = -1
        lam = lam.reshape(shape)
        return (1 - lam) * np.take(x, low, axis=axis) + lam * np.take(x, high, axis=axis)
    return along(along(values, 0), 1).astype(np.float32)[None, None]


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
    """images_note's line with a mask (and the mask's aspect note, where it has one)."""
    if "mask" not in run.state:
        return note
    extra = f"; {run.state['mask_note']}" if "mask_note" in run.state else ""
    return f"inpainting where {run.state['mask_name']} is white; {note}{extra}"


class LatentInpainting:
    """The step and note hooks of a family that inpaints by blending latents (StableDiffusion3InpaintPipeline,
    FluxInpaintPipeline, Flux2KleinInpaintPipeline, ZImageInpaintPipeline, QwenImageInpaintPipeline): after each step
    the kept area is the init latents at the next sigma (0: clean).
    Mixed in before Pipeline; the family's encode_images puts the mask's state on the run (inpaint_blend)."""

    def step(self, run, i, x, prediction):
        return inpaint_blend(run, i, super().step(run, i, x, prediction))

    def images_note(self, run, seconds):
        return inpaint_note(run, super().images_note(run, seconds))
