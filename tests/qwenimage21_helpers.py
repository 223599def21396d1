"""Shared pieces of Qwen-Image 2.1's pipeline tests (tests/test_qwenimage21_pipeline.py, tests/test_qwenimage21_files.py;
no test module imports another): the tiny QwenImage21Pipeline written by save_pretrained, the injected noise,
diffusers' reference run and the parity check.

diffusers' Qwen3VLProcessor cannot be built whole here (its video processor needs torchvision), so the reference
pipeline gets TextProcessor, the processor's text path over the same tokenizer, and the folder's processor/ holds that
tokenizer, under the class name a real folder's model_index.json gives it; with `images`, transformers' own
Qwen3VLProcessor over the PIL image processor without a video processor (ImageProcessor), and processor/ gets its
preprocessor_config.json."""

import json

import numpy as np
import torch

import parity
from helpers import max_rel_err, randomize_
from twins import build_tokenizer

H, W = 64, 96        # multiples of 32: latents 4 x 6 (the VAE's 16), 6 target slots of 2x2 tokens
Z = 20               # latent channels
# the system message's as a chat template: Qwen3-VL's renders a text-only system turn the same way
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
            "{% else %}{% for c in m['content'] %}{{ c['text'] }}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
            "<|video_pad|>"]
TEXT = dict(vocab_size=301, hidden_size=40, intermediate_size=72, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=10, max_position_embeddings=512, rms_norm_eps=1e-6,
            rope_parameters=dict(rope_type="default", rope_theta=5e5, mrope_section=[2, 2, 1], mrope_interleaved=True))
VISION = dict(depth=1, hidden_size=16, intermediate_size=24, num_heads=2, out_hidden_size=40, patch_size=4,
              spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16, deepstack_visual_indexes=[0])
# width 96 and MLP 288: whole 32-wide Q8_0 blocks, so the GGUF quantizes the blocks' weights
TRANSFORMER = dict(in_channels=Z, out_channels=Z, num_layers=2, attention_head_dim=32, num_attention_heads=3,
                   context_in_dim=TEXT["hidden_size"], mlp_ratio=3, axes_dims_rope=(8, 12, 12))
VAE = dict(base_dim=4, decoder_base_dim=6, z_dim=Z, dim_mult=[1, 2, 2, 2, 2], num_res_blocks=1,
           temperal_downsample=[False, True, True, True], latents_mean=[0.05 * i - 0.5 for i in range(Z)],
           latents_std=[0.8 + 0.07 * i for i in range(Z)])
# with the image processor (images=True): patches of 16 px merged 2 x 2, as Qwen3-VL's, so that one image token is
# the 2x2 latent tokens of the VAE's 16 px (the transformer puts a condition image's latents in its image slots);
# 32^2 to 128^2 px an image; Qwen3-VL's mean / std
IMAGE_VISION = dict(VISION, patch_size=16)
PROCESSOR = dict(patch_size=16, merge_size=2, temporal_patch_size=2, min_pixels=32 * 32, max_pixels=128 * 128,
                 image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])
SCHEDULER = dict(num_train_timesteps=1000, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9,
                 base_image_seq_len=256, max_image_seq_len=8192, time_shift_type="exponential")


