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
    python bench/make_random_models.py krea2 | krea2-tiny [--out DIR] [--device cuda]                 # ~35 GB
    python bench/make_random_models.py flux3-klein | flux3-klein-tiny [--out DIR] [--device cuda]     # ~20 GB

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


def qwen_image_vae(tiny=False):
    """AutoencoderKLQwenImage at its class defaults (= Qwen-Image's released vae/config.json, the VAE Krea 2 shares),
    or the tiny one (base 8, 3 + 1 levels, factor 8), as a save_components builder."""
    from diffusers import AutoencoderKLQwenImage
    vae = dict(base_dim=8, dim_mult=[1, 2, 2, 2], num_res_blocks=1) if tiny else \
        dict(base_dim=96, dim_mult=[1, 2, 4, 4], num_res_blocks=2)
    return lambda: AutoencoderKLQwenImage(z_dim=16, attn_scales=[], temperal_downsample=[False, True, True], **vae)


# Qwen/Qwen3-VL-4B-Instruct's config.json (the encoder of Krea 2 and FLUX 3 Klein; the values as kohya-ss/musubi-tuner's
# krea2/krea2_encoder.py writes them out: no Hub access here). Its vision tower is kept at the real config: diffusers
# loads it (0.41 B) though neither pipeline runs it for a text prompt; mlxdiff never reads it.
QWEN3_VL_4B_TEXT = dict(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                        num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=262144,
                        rms_norm_eps=1e-6, rope_parameters=dict(rope_type="default", rope_theta=5e6,
                                                                mrope_section=[24, 20, 20], mrope_interleaved=True))
QWEN3_VL_4B_VISION = dict(depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16, patch_size=16,
                          spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=2304,
                          deepstack_visual_indexes=[5, 11, 17], hidden_act="gelu_pytorch_tanh")
QWEN3_VL_TINY_VISION = dict(depth=1, hidden_size=16, intermediate_size=24, num_heads=2, patch_size=4,
                            spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16,
                            deepstack_visual_indexes=[0])


def qwen3_vl_encoder(class_name, text, vision):
    """A save_components builder: transformers' `class_name` (Qwen3VLModel, Qwen3VLForConditionalGeneration) over
    the text config `text`, its vision tower `vision` projecting to the text width, tied embeddings (as 4B's)."""
    import transformers
    config = transformers.Qwen3VLConfig(text_config=text, tie_word_embeddings=True,
                                        vision_config=dict(vision, out_hidden_size=text["hidden_size"]))
    return lambda: getattr(transformers, class_name)(config)


def transformer_config(name):
    """bench/forward_gpu.py's config `name`: the transformer steps of bench/new_families_gpu.sh ran the same one."""
    sys.path.insert(0, str(ROOT / "bench"))
    from forward_gpu import CONFIGS
    return dict(CONFIGS[name])


def write_index(out: Path, class_name, components: dict, **config):
    """model_index.json as DiffusionPipeline.save_pretrained writes it: the class, the registered config, then each
    component's [library, class]."""
    import json
    (out / "model_index.json").write_text(json.dumps(
        {"_class_name": class_name, "_diffusers_version": "0.42.1", **config, **components}, indent=1))


