"""Qwen-Image test pieces shared by several test modules (no test module imports another): the tiny QwenImagePipeline
fixture and its reference runs (tests/test_qwenimage_pipeline.py), the tiny transformer twin and its forwards
(tests/test_qwenimage_transformer.py), and the VAE's diffusers -> Wan name map (tests/test_vae_qwenimage.py)."""

import contextlib
import json
import re
import shutil

import numpy as np
import pytest
import torch

import mlxdiff
import mlx.core as mx

import parity
from helpers import max_rel_err, randomize_
from twins import build_tokenizer

# -- the tiny QwenImagePipeline (tests/test_qwenimage_pipeline.py) -----------------------------------------------------

H, W = 32, 48      # non-square; multiples of 4 (the VAE) x 2 (the patches): latents 8 x 12, 4 x 6 tokens
Z = 5              # VAE latent channels: the transformer takes 4 x 5 = 20
SEQ = 96           # max_sequence_length: more than any prompt here keeps after the drop
TEXT = dict(hidden_size=40, intermediate_size=72, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=321, max_position_embeddings=256, rms_norm_eps=1e-6,
            rope_parameters=dict(rope_type="default", rope_theta=1e6, mrope_section=[2, 2, 1]))   # 10-wide heads
VISION = dict(depth=1, hidden_size=16, intermediate_size=24, num_heads=2, out_hidden_size=40, patch_size=4,
              spatial_merge_size=2, temporal_patch_size=2, window_size=8, fullatt_block_indexes=[0])
# Qwen/Qwen-Image's scheduler_config.json
SCHEDULER = dict(num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9,
                 base_image_seq_len=256, max_image_seq_len=8192, shift_terminal=0.02, time_shift_type="exponential")
PROMPT, NEGATIVE = "a red fox sitting in the snow at dawn", "blurry, dark"


def save_qwen25vl(folder, seed=5):
    import transformers
    config = transformers.Qwen2_5_VLConfig(text_config=TEXT, vision_config=VISION, tie_word_embeddings=False)
    model = randomize_(transformers.Qwen2_5_VLForConditionalGeneration(config).eval(), seed, 0.2)
    model.save_pretrained(folder)
    return model


@pytest.fixture(scope="module")
def qwen_tiny(tmp_path_factory):
    """A tiny QwenImagePipeline: Qwen2.5-VL 40 wide (3 layers, heads of 10, mrope_section (2, 2, 1), a 1-block
    vision tower that is never read), a transformer 96 wide (3 heads of 32, RoPE axes 6, 12, 14; 2 blocks) over 5
    latent channels, a 3-level Qwen-Image VAE (factor 4) with its own latents_mean / latents_std, Qwen-Image's
    scheduler config; saved and read back."""
    from diffusers import (AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImagePipeline,
                           QwenImageTransformer2DModel)
    from transformers import AutoTokenizer
    root = tmp_path_factory.mktemp("qwenimage")
    encoder = save_qwen25vl(root / "te_src")
    tok_dir = build_tokenizer(root / "tok_src", ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], None, "right",
                              "<|endoftext|>", eos="<|im_end|>")
    torch.manual_seed(0)
    transformer = QwenImageTransformer2DModel(patch_size=2, in_channels=4 * Z, out_channels=Z, num_layers=2,
                                              attention_head_dim=32, num_attention_heads=3,
                                              joint_attention_dim=TEXT["hidden_size"], axes_dims_rope=(6, 12, 14))
    vae = AutoencoderKLQwenImage(base_dim=6, z_dim=Z, dim_mult=[1, 2, 3], num_res_blocks=1, attn_scales=[],
                                 temperal_downsample=[False, True], latents_mean=[0.3, -0.2, 0.1, 0.5, -0.4],
                                 latents_std=[1.5, 0.7, 2.1, 1.1, 0.9])
    randomize_(transformer, seed=10, scale=0.15)
    randomize_(vae, seed=11, scale=0.15)
    with torch.no_grad():      # RMS gammas around 1 (randomize_ centres only *norm.weight on 1)
        for name, p in vae.named_parameters():
            if name.endswith("gamma"):
                p.add_(1.0)
    pipe = QwenImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER), vae=vae.eval(),
                             text_encoder=encoder.float().eval(), tokenizer=AutoTokenizer.from_pretrained(str(tok_dir)),
                             transformer=transformer.eval())
    folder = root / "pipeline"
    pipe.save_pretrained(str(folder))
    return folder, QwenImagePipeline.from_pretrained(str(folder)), mlxdiff.load(str(folder), dtype="float32")


