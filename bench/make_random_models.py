"""Write random-weight pipelines at the REAL configs, in the diffusers layout, for bench/ runs.

    python bench/make_random_models.py sd3.5-medium [--out weights/bench-sd3.5-medium-random] [--device cuda]
    python bench/make_random_models.py sd3.5-large [--out DIR] [--device cuda]      # 8.1 B-parameter MMDiT
    python bench/make_random_models.py klein-4b [--out DIR] [--device cuda]
    python bench/make_random_models.py flux2-dev [--out DIR] [--device cuda] [--text-layers 30]
    python bench/make_random_models.py flux1-dev | flux1-tiny [--out DIR] [--device cuda]   # tiny: CPU chain test
    python bench/make_random_models.py sdxl | sd1.5 [--out DIR] [--device cuda]
    python bench/make_random_models.py sdxl-controlnet [--out DIR] [--device cuda]   # ~5 GB, controlnet-canny-sdxl-1.0
    python bench/make_random_models.py sdxl-tiny | sdxl-controlnet-tiny [--out DIR]    # tiny: CPU chain test
    python bench/make_random_models.py zimage-turbo | zimage-turbo-tiny [--out DIR] [--device cuda]   # ~20 GB
    python bench/make_random_models.py qwen-image | qwen-image-tiny [--out DIR] [--device cuda]       # ~57 GB

flux2-dev writes every component but the transformer's weights (only its config.json): its denoiser is the random
Q4_K_M GGUF of bench/flux2_dev_gpu.py write-gguf, given with --transformer on both sides. Its Mistral-Small-3.1
text encoder keeps the first --text-layers layers (30, the deepest tap, as Comfy-Org's pruned encoder file does):
35 GB in bf16 instead of 48. `--device cuda` initialises on the GPU (minutes faster at these sizes).

Weights are bf16 (as the real checkpoints ship), created with torch's default initialisation on the CPU and saved
with save_pretrained, so that mlxdiff and diffusers read the very same files. Tokenizers are mlxdiff's bundled real
CLIP and T5 vocabularies. These weights are random: only memory and speed mean anything.
"""

import argparse
import gc
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def save_components(out: Path, builders: dict):
    """Build each component in bf16, save_pretrained it, free it; components already written are kept."""
    import torch
    out.mkdir(parents=True, exist_ok=True)
    for name, make in builders.items():
        if (out / name / "config.json").exists():
            continue
        t = time.time()
        model = make().to(torch.bfloat16)
        model.save_pretrained(str(out / name), max_shard_size="5GB")
        print(f"{name}: {sum(p.numel() for p in model.parameters()) / 1e9:.3f} B params, {time.time() - t:.0f} s",
              flush=True)
        del model
        gc.collect()


