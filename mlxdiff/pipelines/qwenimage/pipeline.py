"""Qwen-Image, following diffusers' QwenImagePipeline (pipelines/qwenimage/pipeline_qwenimage.py), with image=
QwenImageImg2ImgPipeline (pipeline_qwenimage_img2img.py), with image= and mask= QwenImageInpaintPipeline
(pipeline_qwenimage_inpaint.py).

    encode:  Qwen2.5-VL's language model through mlx-lm (models/text_llm.py): each prompt in Qwen-Image's template
             (PROMPT_TEMPLATE), the batch padded to its longest row (at most 1024 + 34 tokens); the features are
             hidden_states[-1] (the final-normed output); per row its valid tokens, less the template's first 34
             (DROP_TOKENS), padded with zeros to the batch's longest with a 0 / 1 mask, then cut to
             max_sequence_length (512); the negative prompt is encoded on its own, as diffusers
    denoise: the Qwen-Image MMDiT on 2x2-packed latents (B, (H/16) (W/16), 4 z_dim), img_shapes [(1, H/16, W/16)],
             timestep t / 1000, the text mask as keys; flow-match Euler over sigmas linspace(1, 1/N, N) shifted by mu
             from the image token count; true CFG only with a negative prompt and true_cfg_scale > 1 (default 4.0):
             comb = neg + s (cond - neg), rescaled per token to the conditional prediction's norm
    reference (only with image=): the init image resized to the output size, a sample of the VAE posterior
             ((z - latents_mean) / latents_std), packed and noised to the first step run (strength: the share of the
             schedule denoised, default 0.6; get_timesteps as SD3's img2img)
    inpainting (mask=): the mask as its mask_processor makes it (resized LANCZOS to the output size, grayscale,
             binarized at 0.5), interpolate "nearest" to the latent size, repeated over the channels and packed as
             the latents are; after each step the latents are (1 - mask) * the init latents noised to the next sigma
             (clean after the last) + mask * the latents (image_inputs.inpaint_blend, Z-Image's too). Its default
             strength is 0.6, as img2img's. masked_image_latents only reach diffusers' callbacks, so they are not
             computed; padding_mask_crop is not taken (generate() refuses it as an unknown keyword)
    decode:  unpack, latents * latents_std + latents_mean (the VAE's config), AutoencoderKLQwenImage on one frame
    ControlNet (load(controlnets=), generate(control_images=)): QwenImageControlNetPipeline (several: its
             QwenImageMultiControlNetModel's sum, one image each): each control image resized to the output size, a
             sample of its VAE posterior, (z - latents_mean) / latents_std, packed; at each step each ControlNet within
             its [control_start, control_end] share runs on the positive prompt and its block residuals join the
             transformer's image stream in both true-CFG forwards. An Inpainting ControlNet (extra_condition_channels)
             with control_mask= as QwenImageControlNetInpaintPipeline: the image black where the mask repaints, and
             1 - the mask at the latent size as its extra channel

The transformer has no guidance embedding in use (diffusers ignores guidance_scale for it, with a warning): `guidance`
is ignored here too, with a note.
"""

from dataclasses import dataclass

import numpy as np

from ... import backend  # noqa: F401  (OpenBLAS preload before mlx)
import mlx.core as mx

from ... import schedulers
from ...arguments import check_generate, check_images
from ...errors import MlxdiffError
from ...memory import budget_bytes
from ...pacing import pace
from ...policy import RunPolicy, current, current_dtype
from ...tokenizers import report_truncation
from .. import image_inputs
from ..image_inputs import binary_mask, latent_mask
from ..base import Pipeline, as_numpy, evaluate_each_block, guidance_pair, initial_latents, negative_prompts
from ..controls import CONTROL_OPTIONS, ControlNets, acting, control_latents
from ..patches import pack_2x2, unpack_2x2

# QwenImagePipeline's prompt_template_encode, prompt_template_encode_start_idx and tokenizer_max_length
PROMPT_TEMPLATE = ("<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, "
                   "text, spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}"
                   "<|im_end|>\n<|im_start|>assistant\n")