def noise(seed=2):
    return np.random.default_rng(seed).standard_normal((1, (H // 8) * (W // 8), 4 * Z)).astype(np.float32)


def reference(pipe, **kwargs):
    """One diffusers run: (its final packed latents, from the step callback, and its image)."""
    final = {}

    def keep_latents(_, i, t, tensors):
        final["latents"] = tensors["latents"]
        return {}
    with torch.no_grad():
        image = pipe(**kwargs, output_type="np", callback_on_step_end=keep_latents).images[0]
    return final["latents"], image


def check_parity(got, ref_latents, ref_image, what):
    """mlxdiff's latents within LATENT_TOL of diffusers' (unpacked), its image within IMAGE_LEVELS."""
    latents = np.asarray(got.latents).astype(np.float32)
    assert latents.shape == ref_latents.shape
    err = max_rel_err(latents, ref_latents)
    shift = parity.levels(got.image, ref_image)
    print(f"{what}: latents max_rel_err {err:.2e}, image {shift}/255, notes {got.notes}")
    assert err <= parity.LATENT_TOL and shift <= parity.IMAGE_LEVELS
    return err


def reference_unpacked(pipe, generator_seed=None, **kwargs):
    """reference(), its latents unpacked to the VAE's layout (the frame axis dropped); a generator seeded afresh."""
    if generator_seed is not None:
        kwargs["generator"] = torch.Generator().manual_seed(generator_seed)
    latents, image = reference(pipe, **kwargs)
    return pipe._unpack_latents(latents, H, W, pipe.vae_scale_factor)[:, :, 0].numpy(), image


# -- the tiny transformer (tests/test_qwenimage_transformer.py) --------------------------------------------------------

# every dimension differs from the others (heads, head dim, D, 4D, 6D, in, out, joint, text length, image tokens);
# RoPE axes unequal, as Qwen-Image's (16, 56, 56); patch 2 as Qwen-Image (in = 4 x 5 channels, out = 4 x 3)
CONFIG = dict(patch_size=2, in_channels=20, out_channels=3, num_layers=3, attention_head_dim=32,
              num_attention_heads=3, joint_attention_dim=28, axes_dims_rope=(6, 12, 14))
TEXT_LEN, PROMPT_LEN = 9, (5, 9)       # batch row b: PROMPT_LEN[b] tokens, then padding (row 1: no padding)
CASES = {"text-to-image": [(1, 3, 5)],               # non-square latent grid
         "edit-plus": [(1, 3, 5), (1, 4, 2)]}      # the target's grid, then a reference image's


def make_torch_model(seed=5):
    import torch
    from diffusers import QwenImageTransformer2DModel
    torch.manual_seed(seed)
    return randomize_(QwenImageTransformer2DModel(**CONFIG), seed=seed).eval()


def text_mask():
    """QwenImagePipeline's prompt_embeds_mask: 1 over each prompt's tokens, 0 over the padding."""
    return np.stack([(np.arange(TEXT_LEN) < n).astype(np.int64) for n in PROMPT_LEN])


def make_inputs(case, seed=0):
    rng = np.random.default_rng(seed)
    n_img = sum(f * h * w for f, h, w in CASES[case])
    return dict(hidden_states=rng.standard_normal((2, n_img, CONFIG["in_channels"])).astype(np.float32),
                encoder_hidden_states=rng.standard_normal((2, TEXT_LEN, CONFIG["joint_attention_dim"])).astype(
                    np.float32),
                timestep=np.array([0.9731, 0.2125], dtype=np.float32))      # the pipeline's t / 1000


def torch_forward(model, inputs, case, mask, shapes=None, dtype=None):
    """diffusers' forward as the pipelines call it: img_shapes one list of grids per batch row."""
    import torch
    kwargs = {k: torch.from_numpy(v).to(dtype or torch.float32) for k, v in inputs.items()}
    if mask is not None:
        kwargs["encoder_hidden_states_mask"] = torch.from_numpy(mask)
    with torch.no_grad():
        return model(**kwargs, img_shapes=[shapes or CASES[case]] * 2, return_dict=False)[0].float().numpy()


def mlx_forward(model, inputs, case, mask, shapes=None):
    kwargs = {k: mx.array(v) for k, v in inputs.items()}
    out = model(**kwargs, img_shapes=shapes or CASES[case],
                encoder_hidden_states_mask=None if mask is None else mx.array(mask))
    return np.array(out.astype(mx.float32))


# -- the VAE's Wan / ComfyUI naming (tests/test_vae_qwenimage.py) ------------------------------------------------------

_RESIDUAL = {"norm1.gamma": "residual.0.gamma", "conv1": "residual.2", "norm2.gamma": "residual.3.gamma",
             "conv2": "residual.6", "conv_shortcut": "shortcut"}


def _residual(rest):
    for ours, theirs in _RESIDUAL.items():
        if rest.startswith(ours):
            return theirs + rest[len(ours):]
    raise AssertionError(rest)


def to_original(name, num_res_blocks):
    """diffusers' name -> Wan's (the inverse of convert_wan_vae_to_diffusers)."""
    top = {"quant_conv": "conv1", "post_quant_conv": "conv2"}
    if (m := re.fullmatch(r"(quant_conv|post_quant_conv)\.(.+)", name)):
        return f"{top[m.group(1)]}.{m.group(2)}"
    if (m := re.fullmatch(r"(encoder|decoder)\.conv_in\.(.+)", name)):
        return f"{m.group(1)}.conv1.{m.group(2)}"
    if (m := re.fullmatch(r"(encoder|decoder)\.norm_out\.gamma", name)):
        return f"{m.group(1)}.head.0.gamma"
    if (m := re.fullmatch(r"(encoder|decoder)\.conv_out\.(.+)", name)):
        return f"{m.group(1)}.head.2.{m.group(2)}"
    if (m := re.fullmatch(r"(encoder|decoder)\.mid_block\.attentions\.0\.(.+)", name)):
        return f"{m.group(1)}.middle.1.{m.group(2)}"
    if (m := re.fullmatch(r"(encoder|decoder)\.mid_block\.resnets\.(\d)\.(.+)", name)):
        return f"{m.group(1)}.middle.{2 * int(m.group(2))}.{_residual(m.group(3))}"
    if (m := re.fullmatch(r"encoder\.down_blocks\.(\d+)\.(.+)", name)):
        rest = m.group(2)
        if rest.startswith(("resample", "time_conv", "norm.", "to_qkv", "proj")):
            return f"encoder.downsamples.{m.group(1)}.{rest}"
        return f"encoder.downsamples.{m.group(1)}.{_residual(rest)}"
    if (m := re.fullmatch(r"decoder\.up_blocks\.(\d+)\.resnets\.(\d+)\.(.+)", name)):
        n = int(m.group(1)) * (num_res_blocks + 2) + int(m.group(2))
        return f"decoder.upsamples.{n}.{_residual(m.group(3))}"
    if (m := re.fullmatch(r"decoder\.up_blocks\.(\d+)\.upsamplers\.0\.(.+)", name)):
        n = int(m.group(1)) * (num_res_blocks + 2) + num_res_blocks + 1
        return f"decoder.upsamples.{n}.{m.group(2)}"
    raise AssertionError(name)


# -- the tiny Qwen-Image-Edit pipelines (tests/test_qwenimage_edit.py) -------------------------------------------------

# the vision tower: 2 blocks (block 0 windowed, block 1 full), heads of 8 (the 2-D RoPE's 4 + 4), 24 wide, MLP 44;
# windows of 16 px = 2 x 2 merged tokens of 2 x 2 patches of 4 px; out 40 = the language model's width
EDIT_VISION = dict(depth=2, hidden_size=24, intermediate_size=44, num_heads=3, out_hidden_size=TEXT["hidden_size"],
                   patch_size=4, spatial_merge_size=2, temporal_patch_size=2, window_size=16,
                   fullatt_block_indexes=[1])
# the processor: patches of 4 px merged 2 x 2 (a multiple of 8 px), at most 48 x 64 px (12 x 16 patches) an image
EDIT_PROCESSOR = dict(patch_size=4, merge_size=2, temporal_patch_size=2, min_pixels=16 * 16, max_pixels=48 * 64)
EDIT_Z = 6                 # VAE latent channels (the transformer takes 4 x 6 = 24); factor 8 (3 downsamples)
EDIT_H, EDIT_W = 64, 96    # the output size the parity runs ask for (tokens 4 x 6); the inputs are ~1 MP
EDIT_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|image_pad|>",
                 "<|vision_end|>"]


def edit_image(seed, size):
    """A smooth colour image (gradients and a few blobs) of `size` (w, h): resampling keeps its content."""
    from PIL import Image
    rng = np.random.default_rng(seed)
    w, h = size
    y, x = np.mgrid[0:h, 0:w] / max(w, h)
    channels = [np.sin(2 * np.pi * (rng.uniform(0.5, 2) * x + rng.uniform(0.5, 2) * y + rng.uniform()))
                for _ in range(3)]
    pixels = (np.stack(channels, axis=-1) * 0.5 + 0.5) * 255
    return Image.fromarray(pixels.clip(0, 255).astype(np.uint8))


def image_only_processor(tokenizer):
    """transformers' Qwen2VLProcessor over the PIL image processor, without its video processor (which needs
    torchvision, not installed here); diffusers' Edit pipelines call it on images only."""
    import transformers
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    class ImageOnly(transformers.Qwen2VLProcessor):
        def check_argument_for_proper_class(self, name, arg):
            return None if arg is None else super().check_argument_for_proper_class(name, arg)
    return ImageOnly(image_processor=Qwen2VLImageProcessorPil(**EDIT_PROCESSOR), tokenizer=tokenizer)


def save_edit_pipelines(root):
    """The tiny QwenImageEditPipeline and QwenImageEditPlusPipeline (the same components) saved under `root` ->
    {"edit" / "plus": (the folder, the diffusers pipeline)}. The processor
    cannot be saved without its video processor, so processor/ is written as Qwen/Qwen-Image-Edit's is: the
    tokenizer's files and preprocessor_config.json."""
    import transformers
    from diffusers import (AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageEditPipeline,
                           QwenImageEditPlusPipeline, QwenImageTransformer2DModel)
    tok_dir = build_tokenizer(root / "tok_src", EDIT_SPECIALS, None, "right", "<|endoftext|>", eos="<|im_end|>")
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(tok_dir))
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in EDIT_SPECIALS[3:]}
    config = transformers.Qwen2_5_VLConfig(text_config=TEXT, vision_config=EDIT_VISION, tie_word_embeddings=False,
                                           image_token_id=ids["<|image_pad|>"],
                                           vision_start_token_id=ids["<|vision_start|>"],
                                           vision_end_token_id=ids["<|vision_end|>"])
    encoder = randomize_(transformers.Qwen2_5_VLForConditionalGeneration(config).eval(), 6, 0.2)
    torch.manual_seed(0)
    transformer = QwenImageTransformer2DModel(patch_size=2, in_channels=4 * EDIT_Z, out_channels=EDIT_Z,
                                              num_layers=2, attention_head_dim=32, num_attention_heads=3,
                                              joint_attention_dim=TEXT["hidden_size"], axes_dims_rope=(6, 12, 14))
    vae = AutoencoderKLQwenImage(base_dim=4, z_dim=EDIT_Z, dim_mult=[1, 2, 2, 3], num_res_blocks=1, attn_scales=[],
                                 temperal_downsample=[False, True, True],
                                 latents_mean=[0.3, -0.2, 0.1, 0.5, -0.4, 0.2],
                                 latents_std=[1.5, 0.7, 2.1, 1.1, 0.9, 1.3])
    randomize_(transformer, seed=12, scale=0.15)
    randomize_(vae, seed=13, scale=0.15)
    with torch.no_grad():      # RMS gammas around 1 (randomize_ centres only *norm.weight on 1)
        for name, p in vae.named_parameters():
            if name.endswith("gamma"):
                p.add_(1.0)
    parts = dict(scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER), vae=vae.eval(), text_encoder=encoder.eval(),
                 tokenizer=tokenizer, processor=None, transformer=transformer.eval())
    edit = _save_edit_folder(root / "edit", QwenImageEditPipeline(**parts), tokenizer)
    plus = QwenImageEditPlusPipeline(**{**parts, "processor": edit[1].processor})
    shutil.copytree(edit[0], root / "plus")
    index = json.loads((root / "plus" / "model_index.json").read_text())
    (root / "plus" / "model_index.json").write_text(json.dumps({**index, "_class_name": "QwenImageEditPlusPipeline"}))
    return {"edit": edit, "plus": (root / "plus", plus)}


