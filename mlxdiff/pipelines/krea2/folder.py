"""A Krea 2 diffusers folder (Krea2Pipeline) -> PipelineSources: the transformer, the AutoencoderKLQwenImage VAE, the
Qwen3-VL text encoder's language model read up to the deepest of the pipeline's text_encoder_select_layers (the
vision tower never read) and its Qwen tokenizer; model_index.json's is_distilled, text_encoder_select_layers and
patch_size (Krea2Pipeline's registered config)."""

from dataclasses import dataclass
from pathlib import Path

from ...config_checks import MAX_LAYERS, CheckedArgs, between
from ...errors import MlxdiffError
from ...loading.sources import check_template_tokenizer, folder_component, read_scheduler_config, text_encoder_spec, \
    tokenizer_folder, transformer_from_file
from ...loading.spec import PipelineSources
from ...models import krea2, text_llm, text_qwen3vl
from ...tokenizers import load_tokenizer
from .pipeline import SELECT_LAYERS

# the template's control tokens: a tokenizer without them is not Qwen's
TEMPLATE_TOKENS = ("<|im_start|>", "<|im_end|>")


@dataclass
class Krea2FolderOptions(CheckedArgs):
    """model_index.json keys Krea2Pipeline registers beside its components."""
    is_distilled: bool = False
    text_encoder_select_layers: tuple[int, ...] | None = None
    patch_size: int = 2

    WHAT = "model_index.json"
    LIMITS = {"text_encoder_select_layers": between(0, MAX_LAYERS, items=(1, 64)), "patch_size": between(1, 8)}


def krea2_folder(root: Path, index, pipeline_class, components, transformer=None) -> PipelineSources:
    """A Krea2Pipeline folder; a `transformer` file (diffusers' or krea-ai's names) replaces its denoiser."""
    where = root / "model_index.json"
    options = Krea2FolderOptions.from_dict(index, where)
    specs = {name: folder_component(root, name, components[name], name == "transformer" and transformer is not None)
             for name in ("transformer", "vae")}
    tconfig, vconfig = root / "transformer" / "config.json", root / "vae" / "config.json"
    if transformer is not None:
        specs["transformer"] = transformer_from_file(transformer, krea2, specs["transformer"].config, tconfig)
    taps = tuple(options.text_encoder_select_layers or SELECT_LAYERS)
    config_path = root / "text_encoder" / "config.json"
    specs["text_encoder"] = text_encoder_spec(root / "text_encoder", taps, root)
    encoder = specs["text_encoder"].args
    if encoder.model_type != text_qwen3vl.MODEL_TYPE or components["text_encoder"] not in text_qwen3vl.CLASSES:
        raise MlxdiffError(f"{where}: component 'text_encoder' names class {components['text_encoder']!r} and "
                           f"{config_path} is model_type {encoder.model_type!r}; Krea 2 reads a Qwen3-VL encoder "
                           f"({' or '.join(text_qwen3vl.CLASSES)})")
    text_llm.check_args(encoder, config_path)      # the taps within its layers
    targs, vargs = specs["transformer"].args, specs["vae"].args
    width = encoder.text_config.get("hidden_size")
    if (width, len(taps)) != (targs.text_hidden_dim, targs.num_text_layers):
        raise MlxdiffError(f"{tconfig}: text_hidden_dim {targs.text_hidden_dim} and num_text_layers "
                           f"{targs.num_text_layers}, but the text encoder ({config_path}) gives {width} features at "
                           f"{len(taps)} text_encoder_select_layers; the components do not belong together")
    p = options.patch_size
    if targs.in_channels != vargs.z_dim * p * p:
        raise MlxdiffError(f"{tconfig}: in_channels {targs.in_channels}; with {vconfig}'s z_dim {vargs.z_dim} the "
                           f"pipeline's {p}x{p} patches need {vargs.z_dim * p * p}; the components do not belong "
                           "together")
    folder = tokenizer_folder(root, "tokenizer")
    tokenizer = load_tokenizer(folder)
    check_template_tokenizer(tokenizer, folder, TEMPLATE_TOKENS, "Krea 2's prompt template needs Qwen3-VL's tokenizer",
                             encoder.text_config.get("vocab_size"), config_path)
    return PipelineSources("krea2", pipeline_class, specs, {"tokenizer": tokenizer}, read_scheduler_config(root),
                           {"is_distilled": options.is_distilled, "patch_size": p})
