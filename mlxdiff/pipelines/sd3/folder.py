"""An SD3.5 diffusers folder (StableDiffusion3Pipeline) -> PipelineSources."""

from pathlib import Path

from ...errors import MlxdiffError
from ...loading.sources import check_together, folder_component, read_scheduler_config, tokenizer_folder, \
    transformer_from_file
from ...loading.spec import PipelineSources
from ...models import mmdit
from ...tokenizers import load_tokenizer


def sd3_folder(root: Path, index, pipeline_class, components, transformer=None) -> PipelineSources:
    specs = {name: folder_component(root, name, components[name], name == "transformer" and transformer is not None)
             for name in ("transformer", "vae", "text_encoder", "text_encoder_2")}
    has_t5 = components["text_encoder_3"] is not None
    specs["text_encoder_3"] = folder_component(root, "text_encoder_3", components["text_encoder_3"]) \
        if has_t5 else None   # diffusers then uses zeros for the T5 part
    if has_t5 and components["tokenizer_3"] is None:
        raise MlxdiffError(f"{root / 'model_index.json'}: component 'tokenizer_3' is missing; text_encoder_3 "
                           "needs its tokenizer")
    if transformer is not None:
        specs["transformer"] = transformer_from_file(transformer, mmdit, specs["transformer"].config,
                                                     root / "transformer" / "config.json")
    check_together(root, specs)
    tokenizers = {name: load_tokenizer(tokenizer_folder(root, name), components[name])
                  for name in ("tokenizer", "tokenizer_2", "tokenizer_3") if name != "tokenizer_3" or has_t5}
    return PipelineSources("sd3", pipeline_class, specs, tokenizers, read_scheduler_config(root))