def _save_edit_folder(folder, pipe, tokenizer):
    pipe.save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder / "processor"))
    (folder / "processor" / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2VLProcessor", **EDIT_PROCESSOR,
        "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
        "do_resize": True, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
        "do_convert_rgb": True, "resample": 3}))
    index = json.loads((folder / "model_index.json").read_text())
    (folder / "model_index.json").write_text(json.dumps({**index, "processor": ["transformers", "Qwen2VLProcessor"]}))
    pipe.processor = image_only_processor(tokenizer)
    return folder, pipe


def edit_noise(seed=3, height=EDIT_H, width=EDIT_W):
    return np.random.default_rng(seed).standard_normal((1, (height // 16) * (width // 16), 4 * EDIT_Z)).astype(
        np.float32)


def edit_reference(pipe, height=EDIT_H, width=EDIT_W, default_size=False, **kwargs):
    """One diffusers Edit run from edit_noise at height x width (`default_size`: not passed, the pipeline's default
    must be it): (its final latents unpacked to the VAE's layout, its image)."""
    size = {} if default_size else dict(height=height, width=width)
    latents, image = reference(pipe, latents=torch.from_numpy(edit_noise(height=height, width=width)), **size,
                               **kwargs)
    assert image.shape[:2] == (height, width)
    return pipe._unpack_latents(latents, height, width, pipe.vae_scale_factor)[:, :, 0].numpy(), image


# diffusers' Edit sizes (about 1 MP for the VAE, 384 x 384 px for the vision tower in Plus) scaled by AREA_SCALE on
# both sides: the same rule at 1/64 of the area (inputs of ~128 x 128 px), so that a run takes seconds
AREA_SCALE = 1 / 64


@contextlib.contextmanager
def scaled_areas():
    """diffusers' calculate_dimensions (Edit's and Plus's) with its target area scaled by AREA_SCALE."""
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit as edit, pipeline_qwenimage_edit_plus as plus
    originals = edit.calculate_dimensions, plus.calculate_dimensions
    edit.calculate_dimensions = lambda area, ratio: originals[0](area * AREA_SCALE, ratio)
    plus.calculate_dimensions = lambda area, ratio: originals[1](area * AREA_SCALE, ratio)
    try:
        yield
    finally:
        edit.calculate_dimensions, plus.calculate_dimensions = originals


def load_scaled_edit(folder):
    """mlxdiff's Edit pipeline of `folder`, its areas scaled as scaled_areas() scales diffusers'."""
    pipe = mlxdiff.load(str(folder), dtype="float32")
    pipe.VAE_AREA, pipe.CONDITION_AREA = pipe.VAE_AREA * AREA_SCALE, pipe.CONDITION_AREA * AREA_SCALE
    return pipe


@pytest.fixture(scope="module")
def qwen_edit_tiny(tmp_path_factory):
    """{"edit" / "plus": (folder, diffusers pipeline, mlxdiff pipeline with scaled areas)}: a tiny Qwen2.5-VL
    (qwen_tiny's language model widths, a 2-block vision tower of EDIT_VISION), a transformer 96 wide over 6
    latent channels, a 4-level VAE (factor 8); one set of components, saved as each pipeline class."""
    saved = save_edit_pipelines(tmp_path_factory.mktemp("qwenimage_edit"))
    return {name: (folder, pipe, load_scaled_edit(folder)) for name, (folder, pipe) in saved.items()}


# -- Qwen-Image-Edit inpainting and Qwen-Image-Edit-2511 (tests/test_qwenimage_edit_inpaint.py) -----------------------

@contextlib.contextmanager
def scaled_edit_areas(scale):
    """scaled_areas() at another scale, QwenImageEditInpaintPipeline's too (its module holds its own copy of
    calculate_dimensions)."""
    from diffusers.pipelines.qwenimage import (pipeline_qwenimage_edit as edit, pipeline_qwenimage_edit_inpaint as
                                               inpaint, pipeline_qwenimage_edit_plus as plus)
    modules = (edit, plus, inpaint)
    originals = [m.calculate_dimensions for m in modules]
    for module, original in zip(modules, originals):
        module.calculate_dimensions = lambda area, ratio, original=original: original(area * scale, ratio)
    try:
        yield
    finally:
        for module, original in zip(modules, originals):
            module.calculate_dimensions = original


def load_edit_at(folder, scale):
    """load_scaled_edit at another scale (a pipeline of the test's own: the fixture's stay as built)."""
    pipe = mlxdiff.load(str(folder), dtype="float32")
    pipe.VAE_AREA, pipe.CONDITION_AREA = pipe.VAE_AREA * scale, pipe.CONDITION_AREA * scale
    return pipe


def edit_inpaint_draws(pipe, seed, width, height):
    """QwenImageEditInpaintPipeline's first two draws from a Generator seeded `seed` at the output size: (the VAE
    posterior's noise (1, EDIT_Z, H/8, W/8), the packed noise scale_noise mixes in), for mlxdiff's image_noise= and
    latents=. Its third draw (the masked image's posterior) feeds only masked_image_latents, which its loop never
    reads."""
    h, w = height // pipe.vae_scale_factor, width // pipe.vae_scale_factor
    g = torch.Generator().manual_seed(seed)
    posterior = torch.randn((1, EDIT_Z, 1, h, w), generator=g)
    noise = torch.randn((1, 1, EDIT_Z, h, w), generator=g)
    return posterior[:, :, 0].numpy(), pipe._pack_latents(noise, 1, EDIT_Z, h, w).numpy()


def save_zero_cond_folder(plus_folder, folder):
    """A Qwen-Image-Edit-2511-style folder: the tiny Plus folder's files with `zero_cond_t: true` in
    transformer/config.json (the same weights: the switch adds none) -> the folder."""
    shutil.copytree(plus_folder, folder)
    config = folder / "transformer" / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "zero_cond_t": True}))
    return folder


def make_zero_cond_torch_model(base):
    """`base`'s weights (make_torch_model's) in a QwenImageTransformer2DModel with zero_cond_t on."""
    from diffusers import QwenImageTransformer2DModel
    model = QwenImageTransformer2DModel(**CONFIG, zero_cond_t=True)
    model.load_state_dict(base.state_dict())
    return model.eval()