def krea2(out: Path, tiny=False):
    """Krea 2 (Krea2Pipeline): Krea2Transformer2DModel at diffusers 0.42.1's class defaults (12.8 B; forward_gpu's
    CONFIGS["krea2"]: no released config is available offline), Qwen3-VL-4B-Instruct as the Qwen3VLModel the
    pipeline types (QWEN3_VL_4B_TEXT / _VISION), the Qwen-Image VAE (qwen_image_vae), the scheduler settings of the
    Krea2Pipeline docstring (dynamic shifting 0.5 to 1.15 over 256 to 6400 image tokens, exponential), the stand-in
    Qwen tokenizer; model_index.json with the config Krea2Pipeline registers (text_encoder_select_layers: its
    default 2, 5, ..., 35; is_distilled false: the 28-step base model; patch_size 2). ~35 GB: transformer 25.6,
    encoder 8.9 (the tower 0.8 of it), VAE 0.25. tiny=True: the same layout, tiny (a whole-chain test on the CPU):
    encoder (6 layers of 256, taps 2, 4, 6) and transformer a few MB each, mostly blocks, so that one small
    --memory-limit streams both."""
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler, Krea2Transformer2DModel
    torch.set_default_dtype(torch.bfloat16)
    if tiny:
        tr = dict(in_channels=64, num_layers=6, attention_head_dim=32, num_attention_heads=6, num_key_value_heads=2,
                  intermediate_size=520, timestep_embed_dim=48, text_hidden_dim=256, num_text_layers=3,
                  text_num_attention_heads=4, text_num_key_value_heads=2, text_intermediate_size=344,
                  num_layerwise_text_blocks=1, num_refiner_text_blocks=1, axes_dims_rope=(8, 12, 12))
        text = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=6, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=64, max_position_embeddings=1024, rms_norm_eps=1e-6,
                    rope_parameters=dict(rope_type="default", rope_theta=5e6, mrope_section=[12, 10, 10],
                                         mrope_interleaved=True))
        taps, vision = (2, 4, 6), QWEN3_VL_TINY_VISION
    else:
        tr, text, vision = transformer_config("krea2"), QWEN3_VL_4B_TEXT, QWEN3_VL_4B_VISION
        taps = (2, 5, 8, 11, 14, 17, 20, 23, 26, 29, 32, 35)    # Krea2Pipeline's default
    builders = {"transformer": lambda: Krea2Transformer2DModel(**tr), "vae": qwen_image_vae(tiny),
                "text_encoder": qwen3_vl_encoder("Qwen3VLModel", text, vision)}
    save_components(out, builders)
    qwen_like_tokenizer(out / "tokenizer")
    FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, use_dynamic_shifting=True, base_shift=0.5,
                                    max_shift=1.15, base_image_seq_len=256, max_image_seq_len=6400,
                                    time_shift_type="exponential").save_pretrained(str(out / "scheduler"))
    write_index(out, "Krea2Pipeline", {
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "text_encoder": ["transformers", "Qwen3VLModel"], "tokenizer": ["transformers", "PreTrainedTokenizerFast"],
        "transformer": ["diffusers", "Krea2Transformer2DModel"], "vae": ["diffusers", "AutoencoderKLQwenImage"]},
        is_distilled=False, patch_size=2, text_encoder_select_layers=list(taps))


