"""Write random-weight pipelines at the REAL configs, in the diffusers layout, for bench/ runs.

    python bench/make_random_models.py sd3.5-medium [--out weights/bench-sd3.5-medium-random]

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


def sd35_medium(out: Path):
    import torch
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel
    sys.path.insert(0, str(ROOT))
    from mlxdiff.tokenizers import bundled_clip_tokenizer, bundled_t5_tokenizer

    torch.set_default_dtype(torch.bfloat16)
    builders = {
        "transformer": lambda: SD3Transformer2DModel(
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


MODELS = {"sd3.5-medium": sd35_medium}

if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("model", choices=sorted(MODELS))
    p.add_argument("--out", default=None)
    a = p.parse_args()
    MODELS[a.model](Path(a.out or ROOT / "weights" / f"bench-{a.model}-random"))
