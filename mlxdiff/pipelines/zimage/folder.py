"""A Z-Image diffusers folder (ZImagePipeline) -> PipelineSources: the transformer, the AutoencoderKL VAE, the Qwen3
text encoder (Qwen3Model or Qwen3ForCausalLM) read up to hidden_states[-2] (tap num_hidden_layers - 1, no final norm)
and its chat tokenizer."""

from pathlib import Path

from ...errors import MlxdiffError
from ...loading.sources import check_together, folder_component, read_json, read_scheduler_config, \
    text_encoder_spec, tokenizer_folder, transformer_from_file
from ...loading.spec import PipelineSources
from ...models import text_llm, zimage
from ...tokenizers import load_chat_tokenizer

# the text encoder's classes: diffusers' ZImagePipeline takes a Qwen3Model (Tongyi-MAI's folders name it so, its
# weights without `model.`) or the causal LM around it; text_llm reads both namings
TEXT_ENCODER_CLASSES = (text_llm.ARCHITECTURES["qwen3"], "Qwen3Model")


def zimage_folder(root: Path, index, pipeline_class, components, transformer=None) -> PipelineSources:
    """A ZImagePipeline folder; a `transformer` file (diffusers or original names) replaces its denoiser."""
    where = root / "model_index.json"
    specs = {name: folder_component(root, name, components[name], name == "transformer" and transformer is not None)
             for name in ("transformer", "vae")}
    if transformer is not None:
        specs["transformer"] = transformer_from_file(transformer, zimage, specs["transformer"].config,
                                                     root / "transformer" / "config.json")
    config_path = root / "text_encoder" / "config.json"
    config = read_json(config_path, "the text encoder config", root)
    layers = config.get("num_hidden_layers")
    if not isinstance(layers, int) or layers < 1:
        raise MlxdiffError(f"{config_path}: num_hidden_layers is {layers!r}; expected a positive integer")
    specs["text_encoder"] = text_encoder_spec(root / "text_encoder", [layers - 1], root)   # hidden_states[-2]
    encoder = specs["text_encoder"].args
    if encoder.model_type != "qwen3" or components["text_encoder"] not in TEXT_ENCODER_CLASSES:
        raise MlxdiffError(f"{where}: component 'text_encoder' names class {components['text_encoder']!r} but "
                           f"{config_path} is a {text_llm.ARCHITECTURES[encoder.model_type]}")
    transformer = specs["transformer"].args
    width = encoder.text_config.get("hidden_size", config.get("hidden_size"))
    if width is not None and width != transformer.cap_feat_dim:
        raise MlxdiffError(f"{root / 'transformer' / 'config.json'}: cap_feat_dim is {transformer.cap_feat_dim} but "
                           f"the text encoder ({config_path}) gives {width} features; the components do not "
                           "belong together")
    check_together(root, specs, 1, transformer.all_patch_size[0])
    folder = tokenizer_folder(root, "tokenizer")
    tokenizer = load_chat_tokenizer(folder, encoder.model_type, config_path)
    vocab = encoder.text_config.get("vocab_size", config.get("vocab_size"))
    if vocab is not None and len(tokenizer) > vocab:
        raise MlxdiffError(f"{folder}: the tokenizer has {len(tokenizer)} tokens but the text encoder's embedding "
                           f"({config_path}) has {vocab} rows; give the model's own tokenizer folder")
    return PipelineSources("zimage", pipeline_class, specs, {"tokenizer": tokenizer}, read_scheduler_config(root))
