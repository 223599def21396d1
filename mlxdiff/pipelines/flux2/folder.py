"""A FLUX.2 diffusers folder (Flux2Pipeline, Flux2KleinPipeline) -> PipelineSources, and FLUX.2's VAE given as one
file (BFL / ComfyUI or diffusers names)."""

import math
from dataclasses import dataclass
from pathlib import Path

from ...config_checks import MAX_IMAGE_SIZE, MAX_LAYERS, MAX_PROMPT_TOKENS, CheckedArgs, between, show
from ...errors import MlxdiffError
from ...loading.sources import (check_together, folder_component, read_json, read_scheduler_config,
                                text_encoder_from_file, text_encoder_spec, tokenizer_folder, transformer_from_file)
from ...loading.spec import PipelineSources
from ...loading.vae_files import FLUX2 as FLUX2_VAE, read_vae_file
from ...models import flux2, text_llm
from ...tokenizers import load_chat_tokenizer
# diffusers' text_encoder_out_layers defaults per pipeline
FLUX2_TAPS = {"Flux2Pipeline": (10, 20, 30), "Flux2KleinPipeline": (9, 18, 27)}


@dataclass
class Flux2FolderOptions(CheckedArgs):
    """model_index.json keys mlxdiff reads beside the components (diffusers ignores them): a small model's defaults
    (klein-shapes: 64x64 images, 64-token prompts, its own taps)."""
    is_distilled: bool = False
    sample_size: int | None = None                      # default image size in pixels
    max_sequence_length: int = 512
    text_encoder_out_layers: tuple[int, ...] | None = None

    WHAT = "model_index.json"
    LIMITS = {
        "sample_size": between(1, MAX_IMAGE_SIZE),
        "max_sequence_length": between(1, MAX_PROMPT_TOKENS),
        "text_encoder_out_layers": between(0, MAX_LAYERS, items=(1, 16)),
    }


def flux2_folder(root: Path, index, pipeline_class, components, transformer=None, text_encoder=None, vae=None,
                 tokenizer=None) -> PipelineSources:
    """A FLUX.2 pipeline folder; `transformer`, `text_encoder` and `vae` files and a `tokenizer` folder replace its
    own."""
    where = root / "model_index.json"
    options = Flux2FolderOptions.from_dict(index, where)
    specs = {name: folder_component(root, name, components[name], replacement is not None)
             for name, replacement in (("transformer", transformer), ("vae", vae))}
    # a folder may name its own taps (a small encoder has fewer layers); diffusers ignores this key and takes
    # text_encoder_out_layers per call instead
    taps = options.text_encoder_out_layers or FLUX2_TAPS[pipeline_class]
    folder_config = root / "text_encoder" / "config.json"
    if text_encoder is None:
        specs["text_encoder"] = text_encoder_spec(root / "text_encoder", taps, root)
    else:   # the file replaces the folder's encoder; the folder's config (if any) gives what shapes cannot
        base = read_json(folder_config, "the text encoder config", root) if folder_config.is_file() else None
        specs["text_encoder"] = text_encoder_from_file(text_encoder, taps, base, folder_config,
                                                        bool(options.text_encoder_out_layers),
                                                        components["text_encoder"])
    encoder = specs["text_encoder"].args
    source = folder_config if text_encoder is None else text_encoder
    if text_llm.ARCHITECTURES[encoder.model_type] != components["text_encoder"]:
        raise MlxdiffError(f"{where}: component 'text_encoder' names class {components['text_encoder']!r} but "
                           f"{source} is a {text_llm.ARCHITECTURES[encoder.model_type]}")
    if options.text_encoder_out_layers and encoder.depth > encoder.num_layers:
        raise MlxdiffError(f"{where}: text_encoder_out_layers is {show(options.text_encoder_out_layers)}; expected "
                           f"layer indices 0 to {encoder.num_layers} (the text encoder's num_hidden_layers)")
    positions = encoder.text_config.get("max_position_embeddings")
    if "max_sequence_length" in index and positions is not None and options.max_sequence_length > positions:
        raise MlxdiffError(f"{where}: max_sequence_length is {options.max_sequence_length}; expected at most the "
                           f"text encoder's max_position_embeddings {positions}")
    if transformer is not None:
        specs["transformer"] = transformer_from_file(transformer, flux2, specs["transformer"].config,
                                                     root / "transformer" / "config.json")
    if vae is not None:
        specs["vae"] = read_vae_file(vae, FLUX2_VAE, specs["vae"].config, root / "vae" / "config.json",
                                     title="a FLUX.2")
    check_together(root, specs, math.prod(specs["vae"].args.patch_size), 2, options.sample_size)
    if tokenizer is not None and not Path(tokenizer).is_dir():
        raise MlxdiffError(f"{tokenizer}: tokenizer folder not found; give the model's tokenizer/ folder "
                           "(tokenizer.json, tokenizer_config.json with its chat template)")
    folder = Path(tokenizer) if tokenizer is not None else tokenizer_folder(root, "tokenizer")
    if text_encoder is not None and not folder.is_dir():
        raise MlxdiffError(f"{folder}: missing; with text_encoder={text_encoder} the tokenizer still comes from the "
                           "pipeline folder: add the model's tokenizer/ folder (tokenizer.json, tokenizer_config.json "
                           "with its chat template) from its diffusers repository")
    tokenizer_ = load_chat_tokenizer(folder, encoder.model_type, source)   # of the encoder's family
    vocab = encoder.text_config.get("vocab_size")
    if vocab is not None and len(tokenizer_) > vocab:   # ids past the embedding would read other memory's rows
        raise MlxdiffError(f"{folder}: the tokenizer has {len(tokenizer_)} tokens but the text encoder's embedding "
                           f"({source}) has {vocab} rows; give the model's own tokenizer folder")
    tokenizers = {"tokenizer": tokenizer_}
    # optional folder defaults (diffusers ignores these keys): image size and prompt length of a small model
    return PipelineSources("flux2", pipeline_class, specs, tokenizers, read_scheduler_config(root),
                           {"is_distilled": options.is_distilled, "sample_size": options.sample_size,
                            "max_sequence_length": options.max_sequence_length})