def flux3_klein(out: Path, tiny=False):
    """FLUX 3 Image Klein, step-distilled (Flux3DistilledModularPipeline, 16 steps, no guidance):
    Flux3Transformer2DModel at diffusers 0.42.1's class defaults with flow_map=True (5.5 B; forward_gpu's
    CONFIGS["flux3-klein"]), Qwen3-VL-4B-Instruct as Qwen3VLForConditionalGeneration (the modular text encoder
    step's class; its hidden states 4, 8, ..., 32 stacked: 8 x 2560 = the transformer's joint_attention_dim),
    AutoencoderKLFlux2 at its class defaults (FLUX.2's VAE, which FLUX 3 reads), the stand-in Qwen tokenizer (its
    chat template) under tokenizer/. Written as ModularPipeline.save_pretrained writes it: modular_model_index.json
    (no model_index.json) with each component's loading spec, no scheduler folder (the blocks build
    FlowMatchEulerDiscreteScheduler(shift=6.93) from config), the tokenizer's spec without a path (a saved
    AutoProcessor would carry the image processor's files; this folder has only the tokenizer's:
    whole_process_gpu.py hands it to diffusers as tests/flux3_helpers.py does). ~20 GB: transformer 11.1, encoder
    8.9, VAE 0.17. tiny=True: the same layout, tiny (a whole-chain test on the CPU): 32 encoder layers of 96 (the
    default taps need 32), a transformer 192 wide; a few MB each."""
    import json
    import torch
    from diffusers import AutoencoderKLFlux2, Flux3Transformer2DModel
    torch.set_default_dtype(torch.bfloat16)
    if tiny:
        text = dict(vocab_size=512, hidden_size=96, intermediate_size=256, num_hidden_layers=32, num_attention_heads=3,
                    num_key_value_heads=1, head_dim=32, max_position_embeddings=1024, rms_norm_eps=1e-6,
                    rope_parameters=dict(rope_type="default", rope_theta=5e6, mrope_section=[6, 5, 5],
                                         mrope_interleaved=True))
        tr = dict(in_channels=32, cond_in_channels=32, num_layers=2, num_single_layers=4, attention_head_dim=48,
                  num_attention_heads=4, joint_attention_dim=8 * text["hidden_size"], timestep_channels=64,
                  mlp_ratio=2.5, axes_dims_rope=(12, 12, 12, 12), rope_theta=10000, eps=1e-6, flow_map=True)
        vae = dict(block_out_channels=(16, 24, 24, 24), layers_per_block=1, latent_channels=8, norm_num_groups=8)
        vision = QWEN3_VL_TINY_VISION
    else:
        tr, text, vision, vae = transformer_config("flux3-klein"), QWEN3_VL_4B_TEXT, QWEN3_VL_4B_VISION, {}
    builders = {"transformer": lambda: Flux3Transformer2DModel(**tr), "vae": lambda: AutoencoderKLFlux2(**vae),
                "text_encoder": qwen3_vl_encoder("Qwen3VLForConditionalGeneration", text, vision)}
    save_components(out, builders)
    qwen_like_tokenizer(out / "tokenizer")

    def spec(library, class_name, name, hint=None, path=str(out)):
        return [library, class_name, {"pretrained_model_name_or_path": path, "revision": None, "subfolder": name,
                                      "type_hint": [library, hint or class_name], "variant": None}]
    index = {"_blocks_class_name": "Flux3DistilledAutoBlocks", "_class_name": "Flux3DistilledModularPipeline",
             "_diffusers_version": "0.42.1",
             "text_encoder": spec("transformers", "Qwen3VLForConditionalGeneration", "text_encoder"),
             "tokenizer": spec("transformers", "Qwen3VLProcessor", "tokenizer", "AutoProcessor", path=None),
             "transformer": spec("diffusers", "Flux3Transformer2DModel", "transformer"),
             "vae": spec("diffusers", "AutoencoderKLFlux2", "vae")}
    (out / "modular_model_index.json").write_text(json.dumps(index, indent=1))


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
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel
    torch.set_default_dtype(torch.bfloat16)
    if tiny:
        tr = dict(in_channels=64, out_channels=16, num_layers=8, attention_head_dim=32, num_attention_heads=3,
                  joint_attention_dim=256, axes_dims_rope=(6, 12, 14))
        text = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=6, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=1024, vocab_size=512,
                    rope_parameters=dict(rope_type="default", rope_theta=1e6, mrope_section=[8, 12, 12]))
    else:
        tr = dict(in_channels=64, out_channels=16, num_layers=60, attention_head_dim=128, num_attention_heads=24,
                  joint_attention_dim=3584, axes_dims_rope=(16, 56, 56))
        text = dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                    num_key_value_heads=4, max_position_embeddings=128000, vocab_size=152064,
                    rope_parameters=dict(rope_type="default", rope_theta=1e6, mrope_section=[16, 24, 24]))
    vision = dict(depth=1, hidden_size=16, intermediate_size=24, num_heads=2, out_hidden_size=text["hidden_size"],
                  patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                  fullatt_block_indexes=[0])
    builders = {
        "transformer": lambda: QwenImageTransformer2DModel(patch_size=2, guidance_embeds=False, **tr),
        "vae": qwen_image_vae(tiny),
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
          "qwen-image": qwen_image, "qwen-image-tiny": lambda out: qwen_image(out, tiny=True),
          "krea2": krea2, "krea2-tiny": lambda out: krea2(out, tiny=True),
          "flux3-klein": flux3_klein, "flux3-klein-tiny": lambda out: flux3_klein(out, tiny=True)}

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