class TextProcessor:
    """Qwen3VLProcessor's text path, as QwenImage21Pipeline calls it: apply_chat_template (one conversation ->
    a batch of one token list), `tokenizer`, and __call__ without images."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def apply_chat_template(self, conversation, tokenize=False, return_dict=False):
        return [self.tokenizer.apply_chat_template(conversation, tokenize=True, return_dict=False)]

    def __call__(self, text, padding=True, padding_side="left", return_tensors="pt"):
        return self.tokenizer(text, padding=padding, padding_side=padding_side, return_tensors=return_tensors)


class ImageProcessor:
    """transformers' Qwen3VLProcessor over Qwen2VLImageProcessorPil (PROCESSOR), without its video processor; its
    system-message chat template the tokenizer's, as TextProcessor's."""

    def __new__(cls, tokenizer):
        import transformers
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        class ImageOnly(transformers.Qwen3VLProcessor):
            def check_argument_for_proper_class(self, name, arg):
                return None if arg is None else super().check_argument_for_proper_class(name, arg)

            def apply_chat_template(self, conversation, tokenize=False, return_dict=False):
                return [self.tokenizer.apply_chat_template(conversation, tokenize=True, return_dict=False)]
        return ImageOnly(image_processor=Qwen2VLImageProcessorPil(**PROCESSOR), tokenizer=tokenizer)


def save_pipeline(root, transformer_config=TRANSFORMER, images=False):
    """A tiny QwenImage21Pipeline: Qwen3-VL 40 wide (3 layers; a 1-block vision tower, heads of 8, its deepstack
    merger after block 0), a transformer 96 wide (3 heads of 32, RoPE axes 8, 12, 12; 2 blocks) over 20 latent
    channels, a 5-level residual VAE (factor 16, RGBA) with its own latents_mean / latents_std; written by
    save_pretrained under `root` (`transformer_config` in place of TRANSFORMER: more blocks to stream; `images`: the
    image processor too, in processor/ and on the reference pipeline). Returns (the folder, the diffusers
    pipeline)."""
    import transformers
    from diffusers import AutoencoderKLQwenImage21, FlowMatchEulerDiscreteScheduler, QwenImage21Pipeline, \
        QwenImage21Transformer2DModel
    from transformers import AutoTokenizer
    tok_dir = build_tokenizer(root / "tok_src", SPECIALS, TEMPLATE, "right", "<|endoftext|>", eos="<|im_end|>")
    tokenizer = AutoTokenizer.from_pretrained(str(tok_dir))
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIALS}
    config = transformers.Qwen3VLConfig(text_config=TEXT, vision_config=IMAGE_VISION if images else VISION,
                                        tie_word_embeddings=False,
                                        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                                        vision_start_token_id=ids["<|vision_start|>"],
                                        vision_end_token_id=ids["<|vision_end|>"])
    encoder = randomize_(transformers.Qwen3VLForConditionalGeneration(config).eval(), 5, 0.2)
    torch.manual_seed(0)
    transformer = randomize_(QwenImage21Transformer2DModel(**transformer_config), seed=10, scale=0.2).eval()
    vae = randomize_(AutoencoderKLQwenImage21(**VAE), seed=11, scale=0.15)
    with torch.no_grad():      # RMS gammas around 1 (randomize_ centres only *norm.weight on 1)
        for name, p in vae.named_parameters():
            if name.endswith("gamma"):
                p.add_(1.0)
    pipe = QwenImage21Pipeline(scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER), vae=vae.eval(),
                               text_encoder=encoder.float().eval(), processor=TextProcessor(tokenizer),
                               transformer=transformer)
    folder = root / "pipeline"
    pipe.save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder / "processor"))
    index = json.loads((folder / "model_index.json").read_text())
    index["processor"] = ["transformers", "Qwen3VLProcessor"]       # what a real folder names
    (folder / "model_index.json").write_text(json.dumps(index))
    if images:
        (folder / "processor" / "preprocessor_config.json").write_text(json.dumps({
            "image_processor_type": "Qwen2VLImageProcessorFast", "processor_class": "Qwen3VLProcessor", **PROCESSOR,
            "do_resize": True, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
            "do_convert_rgb": True, "resample": 3}))
        pipe.processor = ImageProcessor(tokenizer)
    return folder, pipe


def noise(seed=2):
    return np.random.default_rng(seed).standard_normal((1, (H // 16) * (W // 16), Z)).astype(np.float32)


def reference(pipe, **kwargs):
    """One diffusers run: (its final packed latents, from the step callback, and its image)."""
    final = {}

    def keep_latents(_, i, t, tensors):
        final["latents"] = tensors["latents"]
        return {}
    with torch.no_grad():
        image = pipe(**kwargs, output_type="np", callback_on_step_end=keep_latents).images[0]
    return final["latents"].numpy(), image


def check_parity(got, ref_latents, ref_image, what):
    latents = np.asarray(got.latents).astype(np.float32)
    b, c = latents.shape[:2]
    packed = latents.reshape(b, c, -1).transpose(0, 2, 1)       # diffusers' layout: (B, h w, C)
    err = max_rel_err(packed, ref_latents)
    shift = parity.levels(got.image, ref_image)
    print(f"{what}: latents max_rel_err {err:.2e}, image {shift}/255, notes {got.notes}")
    assert err <= parity.LATENT_TOL and shift <= parity.IMAGE_LEVELS
