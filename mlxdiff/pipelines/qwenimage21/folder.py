"""A Qwen-Image 2.1 diffusers folder (QwenImage21Pipeline) -> PipelineSources: the transformer (or a file in its
place: transformer=), the AutoencoderKLQwenImage21 VAE, the Qwen3-VL text encoder's language model read to its last
layer (the vision tower never read: text-to-image), the tokenizer of its processor/ folder (Qwen3VLProcessor's);
model_index.json's sample_sigmas (QwenImage21Pipeline's registered config)."""

from dataclasses import dataclass
from pathlib import Path

from ...config_checks import CheckedArgs, between
from ...errors import MlxdiffError
from ...loading.sources import check_template_tokenizer, folder_component, read_scheduler_config, text_encoder_spec, \
    tokenizer_folder, transformer_from_file
from ...loading.spec import PipelineSources
from ...models import qwenimage21, text_llm, text_qwen3vl
from ...tokenizers import load_tokenizer
from .pipeline import TEMPLATE_TOKENS


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
    return PipelineSources("qwenimage21", pipeline_class, specs, {"processor": tokenizer}, read_scheduler_config(root),
                           {"sample_sigmas": options.sample_sigmas})
