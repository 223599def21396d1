"""The tiny SD3.5 twin (sd3_tiny_components): the components of conftest's session fixture sd3_tiny, and of the
tests that build a variant of it (a single-file-readable one, another transformer)."""

from helpers import ASSETS, FIXTURES, randomize_


def sd3_tiny_components(seed=0, single_file=False):
    """A tiny SD3.5-architecture pipeline (dual attention in block 0, qk rms_norm), every dimension distinct.

    single_file=True picks sizes whose config can be read back from original single-file shapes, as mlxdiff
    must for real sd3.5_*.safetensors + clip_l/clip_g/t5xxl files: 64-wide CLIP heads (gelu below width 768),
    T5 with 32 buckets / max distance 128, VAE with 32 groups."""
    import torch
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel
    from transformers import (CLIPTextConfig, CLIPTextModelWithProjection, CLIPTokenizer, T5Config, T5EncoderModel,
                              T5TokenizerFast)
    torch.manual_seed(seed)
    clip_l = CLIPTextModelWithProjection(CLIPTextConfig(
        vocab_size=49408, hidden_size=32, intermediate_size=44, projection_dim=28, num_hidden_layers=3,
        num_attention_heads=4, max_position_embeddings=77, hidden_act="quick_gelu", bos_token_id=49406,
        eos_token_id=49407, pad_token_id=1))
    clip_g = CLIPTextModelWithProjection(CLIPTextConfig(
        vocab_size=49408, hidden_size=40, intermediate_size=52, projection_dim=36, num_hidden_layers=2,
        num_attention_heads=5, max_position_embeddings=77, hidden_act="gelu", bos_token_id=49406,
        eos_token_id=49407, pad_token_id=1))
    t5 = T5EncoderModel(T5Config(
        vocab_size=32128, d_model=96, d_kv=12, d_ff=70, num_layers=2, num_heads=6, feed_forward_proj="gated-gelu",
        relative_attention_num_buckets=10, relative_attention_max_distance=24))
    transformer = SD3Transformer2DModel(
        sample_size=16, patch_size=2, in_channels=16, num_layers=3, attention_head_dim=8, num_attention_heads=3,
        joint_attention_dim=96, caption_projection_dim=24, pooled_projection_dim=64, out_channels=16,
        pos_embed_max_size=20, dual_attention_layers=(0,), qk_norm="rms_norm")
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, block_out_channels=(8, 12), layers_per_block=1, latent_channels=16,
        norm_num_groups=4, down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
        scaling_factor=1.5305, shift_factor=0.0609, use_quant_conv=False, use_post_quant_conv=False,
        sample_size=1024)
    if single_file:
        clip_l = CLIPTextModelWithProjection(CLIPTextConfig(
            vocab_size=49408, hidden_size=64, intermediate_size=80, projection_dim=64, num_hidden_layers=2,
            num_attention_heads=1, max_position_embeddings=77, hidden_act="gelu", eos_token_id=2))
        clip_g = CLIPTextModelWithProjection(CLIPTextConfig(
            vocab_size=49408, hidden_size=128, intermediate_size=144, projection_dim=96, num_hidden_layers=3,
            num_attention_heads=2, max_position_embeddings=77, hidden_act="gelu", eos_token_id=2))
        t5 = T5EncoderModel(T5Config(
            vocab_size=32128, d_model=224, d_kv=12, d_ff=70, num_layers=2, num_heads=5, feed_forward_proj="gated-gelu",
            relative_attention_num_buckets=32, relative_attention_max_distance=128))
        transformer = SD3Transformer2DModel(
            sample_size=16, patch_size=2, in_channels=16, num_layers=3, attention_head_dim=8, num_attention_heads=3,
            joint_attention_dim=224, caption_projection_dim=24, pooled_projection_dim=160, out_channels=16,
            pos_embed_max_size=20, dual_attention_layers=(1,), qk_norm="rms_norm")
        vae = AutoencoderKL(
            in_channels=3, out_channels=3, block_out_channels=(32, 64), layers_per_block=1, latent_channels=16,
            norm_num_groups=32, down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
            scaling_factor=1.5305, shift_factor=0.0609, use_quant_conv=False, use_post_quant_conv=False,
            sample_size=1024)
    for i, m in enumerate((clip_l, clip_g, t5, transformer, vae)):
        randomize_(m, seed=seed * 10 + i, scale=0.15)
        m.eval()  # diffusers models come in eval mode from from_pretrained; here T5 dropout would be on
    vocab = FIXTURES / "clip" if (FIXTURES / "clip" / "vocab.json").exists() else ASSETS / "clip"
    t5_file = FIXTURES / "t5" if (FIXTURES / "t5" / "tokenizer.json").exists() else ASSETS / "t5"
    tok_l = CLIPTokenizer(str(vocab / "vocab.json"), str(vocab / "merges.txt"), model_max_length=77)
    tok_g = CLIPTokenizer(str(vocab / "vocab.json"), str(vocab / "merges.txt"), model_max_length=77, pad_token="!")
    tok_t5 = T5TokenizerFast(tokenizer_file=str(t5_file / "tokenizer.json"), model_max_length=512)
    return dict(transformer=transformer, vae=vae, text_encoder=clip_l, text_encoder_2=clip_g, text_encoder_3=t5,
                tokenizer=tok_l, tokenizer_2=tok_g, tokenizer_3=tok_t5,
                scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0))