def sd35_medium(out: Path, large=False):
    import torch
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel
    sys.path.insert(0, str(ROOT))
    from mlxdiff.tokenizers import bundled_clip_tokenizer, bundled_t5_tokenizer

    torch.set_default_dtype(torch.bfloat16)
    builders = {
        "transformer": lambda: SD3Transformer2DModel(   # SD3.5 Large: 38 blocks of 38 heads, no dual attention
            sample_size=128, patch_size=2, in_channels=16, num_layers=38, attention_head_dim=64,
            num_attention_heads=38, joint_attention_dim=4096, caption_projection_dim=2432,
            pooled_projection_dim=2048, out_channels=16, pos_embed_max_size=192, qk_norm="rms_norm")
        if large else SD3Transformer2DModel(
            sample_size=128, patch_size=2, in_channels=16, num_layers=24, attention_head_dim=64,
            num_attention_heads=24, joint_attention_dim=4096, caption_projection_dim=1536,
            pooled_projection_dim=2048, out_channels=16, pos_embed_max_size=384,
            dual_attention_layers=tuple(range(13)), qk_norm="rms_norm"),
        "vae": lambda: AutoencoderKL(
            in_channels=3, out_channels=3, block_out_channels=(128, 256, 512, 512), layers_per_block=2,
            latent_channels=16, norm_num_groups=32, down_block_types=("DownEncoderBlock2D",) * 4,
            up_block_types=("UpDecoderBlock2D",) * 4, scaling_factor=1.5305, shift_factor=0.0609,
            use_quant_conv=False, use_post_quant_conv=False, sample_size=1024, force_upcast=True),
        "text_encoder": lambda: CLIPTextModelWithProjection(CLIPTextConfig(
            vocab_size=49408, hidden_size=768, intermediate_size=3072, projection_dim=768, num_hidden_layers=12,
            num_attention_heads=12, max_position_embeddings=77, hidden_act="quick_gelu", bos_token_id=49406,
            eos_token_id=49407, pad_token_id=1)),
        "text_encoder_2": lambda: CLIPTextModelWithProjection(CLIPTextConfig(
            vocab_size=49408, hidden_size=1280, intermediate_size=5120, projection_dim=1280, num_hidden_layers=32,
            num_attention_heads=20, max_position_embeddings=77, hidden_act="gelu", bos_token_id=49406,
            eos_token_id=49407, pad_token_id=1)),
        "text_encoder_3": lambda: T5EncoderModel(T5Config(
            vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
            feed_forward_proj="gated-gelu", relative_attention_num_buckets=32, relative_attention_max_distance=128,
            layer_norm_epsilon=1e-6)),
    }
    save_components(out, builders)
    bundled_clip_tokenizer("<|endoftext|>").save_pretrained(str(out / "tokenizer"))
    bundled_clip_tokenizer("!").save_pretrained(str(out / "tokenizer_2"))
    bundled_t5_tokenizer().save_pretrained(str(out / "tokenizer_3"))
    FlowMatchEulerDiscreteScheduler(shift=3.0).save_pretrained(str(out / "scheduler"))
    import json
    index = {"_class_name": "StableDiffusion3Pipeline", "_diffusers_version": "0.42.1",
             "transformer": ["diffusers", "SD3Transformer2DModel"], "vae": ["diffusers", "AutoencoderKL"],
             "text_encoder": ["transformers", "CLIPTextModelWithProjection"],
             "text_encoder_2": ["transformers", "CLIPTextModelWithProjection"],
             "text_encoder_3": ["transformers", "T5EncoderModel"], "tokenizer": ["transformers", "CLIPTokenizer"],
             "tokenizer_2": ["transformers", "CLIPTokenizer"], "tokenizer_3": ["transformers", "T5TokenizerFast"],
             "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"], "image_encoder": [None, None],
             "feature_extractor": [None, None]}
    (out / "model_index.json").write_text(json.dumps(index, indent=1))


QWEN3_CHAT_TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}")


MISTRAL_CHAT_TEMPLATE = (   # the parts of Mistral-Small-3.1's template that FLUX.2-dev's prompts use
    "{{- bos_token }}{%- for message in messages %}{%- set text = message['content'][0]['text'] %}"
    "{%- if message['role'] == 'system' %}{{- '[SYSTEM_PROMPT]' + text + '[/SYSTEM_PROMPT]' }}"
    "{%- elif message['role'] == 'user' %}{{- '[INST]' + text + '[/INST]' }}{%- endif %}{%- endfor %}")


