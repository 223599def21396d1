"""FLUX 3 test pieces shared by tests/test_flux3_pipeline.py and tests/test_flux3_files.py (no test module imports
another): the tiny model (Qwen3-VL 24 wide, 3 layers; a FLUX 3 transformer 64 wide; the FLUX.2 VAE twin, factor 2)
written by ModularPipeline.save_pretrained, the modular pipeline's reference run and the parity check."""

import json

import numpy as np
import torch

from helpers import randomize_
from parity import IMAGE_LEVELS, LATENT_TOL, levels, rel_diff
from twins import QWEN3_TEMPLATE, build_tokenizer, make_flux2_twin, picture

H, W = 32, 48                       # VAE factor 2 x the 2x2 patches: 8 x 12 tokens
Z = 5                               # VAE latent channels: the transformer takes 4 x 5 = 20
TAPS = (1, 2, 3)                    # hidden states of the 3-layer encoder (diffusers: 4, 8, ..., 32)
TEXT = dict(vocab_size=301, hidden_size=24, intermediate_size=40, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=256, rms_norm_eps=1e-6,
            rope_parameters=dict(rope_type="default", rope_theta=5e5, mrope_section=[2, 1, 1], mrope_interleaved=True))
VISION = dict(depth=1, hidden_size=16, intermediate_size=24, num_heads=2, out_hidden_size=24, patch_size=4,
              spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16, deepstack_visual_indexes=[0])
# 64 wide, MLP 160: the blocks' input widths are whole 32-wide Q8_0 blocks
TRANSFORMER = dict(in_channels=4 * Z, cond_in_channels=4 * Z, num_layers=1, num_single_layers=2, attention_head_dim=32,
                   num_attention_heads=2, joint_attention_dim=len(TAPS) * TEXT["hidden_size"], timestep_channels=36,
                   mlp_ratio=2.5, axes_dims_rope=(8, 8, 8, 8), rope_theta=10000, eps=1e-6)
STEPS = 2
PROMPT, OTHER = "a red fox sitting in the snow at dawn", "a watercolor painting of a lighthouse by the sea"
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>"]


class Processor:
    """What the modular text encoder step calls of its AutoProcessor, `apply_chat_template` and `.tokenizer`, over
    the stand-in tokenizer (transformers' Qwen3VLProcessor needs torchvision for its video processor; for a prompt
    of text alone the processor renders the same chat template)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def apply_chat_template(self, messages, **kwargs):
        return self.tokenizer.apply_chat_template(messages, **kwargs)


def save_folder(kind, root, transformer_config=TRANSFORMER):
    """A tiny FLUX 3 model of `kind` written by ModularPipeline.save_pretrained (the tokenizer saved beside it under
    tokenizer/, as a saved AutoProcessor's files are; `transformer_config` in place of TRANSFORMER: more blocks to
    stream); returns (the folder, the diffusers pipeline, run in memory)."""
    import transformers
    from diffusers import Flux3Transformer2DModel
    from diffusers.modular_pipelines import Flux3AutoBlocks, Flux3DistilledAutoBlocks
    config = transformers.Qwen3VLConfig(text_config=TEXT, vision_config=VISION, tie_word_embeddings=False)
    encoder = randomize_(transformers.Qwen3VLForConditionalGeneration(config).eval(), 5, 0.2)
    tok_dir = build_tokenizer(root / "tok_src", SPECIALS, QWEN3_TEMPLATE, "right", "<|endoftext|>", eos="<|im_end|>")
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(tok_dir))
    torch.manual_seed(0)
    transformer = randomize_(Flux3Transformer2DModel(**transformer_config, flow_map=kind == "distilled"), seed=11,
                             scale=0.15).eval()
    vae = make_flux2_twin(dict(block_out_channels=(8, 12), layers_per_block=1, latent_channels=Z,
                               norm_num_groups=4), 7)
    blocks = Flux3DistilledAutoBlocks() if kind == "distilled" else Flux3AutoBlocks()
    blocks.sub_blocks.pop("prompt_upsampler")
    pipe = blocks.init_pipeline()
    pipe.update_components(transformer=transformer, vae=vae, text_encoder=encoder)
    folder = root / "pipeline"
    pipe.save_pretrained(str(folder), overwrite_modular_index=True)
    tokenizer.save_pretrained(str(folder / "tokenizer"))
    index = json.loads((folder / "modular_model_index.json").read_text())
    assert "model_index.json" not in {p.name for p in folder.iterdir()}
    index["tokenizer"] = ["transformers", "Qwen3VLProcessor", {**index["tokenizer"][2], "subfolder": "tokenizer"}]
    (folder / "modular_model_index.json").write_text(json.dumps(index))
    pipe.update_components(tokenizer=Processor(tokenizer))
    return folder, pipe


NOISE = np.random.default_rng(2).standard_normal((1, 4 * Z, H // 4, W // 4)).astype(np.float32)
# cropped to multiples of 16 (Flux3ImageProcessor's grid, whatever the VAE): 32x48 and 64x48, 96 and 192 tokens
# (VAE factor 2)
REFERENCES = [picture(40, 56, 1), picture(72, 48, 2)]


def reference(pipe, **kwargs):
    """The modular pipeline's final latents (B, C, h, w, before the VAE's de-normalisation, as Result.latents) and
    its float image; image=[] is text-to-image."""
    if kwargs.get("image") == []:
        kwargs.pop("image")
    out = pipe(latents=torch.from_numpy(NOISE), height=H, width=W, num_inference_steps=STEPS,
               text_encoder_out_layers=TAPS, output_type="np", output=["latents", "images"], **kwargs)
    return out["latents"].float().numpy(), out["images"][0]


def check(ours, want):
    assert ours.latents.shape == NOISE.shape
    err = rel_diff(ours.latents, want[0])
    print(f"latents max_rel_err {err:.2e}, image {levels(ours.image, want[1])} levels")
    assert err <= LATENT_TOL
    assert levels(ours.image, want[1]) <= IMAGE_LEVELS
