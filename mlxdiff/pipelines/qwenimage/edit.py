"""Qwen-Image-Edit, following diffusers' QwenImageEditPipeline (pipelines/qwenimage/pipeline_qwenimage_edit.py),
QwenImageEditPlusPipeline (pipeline_qwenimage_edit_plus.py: several input images, Qwen-Image-Edit-2509 / 2511) and,
with mask=, QwenImageEditInpaintPipeline (pipeline_qwenimage_edit_inpaint.py).

    sizes:   Edit: the first input image resized (LANCZOS) to calculate_dimensions(1024 * 1024, its aspect): about
             1 MP, sides multiples of 32; that image is both the vision tower's and the VAE's. Plus: each image
             resized to ~384 x 384 px for the vision tower (CONDITION_AREA) and ~1 MP for the VAE, each from the
             original. The output size defaults to the (last, for Plus) image's 1 MP size
    encode:  each vision image through Qwen2VLImageProcessor (models/vision_qwen25vl.preprocess) and the Qwen2.5-VL
             vision tower (mlx-vlm's); the prompt in the Edit template (Plus: "Picture i: " + the image placeholder per
             image before the prompt), each <|image_pad|> expanded to its image's merged patches as Qwen2VLProcessor
             does, the tower's features put in place of those tokens' embeddings; then the language model as
             Qwen-Image's (hidden_states[-1]), less the template's first 64 tokens (EDIT_DROP_TOKENS), not cut to
             max_sequence_length (as diffusers). The language model runs at positions 0 .. L-1 on its three RoPE axes:
             diffusers 0.42 calls the encoder without the processor's mm_token_type_ids, so transformers 5.x builds
             no 3-D (image grid) positions for the image tokens; this follows it. The negative prompt (true CFG) is
             encoded with the same images
    reference: each VAE image's latent mode (the posterior mean; no noise), (z - latents_mean) / latents_std,
             2x2-packed; appended after the noise's tokens at every step, img_shapes the output's grid then each
             image's; the prediction is the first (output) tokens' only
    denoise: as Qwen-Image (flow-match Euler, mu from the output's token count; true CFG with a negative prompt)

    inpainting (mask=, QwenImageEditInpaintPipeline; one input image, not Plus folders): the output is the image's
             ~1 MP size (diffusers ignores height / width there; mlxdiff refuses others); the image resized to it is
             the vision tower's and the VAE's; its latents are a posterior *sample* (image_noise, else the seed),
             used both as the reference tokens appended at every step and as the init latents, noised to the first
             step run (strength, default 0.6, as Qwen-Image's inpainting); the mask and the blend after each step
             are Qwen-Image's (pipeline.py, image_inputs.take_mask: mask_blur and outpaint too). padding_mask_crop
             and masked_image_latents are not taken (generate() refuses them as unknown keywords)

Not taken: strength without a mask (Edit starts from noise), image_noise without a mask, more than one prompt
(QwenImageEditPlusPipeline refuses batches; QwenImageEditPipeline's processor needs one image per prompt).
Qwen-Image-Edit-2511's zero_cond_t transformer is models/qwenimage.py's; the pipeline is Plus's.
"""

import numpy as np

from ... import backend  # noqa: F401  (OpenBLAS preload before mlx)
import mlx.core as mx

from ...errors import MlxdiffError
from ...memory import budget_bytes
from ...models import vision_qwen25vl
from ...pacing import pace
from ...policy import RunPolicy, current
from .. import image_inputs
from ..image_inputs import IMAGE_PAD, calculate_dimensions, expand_image_pads, image_digest
from ..patches import pack_2x2
from .pipeline import Conditioning, QwenImagePipeline, valid_rows

# QwenImageEditPipeline's prompt_template_encode (Plus: the same without the image placeholder, which its
# "Picture i: " prefix gives per image) and prompt_template_encode_start_idx (both)
EDIT_TEMPLATE = ("<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, "
                 "objects, background), then explain how the user's text instruction should alter or modify the "
                 "image. Generate a new image that meets the user's requirements while maintaining consistency with "
                 "the original input where appropriate.<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n"
                 "<|im_start|>assistant\n")
IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
PLUS_PICTURE = "Picture {}: " + IMAGE_PLACEHOLDER
EDIT_DROP_TOKENS = 64


def edit_template(prompt, images, plus) -> str:
    """The text the processor gets: Edit's template with its one placeholder, or Plus's with one per image."""
    if plus:
        return EDIT_TEMPLATE.format("".join(PLUS_PICTURE.format(i + 1) for i in range(images)) + prompt)
    return EDIT_TEMPLATE.format(IMAGE_PLACEHOLDER + prompt)


class QwenImageEditPipeline(QwenImagePipeline):
    """`generate(prompt, image=IMAGE)` (QwenImageEditPipeline) or `image=[IMAGE, ...]` (QwenImageEditPlusPipeline;
    its folders): the edit of the input image(s) the prompt asks for (module docstring). width / height default to
    the (last) input image's ~1 MP size; `negative_prompt=` with `true_cfg_scale` (default 4.0) for true CFG, as
    Qwen-Image; `latents`: the noise in diffusers' packed layout at the output size. `mask=` (Edit folders, one
    image): inpainting as QwenImageEditInpaintPipeline, at the image's ~1 MP size, with `strength` (default 0.6),
    `mask_blur`, `outpaint` and `image_noise` as Qwen-Image's inpainting."""
    VAE_AREA = 1024 * 1024          # calculate_dimensions' target areas (Plus's VAE_IMAGE_SIZE, CONDITION_IMAGE_SIZE;
    CONDITION_AREA = 384 * 384      # Edit's 1024 * 1024 for both)

    def __init__(self, sources, **settings):
        super().__init__(sources, **settings)
        self.plus = self.pipeline_class == "QwenImageEditPlusPipeline"
        self.processor = self.options["processor"]
        self.image_token_id = self.options["image_token_id"]

    def default_strength(self, options):
        # no image-to-image: the input images condition a run from noise; inpainting's default is Qwen-Image's
        return self.INPAINT_STRENGTH if image_inputs.inpainting(options) else None

    def check_images(self, names, images, strength):
        if len(images) > 1 and not self.plus:
            raise MlxdiffError(f"image: {len(images)} images; QwenImageEditPipeline (Qwen-Image-Edit) takes one input "
                               "image; several are QwenImageEditPlusPipeline's (Qwen-Image-Edit-2509 / 2511)")

    def check_inputs(self, run):
        inpaint = image_inputs.inpainting(run.options)
        if inpaint and self.plus:
            given = "mask" if run.options["mask"] is not None else "outpaint"
            raise MlxdiffError(f"{given}: inpainting is QwenImageEditInpaintPipeline's, with Qwen-Image-Edit's one "
                               "input image; a QwenImageEditPlusPipeline folder (Qwen-Image-Edit-2509 / 2511) takes "
                               f"no mask; use a Qwen-Image-Edit folder, or leave --{given} out")
        if not inpaint:
            for name in ("image_noise", "mask_blur"):
                if run.options[name] is not None:
                    raise MlxdiffError(f"{name}: Qwen-Image-Edit takes it only when inpainting; give mask= "
                                       f"(--mask) too, or leave --{name.replace('_', '-')} out")
            if run.strength is not None:
                raise MlxdiffError(f"strength={run.strength:g}: Qwen-Image-Edit starts from noise and edits by its "
                                   "input images (no image-to-image; strength is inpainting's, with mask=); leave "
                                   "--strength out")
        if not run.images:
            raise MlxdiffError("Qwen-Image-Edit edits an input image: give image= (--image)")
        if not isinstance(run.prompt, str) and run.prompt is not None and len(run.prompt) != 1:
            raise MlxdiffError(f"{len(run.prompt)} prompts: Qwen-Image-Edit takes one prompt a run (as diffusers' "
                               "Edit pipelines); run them one at a time")
        if inpaint:     # Qwen-Image's checks (outpaint: run.images[0] becomes the canvas)
            self.take_image_noise(run)
            image_inputs.take_mask(run)
        images = [image.convert("RGB") for image in run.images]
        if self.plus:
            vae = [image_inputs.resized(im, *calculate_dimensions(self.VAE_AREA, im.width / im.height))
                   for im in images]
            vision = [image_inputs.resized(im, *calculate_dimensions(self.CONDITION_AREA, im.width / im.height))
                      for im in images]
            sized = vae[-1]
        else:     # the first image at ~1 MP, for the VAE and the vision tower alike
            vae = vision = [image_inputs.resized(images[0], *calculate_dimensions(
                self.VAE_AREA, images[0].width / images[0].height))]
            sized = vae[0]
        run.state.update(vae_images=vae, vision_images=vision)
        if inpaint and (run.width, run.height) not in ((None, None), sized.size):
            raise MlxdiffError(f"width x height {run.width}x{run.height}: Qwen-Image-Edit inpaints at the input "
                               f"image's ~1 MP size, {sized.width}x{sized.height} here (as "
                               "QwenImageEditInpaintPipeline, which ignores other sizes); leave --width / --height "
                               "out")
        run.width = sized.width if run.width is None else run.width
        run.height = sized.height if run.height is None else run.height

    # -- encode -------------------------------------------------------------------------------------------------
    def encode_prompt(self, prompt, image, negative_prompt=None, *, do_true_cfg=False) -> Conditioning:
        """prompt_embeds (1, L, hidden) and prompt_embeds_mask as diffusers' Edit encode_prompt, `image` the vision
        tower's image(s) as the pipeline passes them (Edit: the input resized to its ~1 MP size; Plus: each at
        ~384 x 384); with `do_true_cfg` the negative prompt's too, with the same images."""
        images = [image] if not isinstance(image, (list, tuple)) else list(image)
        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        if len(prompts) != 1:
            raise MlxdiffError(f"{len(prompts)} prompts: Qwen-Image-Edit takes one prompt a run")
        groups = [prompts]
        if do_true_cfg:
            groups.append(["" if negative_prompt is None else
                           negative_prompt if isinstance(negative_prompt, str) else negative_prompt[0]])
        encoded = self._encode_edit(groups, images)
        return Conditioning(*encoded[0], *(encoded[1] if do_true_cfg else ()))

    def _encode_edit(self, groups, images) -> list:
        """[(embeds, mask)] of each group of prompts: the vision tower once, then the language model for each
        group, each under one load."""
        pixels, grid = vision_qwen25vl.preprocess(images, self.processor)
        counts = vision_qwen25vl.image_tokens(grid, self.processor["merge_size"])
        tokens = []
        for prompts in groups:
            texts = [expand_image_pads(edit_template(p, len(images), self.plus), counts) for p in prompts]
            enc = self.tokenizer(texts, padding=True)
            tokens.append((np.array(enc["input_ids"], np.int32), np.array(enc["attention_mask"], np.int32)))
        with self.use(self.components["vision"]) as tower:
            features = tower(mx.array(pixels).astype(self.dtype), grid)
            mx.eval(features)
        out = []
        with self.use(self.components["text_encoder"]) as encoder:
            for ids, mask in tokens:
                embeds = with_image_features(encoder.embed_tokens(mx.array(ids)), ids, self.image_token_id, features)
                hidden = encoder(mx.array(ids), mx.array(mask), inputs_embeds=embeds)
                embeds, out_mask, _ = valid_rows(hidden, mask, None, drop=EDIT_DROP_TOKENS)
                mx.eval(embeds)
                out.append((embeds.astype(self.dtype), out_mask))
        return out

    def encode(self, run):
        return self.encode_prompt(run.prompt, run.state["vision_images"], run.negative_prompt, do_true_cfg=run.cfg)

    def encode_settings(self, run):
        return (repr(run.negative_prompt), self.plus, image_digest(run.state["vision_images"]))

    def notes(self, run):
        super().notes(run)
        if run.options["max_sequence_length"] is not None:
            run.result.notes.append(f"max_sequence_length {run.options['max_sequence_length']} unused: the Edit "
                                    "pipelines keep every prompt token (as diffusers)")

    # -- the input images ---------------------------------------------------------------------------------------
    def prepare_latents(self, run, latents):
        x = super().prepare_latents(run, latents)
        factor = self.vae_scale_factor()
        run.state["img_shapes"] = run.state["img_shapes"] + [(1, im.height // factor // 2, im.width // factor // 2)
                                                             for im in run.state["vae_images"]]
        return x

    def encode_images(self, run, vae, x):
        """Each VAE image's latent mode, scaled and packed, appended in order (QwenImageEdit*Pipeline.prepare_latents
        with _encode_vae_image's sample_mode "argmax"). Inpainting: Qwen-Image's init latents (a posterior sample
        of the image at the output size, noised to the first step run, and the mask's state), the clean sample
        appended as the reference tokens (QwenImageEditInpaintPipeline)."""
        if "mask" in run.state:
            x = super().encode_images(run, vae, x)
            run.state["image_tokens"] = run.state["image_latents"]
            return x
        policy, factor, packed = current() or RunPolicy(), self.vae_scale_factor(), []
        vae.set_memory_policy(after_stage=pace, band_bytes=policy.conv_band)
        for image in run.state["vae_images"]:
            pixels = mx.array(image_inputs.to_array(image)).astype(self.dtype)
            # tiles only where an untiled encode would not fit (as Qwen-Image's image-to-image)
            latent = (1, run.state["shape"][1], image.height // factor, image.width // factor)
            mean, _ = vae.encode_moments(pixels, tiling=vae.decode_bytes(latent, self.dtype) > budget_bytes(policy))
            packed.append(pack_2x2(vae.scale_latents(mean.astype(mx.float32))))
        tokens = mx.concatenate(packed, axis=1)
        run.state["image_tokens"] = mx.broadcast_to(tokens, (x.shape[0], *tokens.shape[1:]))
        mx.eval(run.state["image_tokens"])
        return x

    def denoiser_tokens(self, run, x):
        return mx.concatenate([x, run.state["image_tokens"]], axis=1)

    def images_note(self, run, seconds):
        sizes = ", ".join(f"{im.width}x{im.height}" for im in run.state["vae_images"])
        tokens = run.state["image_tokens"].shape[1]
        note = (f"{len(run.state['vae_images'])} input image{'s' * (len(run.state['vae_images']) > 1)} at {sizes}: "
                f"{tokens} latent tokens beside the output's {run.state['shape'][2] * run.state['shape'][3] // 4}, "
                f"encoded in {seconds:.2f} s")
        if "mask" not in run.state:
            return note
        return image_inputs.inpaint_note(run, f"strength {run.strength:g}, steps {run.start + 1} to {run.steps} of "
                                              f"{run.steps} run; {note}")


def with_image_features(embeds, ids, token_id, features):
    """transformers' masked_scatter of the image features into the token embeddings: the k-th image token (in row
    order) takes features[k]; one line where the counts differ."""
    is_image = ids.reshape(-1) == token_id
    if int(is_image.sum()) != features.shape[0]:
        raise MlxdiffError(f"the prompt holds {int(is_image.sum())} image tokens for {features.shape[0]} image "
                           f"features; leave {IMAGE_PAD} out of the prompt")
    if not is_image.any():
        return embeds
    b, length, width = embeds.shape
    take = mx.array(np.maximum(np.cumsum(is_image) - 1, 0).astype(np.int32))
    flat = mx.where(mx.array(is_image)[:, None], features.astype(embeds.dtype)[take], embeds.reshape(-1, width))
    return flat.reshape(b, length, width)