def stand_in_tokenizer(folder: Path, specials, template, **special_tokens):
    """A small byte-level BPE in a family's chat format (the real vocabularies are not available offline; token ids
    only need to be valid for the random model)."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ["a photo of a fox in the snow", "a red circle on a blue background", "a watercolor lighthouse"]
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, chat_template=template, **special_tokens)
    hf.save_pretrained(str(folder))


def qwen_like_tokenizer(folder: Path):
    stand_in_tokenizer(folder, ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"],
                       QWEN3_CHAT_TEMPLATE, eos_token="<|im_end|>", pad_token="<|endoftext|>", padding_side="right")


def mistral_like_tokenizer(folder: Path):
    stand_in_tokenizer(folder, ["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]",
                                "<pad>", "[IMG]"], MISTRAL_CHAT_TEMPLATE, bos_token="<s>", eos_token="</s>",
                       pad_token="<pad>", padding_side="left")


def flux2_scheduler(out: Path):
    from diffusers import FlowMatchEulerDiscreteScheduler
    FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5,
                                    max_shift=1.15, base_image_seq_len=256, max_image_seq_len=4096,
                                    time_shift_type="exponential").save_pretrained(str(out / "scheduler"))


def klein_4b(out: Path):
    """FLUX.2 klein-4B: Qwen3-4B encoder (hidden 2560, 36 layers), transformer 3.88 B, FLUX.2 VAE."""
    import json
    import torch
    import transformers
    from diffusers import AutoencoderKLFlux2, Flux2Transformer2DModel
    torch.set_default_dtype(torch.bfloat16)
    builders = {
        "transformer": lambda: Flux2Transformer2DModel(
            patch_size=1, in_channels=128, num_layers=5, num_single_layers=20, attention_head_dim=128,
            num_attention_heads=24, joint_attention_dim=7680, timestep_guidance_channels=256, mlp_ratio=3.0,
            axes_dims_rope=(32, 32, 32, 32), rope_theta=2000, eps=1e-6, guidance_embeds=False),
        "vae": lambda: AutoencoderKLFlux2(),
        "text_encoder": lambda: transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
            vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
            num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
            rope_theta=1000000, rms_norm_eps=1e-6, tie_word_embeddings=True)),
    }
    save_components(out, builders)
    qwen_like_tokenizer(out / "tokenizer")
    flux2_scheduler(out)
    index = {"_class_name": "Flux2KleinPipeline", "_diffusers_version": "0.42.1", "is_distilled": True,
             "transformer": ["diffusers", "Flux2Transformer2DModel"], "vae": ["diffusers", "AutoencoderKLFlux2"],
             "text_encoder": ["transformers", "Qwen3ForCausalLM"], "tokenizer": ["transformers", "PreTrainedTokenizerFast"],
             "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"]}
    (out / "model_index.json").write_text(json.dumps(index, indent=1))


def flux2_dev(out: Path, text_layers=30):
    """FLUX.2-dev without the transformer's weights (the GGUF replaces them): Mistral-Small-3.1 (hidden 5120, the
    first `text_layers` layers, the Pixtral vision tower as the real folder has it), the FLUX.2 VAE."""
    import json
    import torch
    import transformers
    from diffusers import AutoencoderKLFlux2
    torch.set_default_dtype(torch.bfloat16)
    text = dict(model_type="mistral", hidden_size=5120, intermediate_size=32768, num_hidden_layers=text_layers,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=131072, rope_theta=1e9,
                rms_norm_eps=1e-5, max_position_embeddings=131072, sliding_window=None)
    builders = {
        "vae": lambda: AutoencoderKLFlux2(),
        "text_encoder": lambda: transformers.Mistral3ForConditionalGeneration(transformers.Mistral3Config(
            text_config=text, tie_word_embeddings=False)),
    }
    save_components(out, builders)
    shapes = json.loads((ROOT / "bench" / "flux2_dev_bfl_shapes.json").read_text())["config"]
    (out / "transformer").mkdir(exist_ok=True)
    (out / "transformer" / "config.json").write_text(json.dumps(
        {"_class_name": "Flux2Transformer2DModel", "_diffusers_version": "0.42.1", "out_channels": None, **shapes},
        indent=1))
    mistral_like_tokenizer(out / "tokenizer")
    flux2_scheduler(out)
    index = {"_class_name": "Flux2Pipeline", "_diffusers_version": "0.42.1",
             "transformer": ["diffusers", "Flux2Transformer2DModel"], "vae": ["diffusers", "AutoencoderKLFlux2"],
             "text_encoder": ["transformers", "Mistral3ForConditionalGeneration"],
             "tokenizer": ["transformers", "PreTrainedTokenizerFast"],
             "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"]}
    (out / "model_index.json").write_text(json.dumps(index, indent=1))


SDXL_UNET = dict(   # SDXL base 1.0's unet/config.json (the parts that differ from diffusers' defaults)
    block_out_channels=(320, 640, 1280), layers_per_block=2,
    down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
    transformer_layers_per_block=(1, 2, 10), attention_head_dim=(5, 10, 20), cross_attention_dim=2048,
    use_linear_projection=True, addition_embed_type="text_time", addition_time_embed_dim=256,
    projection_class_embeddings_input_dim=2816)
SDXL_TINY_UNET = dict(   # the same layout, tiny (CLIP widths 32 + 64; 64 + 6 x 8 added-time inputs)
    block_out_channels=(16, 32, 64), layers_per_block=1, norm_num_groups=8,
    down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
    transformer_layers_per_block=(1, 1, 2), attention_head_dim=(1, 2, 4), cross_attention_dim=96,
    use_linear_projection=True, addition_embed_type="text_time", addition_time_embed_dim=8,
    projection_class_embeddings_input_dim=64 + 6 * 8)


def unet_family(out: Path, xl=True, tiny=False):
    """SDXL base 1.0 (2.57 B UNet, CLIP-L + OpenCLIP bigG) or SD 1.5 (0.86 B UNet, CLIP-L) at their real configs;
    tiny=True (SDXL only): the same layout, tiny (a whole-chain test on the CPU)."""
    import json
    import torch
    from diffusers import AutoencoderKL, EulerDiscreteScheduler, PNDMScheduler, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection
    sys.path.insert(0, str(ROOT))
    from mlxdiff.tokenizers import bundled_clip_tokenizer

    torch.set_default_dtype(torch.bfloat16)
    if tiny:
        clip_l = dict(hidden_size=32, intermediate_size=64, projection_dim=32, num_hidden_layers=2, num_attention_heads=2)
        clip_g = dict(hidden_size=64, intermediate_size=128, projection_dim=64, num_hidden_layers=2, num_attention_heads=2)
        vae = dict(block_out_channels=(16, 16, 16, 16), layers_per_block=1, norm_num_groups=8)
    else:
        clip_l = dict(hidden_size=768, intermediate_size=3072, projection_dim=768, num_hidden_layers=12,
                      num_attention_heads=12)
        clip_g = dict(hidden_size=1280, intermediate_size=5120, projection_dim=1280, num_hidden_layers=32,
                      num_attention_heads=20)
        vae = dict(block_out_channels=(128, 256, 512, 512), layers_per_block=2, norm_num_groups=32)
    clip = dict(vocab_size=49408, max_position_embeddings=77, bos_token_id=49406, eos_token_id=49407, pad_token_id=1)
    builders = {
        "unet": lambda: UNet2DConditionModel(
            sample_size=128, up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
            **(SDXL_TINY_UNET if tiny else SDXL_UNET))
        if xl else UNet2DConditionModel(sample_size=64, cross_attention_dim=768, attention_head_dim=8),
        "vae": lambda: AutoencoderKL(
            in_channels=3, out_channels=3, latent_channels=4, down_block_types=("DownEncoderBlock2D",) * 4,
            up_block_types=("UpDecoderBlock2D",) * 4, scaling_factor=0.13025 if xl else 0.18215,
            sample_size=1024 if xl else 512, force_upcast=xl, **vae),
        "text_encoder": lambda: CLIPTextModel(CLIPTextConfig(hidden_act="quick_gelu", **clip, **clip_l)),
    }
    if xl:
        builders["text_encoder_2"] = lambda: CLIPTextModelWithProjection(CLIPTextConfig(
            hidden_act="gelu", **clip, **clip_g))
    save_components(out, builders)
    bundled_clip_tokenizer("<|endoftext|>").save_pretrained(str(out / "tokenizer"))
    common = dict(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", steps_offset=1)
    if xl:
        EulerDiscreteScheduler(**common, timestep_spacing="leading").save_pretrained(str(out / "scheduler"))
        bundled_clip_tokenizer("!").save_pretrained(str(out / "tokenizer_2"))
    else:
        PNDMScheduler.from_config(dict(common, skip_prk_steps=True, set_alpha_to_one=False)).save_pretrained(
            str(out / "scheduler"))
    index = {"_class_name": "StableDiffusionXLPipeline" if xl else "StableDiffusionPipeline",
             "_diffusers_version": "0.42.1", "unet": ["diffusers", "UNet2DConditionModel"],
             "vae": ["diffusers", "AutoencoderKL"], "text_encoder": ["transformers", "CLIPTextModel"],
             "tokenizer": ["transformers", "CLIPTokenizer"],
             "scheduler": ["diffusers", "EulerDiscreteScheduler" if xl else "PNDMScheduler"]}
    if xl:
        index.update(text_encoder_2=["transformers", "CLIPTextModelWithProjection"],
                     tokenizer_2=["transformers", "CLIPTokenizer"], force_zeros_for_empty_prompt=True)
    else:
        index.update(safety_checker=[None, None], feature_extractor=[None, None], requires_safety_checker=False)
    (out / "model_index.json").write_text(json.dumps(index, indent=1))


def flux1_dev(out: Path, tiny=False):
    """FLUX.1-dev (12 B transformer, CLIP-L, T5-XXL v1.1, the 16-channel FLUX.1 VAE); tiny=True: the same layout at a
    tiny config (a whole-chain test on the CPU; its transformer's dims are multiples of 256 for the K-quant GGUFs)."""
    import json
    import torch
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel
    sys.path.insert(0, str(ROOT))
    from mlxdiff.tokenizers import bundled_clip_tokenizer, bundled_t5_tokenizer

    torch.set_default_dtype(torch.bfloat16)
    if tiny:
        tr = dict(num_layers=1, num_single_layers=1, num_attention_heads=2, joint_attention_dim=64,
                  pooled_projection_dim=32)
        clip = dict(hidden_size=32, intermediate_size=64, projection_dim=32, num_hidden_layers=2, num_attention_heads=2)
        t5 = dict(d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4)
        vae = dict(block_out_channels=(32, 32, 32, 32), layers_per_block=1, norm_num_groups=8)
    else:
        tr = dict(num_layers=19, num_single_layers=38, num_attention_heads=24, joint_attention_dim=4096,
                  pooled_projection_dim=768)
        clip = dict(hidden_size=768, intermediate_size=3072, projection_dim=768, num_hidden_layers=12,
                    num_attention_heads=12)
        t5 = dict(d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64)
        vae = dict(block_out_channels=(128, 256, 512, 512), layers_per_block=2, norm_num_groups=32)
    builders = {
        "transformer": lambda: FluxTransformer2DModel(
            patch_size=1, in_channels=64, out_channels=None, attention_head_dim=128, guidance_embeds=True,
            axes_dims_rope=(16, 56, 56), **tr),
        "vae": lambda: AutoencoderKL(
            in_channels=3, out_channels=3, latent_channels=16, down_block_types=("DownEncoderBlock2D",) * 4,
            up_block_types=("UpDecoderBlock2D",) * 4, scaling_factor=0.3611, shift_factor=0.1159,
            use_quant_conv=False, use_post_quant_conv=False, sample_size=1024, force_upcast=True, **vae),
        "text_encoder": lambda: CLIPTextModel(CLIPTextConfig(
            vocab_size=49408, max_position_embeddings=77, hidden_act="quick_gelu", bos_token_id=49406,
            eos_token_id=49407, pad_token_id=1, **clip)),
        "text_encoder_2": lambda: T5EncoderModel(T5Config(
            vocab_size=32128, feed_forward_proj="gated-gelu", relative_attention_num_buckets=32,
            relative_attention_max_distance=128, layer_norm_epsilon=1e-6, **t5)),
    }
    save_components(out, builders)
    bundled_clip_tokenizer("<|endoftext|>").save_pretrained(str(out / "tokenizer"))
    bundled_t5_tokenizer().save_pretrained(str(out / "tokenizer_2"))
    FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5,
                                    max_shift=1.15, base_image_seq_len=256, max_image_seq_len=4096
                                    ).save_pretrained(str(out / "scheduler"))
    index = {"_class_name": "FluxPipeline", "_diffusers_version": "0.42.1",
             "transformer": ["diffusers", "FluxTransformer2DModel"], "vae": ["diffusers", "AutoencoderKL"],
             "text_encoder": ["transformers", "CLIPTextModel"], "text_encoder_2": ["transformers", "T5EncoderModel"],
             "tokenizer": ["transformers", "CLIPTokenizer"], "tokenizer_2": ["transformers", "T5TokenizerFast"],
             "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"], "image_encoder": [None, None],
             "feature_extractor": [None, None]}
    (out / "model_index.json").write_text(json.dumps(index, indent=1))


