"""A Qwen-Image 2.1 diffusers folder (QwenImage21Pipeline) -> PipelineSources: the transformer (or a file in its
place: transformer=), the AutoencoderKLQwenImage21 VAE, the Qwen3-VL text encoder's language model read to its last
layer, the tokenizer of its processor/ folder (Qwen3VLProcessor's); model_index.json's sample_sigmas
(QwenImage21Pipeline's registered config). For condition images: the vision tower of the same text_encoder/ files
(models/vision_qwen3vl.py, the component "vision", read only when a run has images) when its config has a
vision_config, and processor/preprocessor_config.json (the image processor) when the folder has one; a folder
without them runs text-to-image only."""

from dataclasses import dataclass
from pathlib import Path

from ...config_checks import CheckedArgs, between
from ...errors import MlxdiffError
from ...loading.sources import ComponentSpec, check_template_tokenizer, folder_component, read_json, \
    read_scheduler_config, text_encoder_spec, tokenizer_folder, transformer_from_file
from ...loading.spec import PipelineSources
from ...models import qwenimage21, text_llm, text_qwen3vl, vision_qwen3vl
from ...tokenizers import load_tokenizer
from .pipeline import IMAGE_PAD, TEMPLATE_TOKENS, VISION_TOKENS


@dataclass
class QwenImage21FolderOptions(CheckedArgs):
    """model_index.json keys QwenImage21Pipeline registers beside its components."""
    sample_sigmas: tuple[float, ...] | None = None

    WHAT = "model_index.json"
    LIMITS = {"sample_sigmas": between(0, 1, items=(1, 1000))}


def qwenimage21_folder(root: Path, index, pipeline_class, components, transformer=None) -> PipelineSources:
    """A QwenImage21Pipeline folder; a `transformer` file (diffusers' or ComfyUI's names, safetensors or GGUF)
    replaces its denoiser."""
    where = root / "model_index.json"
    options = QwenImage21FolderOptions.from_dict(index, where)
    specs = {name: folder_component(root, name, components[name], name == "transformer" and transformer is not None)
             for name in ("transformer", "vae")}
    if transformer is not None:
        specs["transformer"] = transformer_from_file(transformer, qwenimage21, specs["transformer"].config,
                                                     root / "transformer" / "config.json")
    config_path = root / "text_encoder" / "config.json"
    probe = text_encoder_spec(root / "text_encoder", (1,), root)
    layers = probe.args.num_layers
    if probe.args.model_type != text_qwen3vl.MODEL_TYPE or components["text_encoder"] not in text_qwen3vl.CLASSES:
        raise MlxdiffError(f"{where}: component 'text_encoder' names class {components['text_encoder']!r} and "
                           f"{config_path} is model_type {probe.args.model_type!r}; Qwen-Image 2.1 reads a Qwen3-VL "
                           f"encoder ({' or '.join(text_qwen3vl.CLASSES)})")
    # hidden_states[-1]: the last layer (the pipeline takes it before the final norm)
    specs["text_encoder"] = text_encoder_spec(root / "text_encoder", (layers,), root)
    encoder = specs["text_encoder"].args
    text_llm.check_args(encoder, config_path)
    targs, vargs = specs["transformer"].args, specs["vae"].args
    tconfig, vconfig = root / "transformer" / "config.json", root / "vae" / "config.json"
    width = encoder.text_config.get("hidden_size")
    if width != targs.context_in_dim:
        raise MlxdiffError(f"{tconfig}: context_in_dim {targs.context_in_dim}, but the text encoder ({config_path}) "
                           f"gives {width} features; the components do not belong together")
    if targs.in_channels != vargs.z_dim or targs.patch_size != 1:
        raise MlxdiffError(f"{tconfig}: in_channels {targs.in_channels} (patch_size {targs.patch_size}); the "
                           f"pipeline feeds {vconfig}'s z_dim {vargs.z_dim} latents unpatched; the components do not "
                           "belong together")
    folder = tokenizer_folder(root, "processor")
    tokenizer = load_tokenizer(folder)
    check_template_tokenizer(tokenizer, folder, TEMPLATE_TOKENS,
                             "Qwen-Image 2.1's prompt template needs Qwen3-VL's tokenizer",
                             encoder.text_config.get("vocab_size"), config_path, folder="processor")
    images = condition_image_parts(root, config_path, folder, specs, tokenizer)
    return PipelineSources("qwenimage21", pipeline_class, specs, {"processor": tokenizer}, read_scheduler_config(root),
                           {"sample_sigmas": options.sample_sigmas, **images})


def condition_image_parts(root, config_path, folder, specs, tokenizer) -> dict:
    """The vision tower (specs["vision"], over the text encoder's files) and the image processor's config: the
    pipeline's options {"processor", "image_token_id"} (None each where the folder lacks them: images refused)."""
    config = read_json(config_path, "the text encoder config", root)
    vision = config.get("vision_config")
    where = folder / "preprocessor_config.json"
    if not isinstance(vision, dict) or not where.is_file():
        return {"processor": None, "image_token_id": None}
    args = vision_qwen3vl.ModelArgs.from_dict(vision, f"{config_path} vision_config")
    width = specs["text_encoder"].args.text_config.get("hidden_size")
    if args.out_hidden_size != width:
        raise MlxdiffError(f"{config_path}: vision_config.out_hidden_size is {args.out_hidden_size} but the language "
                           f"model's hidden_size is {width}; the vision tower does not belong to this encoder")
    specs["vision"] = ComponentSpec("vision", vision_qwen3vl, dict(vision), list(specs["text_encoder"].files))
    processor = vision_qwen3vl.processor_config(read_json(where, "the image processor config", root), where)
    vision_qwen3vl.check_processor(processor, args, where, config_path)
    token_id = config.get("image_token_id", 151655)
    vocab = tokenizer.get_vocab()
    missing = [t for t in VISION_TOKENS if t not in vocab]
    if missing:
        raise MlxdiffError(f"{folder}: the tokenizer has no {' / '.join(missing)}; Qwen-Image 2.1's image-conditioned "
                           "template needs Qwen3-VL's tokenizer (its processor/ folder)")
    if vocab[IMAGE_PAD] != token_id:
        raise MlxdiffError(f"{folder}: {IMAGE_PAD} is token {vocab[IMAGE_PAD]} but the text encoder's image_token_id "
                           f"({config_path}) is {token_id!r}; give the model's own processor folder")
    return {"processor": processor, "image_token_id": token_id}
