"""What the user named -> PipelineSources: a pipeline folder (sources.sd3_folder / flux2_folder), a hub id in the
local cache, or an SD3.5 single file (single_file.py)."""

from ..errors import MlxdiffError
from ..formats import check_weight_file
from .single_file import sd3_single_file
from .sources import (PIPELINE_FAMILIES, PipelineSources, flux2_folder, not_a_folder, read_pipeline_folder,
                      resolve_path, sd3_folder)


def resolve(model, *, transformer=None, text_encoders=None) -> PipelineSources:
    """What the user named -> PipelineSources (a folder, a cached hub id, or an SD3.5 single file)."""
    path = resolve_path(model)
    if transformer is not None:
        check_weight_file(not_a_folder(transformer, "transformer file"), "transformer file")
    if path.is_dir():
        index, pipeline_class, components = read_pipeline_folder(path)
        family = PIPELINE_FAMILIES[pipeline_class]
        read = sd3_folder if family == "sd3" else flux2_folder
        return read(path, index, pipeline_class, components, transformer)
    if path.suffix == ".safetensors":
        return sd3_single_file(path, transformer=transformer, text_encoders=text_encoders)
    raise MlxdiffError(f"{path}: expected a pipeline folder (with model_index.json) or a .safetensors file")