def zimage_turbo(out: Path, tiny=False):
    """Tongyi-MAI/Z-Image-Turbo: ZImageTransformer2DModel (6.15 B), a Qwen3-4B Qwen3Model encoder (read up to
    hidden_states[-2]), the FLUX.1 AutoencoderKL, FlowMatchEulerDiscreteScheduler with the static shift 3.0 Turbo
    ships. Transformer values: diffusers 0.42.1's ZImageTransformer2DModel defaults (dim 3840, 30 + 2 + 2 layers, 30
    heads, cap_feat_dim 2560, axes_dims (32, 48, 48), rope_theta 256, t_scale 1000), except axes_lens (1536, 512, 512)
    of the released transformer/config.json (mlxdiff/models/zimage.py ModelArgs says the same). Qwen3-4B: its
    config.json (hidden 2560, 36 layers, 32 heads, 8 kv heads of 128, intermediate 9728, theta 1e6, tied embeddings).
    tiny=True: the same layout, tiny (a whole-chain test on the CPU): encoder and transformer about 7 MB each, mostly
    blocks (a 512-token vocabulary, which the stand-in tokenizer's 400 ids fit), so that one small --memory-limit
    streams both."""
    import json
    import torch
    import transformers
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, ZImageTransformer2DModel
    torch.set_default_dtype(torch.bfloat16)
    if tiny:
        tr = dict(in_channels=16, dim=192, n_layers=4, n_refiner_layers=1, n_heads=2, n_kv_heads=2, cap_feat_dim=256,
                  axes_dims=(32, 32, 32), axes_lens=(512, 64, 64))   # blocks, not t_embedder (mid 1024), dominate
        text = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=6, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=64, max_position_embeddings=512, vocab_size=512)
        vae = dict(block_out_channels=(16, 16, 16, 16), layers_per_block=1, norm_num_groups=8)
    else:
        tr = dict(in_channels=16, dim=3840, n_layers=30, n_refiner_layers=2, n_heads=30, n_kv_heads=30,
                  cap_feat_dim=2560, axes_dims=(32, 48, 48), axes_lens=(1536, 512, 512))
        text = dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                    num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, vocab_size=151936)
        vae = dict(block_out_channels=(128, 256, 512, 512), layers_per_block=2, norm_num_groups=32)
    builders = {
        "transformer": lambda: ZImageTransformer2DModel(
            all_patch_size=(2,), all_f_patch_size=(1,), norm_eps=1e-5, qk_norm=True, rope_theta=256.0,
            t_scale=1000.0, **tr),
        "vae": lambda: AutoencoderKL(
            in_channels=3, out_channels=3, latent_channels=16, down_block_types=("DownEncoderBlock2D",) * 4,
            up_block_types=("UpDecoderBlock2D",) * 4, scaling_factor=0.3611, shift_factor=0.1159,
            use_quant_conv=False, use_post_quant_conv=False, sample_size=1024, force_upcast=True, **vae),
        "text_encoder": lambda: transformers.Qwen3Model(transformers.Qwen3Config(
            rope_theta=1000000, rms_norm_eps=1e-6, tie_word_embeddings=True, **text)),
    }
    save_components(out, builders)
    qwen_like_tokenizer(out / "tokenizer")
    FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False
                                    ).save_pretrained(str(out / "scheduler"))
    index = {"_class_name": "ZImagePipeline", "_diffusers_version": "0.42.1",
             "transformer": ["diffusers", "ZImageTransformer2DModel"], "vae": ["diffusers", "AutoencoderKL"],
             "text_encoder": ["transformers", "Qwen3Model"], "tokenizer": ["transformers", "PreTrainedTokenizerFast"],
             "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"]}
    (out / "model_index.json").write_text(json.dumps(index, indent=1))


