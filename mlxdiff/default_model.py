"""The embedded default model: a tiny SD3-architecture pipeline with RANDOM weights, built locally on first use.

It exists so that `python -m mlxdiff.generate` runs end to end on a fresh machine with no download. Its weights are
random, so its image is noise; it proves the plumbing, not the drawing. It is written in mlxdiff's own format
(weights in the modules' names and layouts, `_mlxdiff_native` in each config.json) under weights/.
"""

import json
import os
import shutil
import tempfile
from pathlib import Path

from . import backend  # noqa: F401
import mlx.core as mx
from mlx.utils import tree_flatten

from .loading.sources import NATIVE_KEY

NOTICE = "its weights are RANDOM: the image will be noise (this run proves the pipeline, not the drawing)"
WEIGHTS_DIR = Path(os.environ.get("MLXDIFF_WEIGHTS", Path(__file__).resolve().parent.parent / "weights"))
NAME = "tiny-sd3-random"

CONFIGS = {
    "text_encoder": ("clip", "CLIPTextModelWithProjection", dict(
        vocab_size=49408, hidden_size=32, intermediate_size=64, projection_dim=32, num_hidden_layers=2,
        num_attention_heads=2, max_position_embeddings=77, hidden_act="quick_gelu", layer_norm_eps=1e-5,
        bos_token_id=49406, eos_token_id=49407, pad_token_id=49407)),
    "text_encoder_2": ("clip", "CLIPTextModelWithProjection", dict(
        vocab_size=49408, hidden_size=48, intermediate_size=96, projection_dim=48, num_hidden_layers=2,
        num_attention_heads=3, max_position_embeddings=77, hidden_act="gelu", layer_norm_eps=1e-5,
        bos_token_id=49406, eos_token_id=49407, pad_token_id=0)),
    "text_encoder_3": ("t5", "T5EncoderModel", dict(
        vocab_size=32128, d_model=96, d_kv=16, d_ff=128, num_layers=2, num_heads=4,
        relative_attention_num_buckets=32, relative_attention_max_distance=128, layer_norm_epsilon=1e-6,
        feed_forward_proj="gated-gelu", is_gated_act=True, dense_act_fn="gelu_new")),
    "transformer": ("mmdit", "SD3Transformer2DModel", dict(
        sample_size=32, patch_size=2, in_channels=16, num_layers=3, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=96, caption_projection_dim=32, pooled_projection_dim=80, out_channels=16,
        pos_embed_max_size=32, dual_attention_layers=[0], qk_norm="rms_norm")),
    "vae": ("vae", "AutoencoderKL", dict(
        in_channels=3, out_channels=3, block_out_channels=[16, 16, 32, 32], layers_per_block=1, latent_channels=16,
        norm_num_groups=8, act_fn="silu", scaling_factor=1.5305, shift_factor=0.0609, use_quant_conv=False,
        use_post_quant_conv=False, sample_size=256,
        down_block_types=["DownEncoderBlock2D"] * 4, up_block_types=["UpDecoderBlock2D"] * 4)),
}


def ensure() -> Path:
    """The default model's folder, built on first use (a second or two)."""
    target = WEIGHTS_DIR / NAME
    if (target / "model_index.json").exists():
        return target
    WEIGHTS_DIR.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{NAME}-", dir=WEIGHTS_DIR))
    try:
        build(tmp)
        os.replace(tmp, target)  # only a complete folder ever gets the final name
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def build(folder: Path, seed=0):
    import importlib
    from .tokenizers import bundled_clip_tokenizer, bundled_t5_tokenizer
    mx.random.seed(seed)
    index = {"_class_name": "StableDiffusion3Pipeline", "_diffusers_version": "0.42.1", "_mlxdiff_random": True}
    for name, (module, class_name, config) in CONFIGS.items():
        arch = importlib.import_module(f"mlxdiff.models.{module}")
        model = arch.Model(arch.ModelArgs.from_dict(config))
        (folder / name).mkdir()
        params = dict(tree_flatten(model.parameters()))
        mx.save_safetensors(str(folder / name / "model.safetensors"),
                            {k: v.astype(mx.bfloat16) if v.dtype == mx.float32 else v for k, v in params.items()},
                            metadata={"format": "mlxdiff"})
        (folder / name / "config.json").write_text(json.dumps({**config, "_class_name": class_name,
                                                               NATIVE_KEY: True}, indent=1))
        index[name] = ["diffusers" if name in ("transformer", "vae") else "transformers", class_name]
    for name, tok in (("tokenizer", bundled_clip_tokenizer("<|endoftext|>")),
                      ("tokenizer_2", bundled_clip_tokenizer("!")), ("tokenizer_3", bundled_t5_tokenizer())):
        tok.save_pretrained(str(folder / name))
        index[name] = ["transformers", type(tok).__name__]
    (folder / "scheduler").mkdir()
    (folder / "scheduler" / "scheduler_config.json").write_text(json.dumps(
        {"_class_name": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000, "shift": 3.0}))
    index["scheduler"] = ["diffusers", "FlowMatchEulerDiscreteScheduler"]
    (folder / "model_index.json").write_text(json.dumps(index, indent=1))