DROP_TOKENS = 34
TOKENIZER_MAX_LENGTH = 1024
TRUE_CFG_SCALE = 4.0     # QwenImagePipeline.__call__'s default (used only with a negative prompt)
# run by edit.QwenImageEditPipeline (QwenImageEditInpaintPipeline's folders are Qwen-Image-Edit's)
EDIT_PIPELINES = ("QwenImageEditPipeline", "QwenImageEditPlusPipeline", "QwenImageEditInpaintPipeline")


@dataclass
class Conditioning:
    """Text conditioning, named as diffusers names it. Arrays are MLX; `as_numpy()` converts them. The masks are
    (B, L) of 0 / 1 over each row's tokens (diffusers returns None where every entry is 1)."""
    prompt_embeds: mx.array
    prompt_embeds_mask: mx.array
    negative_prompt_embeds: mx.array | None = None
    negative_prompt_embeds_mask: mx.array | None = None

    as_numpy = as_numpy


def tokenize(tokenizer, prompts):
    """_get_qwen_prompt_embeds' tokenization: the template around each prompt, padded to the longest (on the
    tokenizer's side), truncated at 1024 + 34 tokens -> (ids, mask) int32 (B, L), and the texts."""
    texts = [PROMPT_TEMPLATE.format(p) for p in prompts]
    enc = tokenizer(texts, max_length=TOKENIZER_MAX_LENGTH + DROP_TOKENS, padding=True, truncation=True)
    return np.array(enc["input_ids"], np.int32), np.array(enc["attention_mask"], np.int32), texts


def valid_rows(hidden, mask, max_sequence_length, drop=DROP_TOKENS):
    """_extract_masked_hidden + the drop + the stacking, then encode_prompt's cut: each row's valid tokens less the
    first `drop` (the template's), zero-padded to the longest -> (embeds (B, L', D), mask (B, L') int32, the kept
    index rows). max_sequence_length None: no cut (the Edit pipelines make none)."""
    kept = [np.nonzero(row)[0][drop:] for row in mask]
    length = max(len(k) for k in kept)
    rows, masks = [], []
    for i, k in enumerate(kept):
        row = mx.take(hidden[i], mx.array(k.astype(np.int32)), axis=0) if len(k) else hidden[i, :0]
        rows.append(mx.concatenate([row, mx.zeros((length - len(k), hidden.shape[-1]), hidden.dtype)], axis=0))
        masks.append(np.arange(length) < len(k))
    embeds, out_mask = mx.stack(rows), np.stack(masks).astype(np.int32)
    return embeds[:, :max_sequence_length], mx.array(out_mask[:, :max_sequence_length]), kept