def qwen_image(out: Path, tiny=False):
    """Qwen/Qwen-Image: QwenImageTransformer2DModel (20.4 B: 60 layers, 24 heads of 128, joint 3584; diffusers'
    class defaults = the released config), Qwen2.5-VL-7B-Instruct's language model (hidden 3584, 28 layers, 28 heads,
    4 kv heads, intermediate 18944, mrope_section (16, 24, 24), theta 1e6, untied lm_head) in a
    Qwen2_5_VLForConditionalGeneration whose vision tower is one tiny block (only the language model is read by
    either side; the real 0.67 B tower would only cost disk), AutoencoderKLQwenImage at its class defaults (=
    the released config), Qwen-Image's scheduler_config.json. tiny=True: the same layout, tiny, as
    zimage_turbo's."""
    import json
    import torch
    import transformers
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel
    torch.set_default_dtype(torch.bfloat16)
    if tiny:
        tr = dict(in_channels=64, out_channels=16, num_layers=8, attention_head_dim=32, num_attention_heads=3,
                  joint_attention_dim=256, axes_dims_rope=(6, 12, 14))
        text = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=6, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=1024, vocab_size=512,
                    rope_parameters=dict(rope_type="default", rope_theta=1e6, mrope_section=[8, 12, 12]))
        vae = dict(base_dim=8, dim_mult=[1, 2, 2, 2], num_res_blocks=1)
    else:
        tr = dict(in_channels=64, out_channels=16, num_layers=60, attention_head_dim=128, num_attention_heads=24,
                  joint_attention_dim=3584, axes_dims_rope=(16, 56, 56))
        text = dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                    num_key_value_heads=4, max_position_embeddings=128000, vocab_size=152064,
                    rope_parameters=dict(rope_type="default", rope_theta=1e6, mrope_section=[16, 24, 24]))
        vae = dict(base_dim=96, dim_mult=[1, 2, 4, 4], num_res_blocks=2)
    vision = dict(depth=1, hidden_size=16, intermediate_size=24, num_heads=2, out_hidden_size=text["hidden_size"],
                  patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                  fullatt_block_indexes=[0])
    builders = {
        "transformer": lambda: QwenImageTransformer2DModel(patch_size=2, guidance_embeds=False, **tr),
        "vae": lambda: AutoencoderKLQwenImage(z_dim=16, attn_scales=[], temperal_downsample=[False, True, True],
                                              **vae),
        "text_encoder": lambda: transformers.Qwen2_5_VLForConditionalGeneration(transformers.Qwen2_5_VLConfig(
            text_config=dict(rms_norm_eps=1e-6, **text), vision_config=vision,
            tie_word_embeddings=False)),
    }
    save_components(out, builders)
    stand_in_tokenizer(out / "tokenizer", ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], None,
                       eos_token="<|im_end|>", pad_token="<|endoftext|>", padding_side="right")
    FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True, base_shift=0.5,
                                    max_shift=0.9, base_image_seq_len=256, max_image_seq_len=8192,
                                    shift_terminal=0.02, time_shift_type="exponential"
                                    ).save_pretrained(str(out / "scheduler"))
    index = {"_class_name": "QwenImagePipeline", "_diffusers_version": "0.42.1",
             "transformer": ["diffusers", "QwenImageTransformer2DModel"],
             "vae": ["diffusers", "AutoencoderKLQwenImage"],
             "text_encoder": ["transformers", "Qwen2_5_VLForConditionalGeneration"],
             "tokenizer": ["transformers", "PreTrainedTokenizerFast"],
             "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"]}
    (out / "model_index.json").write_text(json.dumps(index, indent=1))


