"""An SD 1.x / SDXL ControlNet given as one original file: lllyasviel's control_v11p_sd15_*.pth (and the SD 2.x / XL
ones in the same layout) as the safetensors people share, ldm names with or without `control_model.` (a whole cldm
checkpoint's ControlNet part is read alone). The config is read off its shapes (models/controlnet.py's
config_from_original), the heads from the UNet it steers, as diffusers' from_single_file reads it."""

from ...errors import MlxdiffError
from ...formats import check_weight_file, tensor_shapes
from ...loading.sources import transformer_from_file
from ...models import controlnet


def controlnet_from_file(path, name, unet_spec):
    """The ComponentSpec of the ControlNet file `path` (named `name`), for the UNet of `unet_spec`; a
    diffusers-named file (its folder's diffusion_pytorch_model.safetensors alone) or another model's refused in one
    line."""
    path = check_weight_file(path, "ControlNet file")
    if not controlnet.is_original(list(tensor_shapes(path))):
        raise MlxdiffError(f"ControlNet {path}: not an original SD 1.x / SDXL ControlNet file (no input_hint_block / "
                           "zero_convs tensors); a diffusers ControlNetModel is read from its folder (config.json + "
                           "diffusion_pytorch_model.safetensors): give that folder")
    spec = transformer_from_file(path, controlnet, unet_spec.config, f"{unet_spec.source} (the UNet's config)")
    spec.name = name
    return spec