class QwenImagePipeline(ControlNets, image_inputs.LatentInpainting, Pipeline):
    """`generate(..., negative_prompt=, true_cfg_scale=)`: true classifier-free guidance, two forwards a step, only
    with a negative prompt ("" counts) and true_cfg_scale > 1 (default 4.0), as diffusers; otherwise one forward a
    step. `guidance` is ignored (Qwen-Image is not guidance-distilled). `max_sequence_length`: the prompt's tokens
    after the template (default 512). `latents`: the noise in diffusers' packed layout (batch, (H/16) * (W/16),
    4 * z_dim). `image=` with `strength` (default 0.6): image-to-image as QwenImageImg2ImgPipeline; with `mask=`
    too (a PIL image or file, white repaints, black keeps, any size: resized to the output's) inpainting as
    QwenImageInpaintPipeline (strength default 0.6 too); the output size is not the image's (1024 x 1024 unless
    given, as there). `image_noise`: the VAE posterior's noise (B, z_dim, H/8, W/8) (default: from the seed).
    `control_images=[...]` (one per ControlNet given to load), `control_scales` (replacing load's), `control_start` /
    `control_end` (shares of the schedule), `control_noise` (each control image's VAE posterior noise, (1 or B,
    z_dim, H/8, W/8); default from the seed): ControlNet as QwenImageControlNetPipeline; an Inpainting ControlNet
    (extra_condition_channels) takes `control_mask` too (white repaints, black keeps; resized to the output size), as
    QwenImageControlNetInpaintPipeline."""
    family = "qwenimage"
    patch_size = 2      # 2x2 latent patches per token: sizes are multiples of 16
    OPTIONS = {**Pipeline.OPTIONS, "max_sequence_length": None, "true_cfg_scale": None, "image_noise": None,
               **image_inputs.MASK_OPTIONS, **{name: None for name in CONTROL_OPTIONS},
               "control_mask": None}
    CONTROL_PIPELINE = "QwenImageControlNetPipeline"
    IMG2IMG_STRENGTH = 0.6      # QwenImageImg2ImgPipeline's strength
    INPAINT_STRENGTH = 0.6      # QwenImageInpaintPipeline's (not 1.0, unlike Z-Image's)
    EDIT_PIPELINES = EDIT_PIPELINES

    def __init__(self, sources, **settings):
        super().__init__(sources, **settings)
        self.tokenizer = self.tokenizers["tokenizer"]

    def defaults(self):
        return {"steps": 50, "guidance": 0.0}        # QwenImagePipeline's steps; its guidance_scale is unused

    def default_size(self):
        return 128 * self.vae_scale_factor()          # default_sample_size 128: 1024 px

    def vae_scale_factor(self):
        return 2 ** len(self.components["vae"].args.temperal_downsample)

    # -- encode -------------------------------------------------------------------------------------------------
    def _encode(self, groups, max_sequence_length) -> list:
        """[(embeds, mask)] of each group of prompts, under one load of the encoder (a true-CFG run's negative prompt
        does not build, or stream the resident part of, the 7 B encoder a second time)."""
        tokens = [tokenize(self.tokenizer, prompts) for prompts in groups]
        encoded = []
        with self.use(self.components["text_encoder"]) as encoder:
            for ids, mask, _ in tokens:
                hidden = encoder(mx.array(ids), mx.array(mask))
                embeds, out_mask, kept = valid_rows(hidden, mask, max_sequence_length)
                mx.eval(embeds)
                encoded.append((embeds, out_mask, kept))
        out = []
        for (ids, _, texts), (embeds, out_mask, kept) in zip(tokens, encoded):
            truncated = [(text, self.tokenizer.decode(ids[i][k[max_sequence_length:]]))
                         for i, (text, k) in enumerate(zip(texts, kept)) if len(k) > max_sequence_length]
            report_truncation(truncated, f"{max_sequence_length} tokens after Qwen-Image's template")
            out.append((embeds.astype(self.dtype), out_mask))
        return out

    def encode_prompt(self, prompt, negative_prompt=None, *, do_true_cfg=False,
                      max_sequence_length=None) -> Conditioning:
        """prompt_embeds (B, L, hidden) and prompt_embeds_mask (B, L) as diffusers' encode_prompt; with
        `do_true_cfg` the negative prompt's too (one per prompt; a string serves every prompt), encoded on its
        own."""
        check_generate(prompt=prompt, negative_prompt=negative_prompt, max_sequence_length=max_sequence_length)
        max_sequence_length = max_sequence_length or 512
        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        if not do_true_cfg:
            return Conditioning(*self._encode([prompts], max_sequence_length)[0])
        negs = negative_prompts(prompts, negative_prompt)
        (embeds, mask), negative = self._encode([prompts, negs], max_sequence_length)
        return Conditioning(embeds, mask, *negative)

    # -- the template's hooks (Pipeline.generate) ---------------------------------------------------------------
    def img2img_start(self, steps, strength):
        return image_inputs.sd3_start(steps, strength)      # QwenImageImg2ImgPipeline.get_timesteps: the same

    def default_strength(self, options):
        return self.INPAINT_STRENGTH if image_inputs.inpainting(options) else self.IMG2IMG_STRENGTH

    def check_inputs(self, run):
        self.take_image_noise(run)
        image_inputs.take_mask(run, self.vae_scale_factor() * self.patch_size)     # outpainting: the canvas's size

    def true_cfg_scale(self, run):
        scale = run.options["true_cfg_scale"]
        return TRUE_CFG_SCALE if scale is None else scale

    def uses_cfg(self, run):
        # QwenImagePipeline's do_true_cfg: the scale above 1 and a negative prompt given
        return self.true_cfg_scale(run) > 1 and run.negative_prompt is not None

    def check_run(self, run):
        self.take_controls(run)      # here, not in check_inputs: the Edit pipelines' own check_inputs refuse them too
        self.take_control_mask(run)
        noise, factor = run.options["image_noise"], self.vae_scale_factor()
        expected = (1, self.components["vae"].args.z_dim, run.height // factor, run.width // factor)
        if noise is not None and tuple(noise.shape) != expected:
            raise MlxdiffError(f"image_noise has shape {tuple(noise.shape)}, expected {expected} (the VAE latents of "
                               "the output size)")
        terminal = schedulers.scheduler_config(self.scheduler_config)["shift_terminal"]
        if run.steps == 1 and terminal:
            # linspace(1, 1/N, N) is [1] at N = 1: stretching 1 - sigma to shift_terminal divides 0 by 0 (diffusers
            # denoises with a NaN sigma)
            raise MlxdiffError(f"steps=1: the scheduler's shift_terminal {terminal:g} (scheduler_config.json) makes a "
                               "one-step schedule 0 / 0 (NaN in diffusers too); use 2 or more steps")

    def take_control_mask(self, run):
        """check_run's part: `control_mask`, the one mask an Inpainting ControlNet (extra_condition_channels in its
        config) needs, refused for the others -> run.state["controls"]["mask"] (a PIL image)."""
        mask = run.options["control_mask"]
        spec = self.components[self.controlnets[0]] if self.controlnets else None
        if spec is None or not spec.args.extra_condition_channels:
            if mask is not None:
                raise MlxdiffError("control_mask: an Inpainting ControlNet's mask (QwenImageControlNetInpaint"
                                   "Pipeline); " + ("this pipeline has no ControlNet" if spec is None else
                                      f"ControlNet {spec.source} is no Inpainting one (no extra_condition_channels in "
                                      "its config)") + "; leave control_mask out")
            return
        if mask is None:
            raise MlxdiffError(f"control_mask: Inpainting ControlNet {spec.source} needs the mask of its control image "
                               "(white repaints, black keeps); give control_mask=")
        _, masks = check_images(mask)
        if len(masks) != 1:
            raise MlxdiffError(f"control_mask: {len(masks)} masks; an Inpainting ControlNet takes one")
        run.state["controls"]["mask"] = masks[0]

    def encode(self, run):
        return self.encode_prompt(run.prompt, run.negative_prompt, do_true_cfg=run.cfg,
                                  max_sequence_length=run.options["max_sequence_length"])

    def encode_settings(self, run):
        return (repr(run.negative_prompt), run.options["max_sequence_length"])

    def notes(self, run):
        """What diffusers warns of and then ignores, as Result notes."""
        given = run.options["true_cfg_scale"]
        if given is not None and given > 1 and run.negative_prompt is None:
            run.result.notes.append(f"true_cfg_scale {given:g} without a negative prompt: no CFG (as diffusers, which "
                                    "warns); give a negative prompt (\"\" counts) for true CFG")
        if run.negative_prompt is not None and not run.cfg:
            run.result.notes.append(f"negative prompt unused: true_cfg_scale {self.true_cfg_scale(run):g} <= 1 (as "
                                    "diffusers)")
        if run.guidance:
            run.result.notes.append(f"guidance {run.guidance:g} ignored: Qwen-Image is not guidance-distilled (as "
                                    "diffusers); use true_cfg_scale with a negative prompt")

    def prepare_latents(self, run, latents):
        cond, targs = run.conditioning, self.components["transformer"].args
        if cond.prompt_embeds.shape[-1] != targs.joint_attention_dim:
            raise MlxdiffError(f"the text encoder gives {cond.prompt_embeds.shape[-1]} features per token but the "
                               f"transformer's joint_attention_dim is {targs.joint_attention_dim}; the encoder and "
                               "transformer do not belong together")
        self.notes(run)
        run.batch = cond.prompt_embeds.shape[0]
        factor = self.vae_scale_factor()
        h, w = run.height // factor, run.width // factor
        channels = self.components["vae"].args.z_dim
        tokens = (h // 2) * (w // 2)
        run.state.update(shape=(run.batch, channels, h, w), img_shapes=[(1, h // 2, w // 2)],
                         true_cfg_scale=self.true_cfg_scale(run))
        run.sampler = self.new_sampler(run, qwenimage_sigmas(run.steps, tokens, self.scheduler_config))
        if latents is None:      # drawn in the VAE's layout and packed, as diffusers' prepare_latents
            return pack_2x2(initial_latents(None, run.state["shape"], run.seed))
        return initial_latents(latents, (run.batch, tokens, 4 * channels), run.seed, "diffusers' packed layout: "
                               "batch, (height/16) * (width/16), 4 * z_dim")

    def encode_images(self, run, vae, x):
        """QwenImageImg2ImgPipeline's start: the image resized to the output size, a sample of its VAE posterior
        (image_noise, else the seed's second stream), (z - latents_mean) / latents_std, packed, noised to the first
        step run (scale_noise). With ControlNets: their control images instead (encode_controls)."""
        if "controls" in run.state:
            return self.encode_controls(run, vae, x)
        pixels = image_inputs.to_array(image_inputs.resized(run.images[0], run.width, run.height))
        mean, logvar = vae_moments(vae, pixels)
        z = vae.sample_latents(mean.astype(mx.float32), logvar.astype(mx.float32),
                               self.posterior_noise(run, run.state["shape"]))
        init = mx.broadcast_to(pack_2x2(vae.scale_latents(z).astype(mx.float32)), x.shape)
        if "mask" in run.state:     # each step's blend: the noise, the init latents, the mask, all packed
            run.state.update(noise=x, image_latents=init, latent_mask=packed_latent_mask(
                run.state["mask"], run.width, run.height, self.vae_scale_factor(), run.state["shape"][1]))
        x = run.sampler.add_noise(init, x, run.start)
        mx.eval(x)
        return x

    def encode_controls(self, run, vae, x):
        """QwenImageControlNetPipeline's control images: each a sample of its VAE posterior, (z - latents_mean) /
        latents_std, packed, one row per prompt (diffusers encodes the repeated image). With an Inpainting
        ControlNet's mask (QwenImageControlNetInpaintPipeline.prepare_image_with_mask): the image black (-1) where
        the binarized mask repaints, encoded so, and 1 - the mask at the latent size as one more channel."""
        mask, moments = run.state["controls"].get("mask"), vae_moments
        if mask is not None:
            repaint = binary_mask(mask, run.width, run.height) > 0.5

            def moments(vae, pixels):
                return vae_moments(vae, np.where(repaint, -1.0, pixels).astype(np.float32))
        conds = [control_latents(run, vae, k, None, run.batch, moments=moments)
                 for k in range(len(self.controlnets))]
        if mask is not None:
            keep = mx.array(1 - latent_mask(mask, run.width, run.height, self.vae_scale_factor()))
            conds = [mx.concatenate([c, mx.broadcast_to(keep, (c.shape[0], 1, *c.shape[2:]))], axis=1) for c in conds]
        conds = [pack_2x2(c) for c in conds]
        run.state["control_conds"] = [mx.broadcast_to(c, (run.batch, *c.shape[1:])) for c in conds]
        mx.eval(run.state["control_conds"])
        return x

    def control_residuals(self, run, i, x, t):
        """The summed block residuals of the ControlNets acting at schedule index i (QwenImageMultiControlNetModel's
        sum), on the positive prompt, which both of true CFG's forwards take; None without."""
        if "controls" not in run.state:
            return None
        nets, st, c = self.control_models(run), run.state, run.conditioning
        mask = None if bool(c.prompt_embeds_mask.all()) else c.prompt_embeds_mask
        total = None
        for k, scale in acting(st["controls"], i, len(run.timesteps)):
            r = nets[k](x, st["control_conds"][k], scale, c.prompt_embeds, mask, t, st["img_shapes"],
                        after_block=evaluate_each_block)
            total = r if total is None else total if r is None else [a + b for a, b in zip(total, r)]
        return total

    def velocity(self, run, transformer, i, x):
        # diffusers: t in the latents' dtype, then / 1000
        t = mx.full((run.batch,), run.timesteps[i], dtype=mx.float32).astype(self.dtype) / 1000
        c, tokens, shapes = run.conditioning, self.denoiser_tokens(run, x).astype(self.dtype), run.state["img_shapes"]
        n = x.shape[1]      # the prediction of the latents' own tokens (Edit appends its images' after them)
        residuals = self.control_residuals(run, i, x.astype(self.dtype), t)

        def forward(name, embeds, mask):
            mask = None if bool(mask.all()) else mask       # diffusers passes no mask where none is padding
            return lambda: run.forward(name, lambda cache: transformer(
                tokens, embeds, t, shapes, mask, after_block=evaluate_each_block, step_cache=cache,
                stream_dtype=self.stream_dtype, controlnet_block_samples=residuals)[:, :n]).astype(mx.float32)
        cond = forward("cond", c.prompt_embeds, c.prompt_embeds_mask)
        if not run.cfg:
            return cond()
        neg, pos = guidance_pair(self.group, forward("uncond", c.negative_prompt_embeds,
                                                     c.negative_prompt_embeds_mask), cond)
        comb = neg + run.state["true_cfg_scale"] * (pos - neg)
        # norm-preserving: each token's combined prediction rescaled to the conditional one's norm
        return comb * (mx.linalg.norm(pos, axis=-1, keepdims=True) / mx.linalg.norm(comb, axis=-1, keepdims=True))

    def denoiser_tokens(self, run, x):
        """The transformer's image tokens at a step: the latents (Edit: its input images' latents after them)."""
        return x

    def images_note(self, run, seconds):
        if "controls" in run.state:
            return self.control_note(run, seconds)
        return super().images_note(run, seconds)

    def unpack(self, run, x):
        self.release_controls(run)
        return unpack_2x2(x, run.state["shape"])

    def preview_layout(self, run, x):
        return unpack_2x2(x, run.state["shape"])      # the ControlNets left in place (on_step's previews)


def vae_moments(vae, pixels):
    """(1, 3, H, W) pixels in [-1, 1] -> the Qwen-Image VAE's (mean, logvar), stage by stage within the memory
    budget; tiled only where an untiled encode would not fit (image_inputs.encode_tiling reads AutoencoderKL's
    config)."""
    dtype = current_dtype()      # the run's, installed for the VAE's phase
    policy = current() or RunPolicy()
    vae.set_memory_policy(after_stage=pace, band_bytes=policy.conv_band)
    latent = (1, vae.args.z_dim, pixels.shape[2] // vae.factor, pixels.shape[3] // vae.factor)
    return vae.encode_moments(mx.array(pixels).astype(dtype), tiling=vae.decode_bytes(latent, dtype) >
                              budget_bytes(policy))


def packed_latent_mask(mask, width, height, factor, channels) -> mx.array:
    """QwenImageInpaintPipeline.prepare_mask_latents' mask: the latent mask (image_inputs.latent_mask) repeated over
    the latent channels and packed as the latents are -> (1, (H/2f) (W/2f), 4 channels) float32 of 0 and 1."""
    values = mx.array(latent_mask(mask, width, height, factor))
    return pack_2x2(mx.broadcast_to(values, (1, channels, *values.shape[2:])))


def qwenimage_sigmas(steps, image_seq_len, scheduler_config=None):
    """QwenImagePipeline's schedule: sigmas linspace(1, 1/N, N) through the scheduler with mu =
    calculate_shift(image_seq_len) (used where the config shifts dynamically, else its static shift) ->
    (sigmas [N + 1] with the terminal 0, timesteps [N]) float32."""
    config = schedulers.scheduler_config(scheduler_config)
    mu = schedulers.calculate_shift(image_seq_len, config["base_image_seq_len"], config["max_image_seq_len"],
                                    config["base_shift"], config["max_shift"])
    return schedulers.set_timesteps(config, steps, sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)