def sdxl_controlnet(out: Path, tiny=False):
    """diffusers/controlnet-canny-sdxl-1.0's ControlNetModel: its config.json is what ControlNetModel.from_unet
    derives from SDXL base's UNet config (SDXL_UNET, conditioning_embedding_out_channels (16, 32, 96, 256), 3 input
    channels), built here from those values (no 2.57 B UNet needed); tiny=True: from SDXL_TINY_UNET, for sdxl-tiny."""
    import torch
    from diffusers import ControlNetModel
    torch.set_default_dtype(torch.bfloat16)
    config = dict(SDXL_TINY_UNET, conditioning_embedding_out_channels=(8, 8, 16, 16)) if tiny else \
        dict(SDXL_UNET, conditioning_embedding_out_channels=(16, 32, 96, 256))
    out.mkdir(parents=True, exist_ok=True)
    if (out / "config.json").exists():
        return
    t = time.time()
    model = ControlNetModel(in_channels=4, conditioning_channels=3, **config).to(torch.bfloat16)
    model.save_pretrained(str(out), max_shard_size="10GB")
    print(f"controlnet: {sum(p.numel() for p in model.parameters()) / 1e9:.3f} B params, {time.time() - t:.0f} s",
          flush=True)


MODELS = {"sdxl": unet_family, "sdxl-tiny": lambda out: unet_family(out, tiny=True),
          "sdxl-controlnet": sdxl_controlnet, "sdxl-controlnet-tiny": lambda out: sdxl_controlnet(out, tiny=True), "sd1.5": lambda out: unet_family(out, xl=False), "sd3.5-medium": sd35_medium, "sd3.5-large": lambda out: sd35_medium(out, large=True), "klein-4b": klein_4b,
          "flux2-dev": flux2_dev, "flux1-dev": flux1_dev, "flux1-tiny": lambda out: flux1_dev(out, tiny=True),
          "zimage-turbo": zimage_turbo, "zimage-turbo-tiny": lambda out: zimage_turbo(out, tiny=True),
          "qwen-image": qwen_image, "qwen-image-tiny": lambda out: qwen_image(out, tiny=True)}

if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("model", choices=sorted(MODELS))
    p.add_argument("--out", default=None)
    p.add_argument("--device", default="cpu", help="where torch initialises the weights (cuda: much faster)")
    p.add_argument("--text-layers", type=int, default=30, help="flux2-dev: Mistral layers kept")
    a = p.parse_args()
    import torch
    torch.set_default_device(a.device)
    out = Path(a.out or ROOT / "weights" / f"bench-{a.model}-random")
    MODELS[a.model](out, **({"text_layers": a.text_layers} if a.model == "flux2-dev" else {}))
