"""An SD3.5 diffusers folder (StableDiffusion3Pipeline) -> PipelineSources."""

from pathlib import Path

from ...errors import MlxdiffError
from ...loading.sources import check_together, folder_component, read_scheduler_config, tokenizer_folder, \
    transformer_from_file
from ...loading.spec import PipelineSources
from ...models import mmdit
from ...tokenizers import load_tokenizer
from .. import controls
from ..controls import refuse


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


# -- ControlNets (load(controlnets=)): diffusers' SD3ControlNetModel folders ------------------------------------------
CONTROLNET_CLASS = "SD3ControlNetModel"


def check_controlnet(where, net, specs) -> None:
    """An SD3 ControlNet fits the transformer it steers: the VAE's latents as its input, the same patches and width
    (its residuals join the transformer's image stream), the same prompt and pooled widths, the depth of the
    ControlNets already given (their residuals are summed); the inpainting ControlNets' extra channels refused."""
    t, latent = specs["transformer"].args, specs["vae"].args.latent_channels
    other = "a ControlNet of another SD3 size (Medium's, Large's) or another family"
    if net.extra_conditioning_channels:
        raise MlxdiffError(f"ControlNet {where}: its extra_conditioning_channels is {net.extra_conditioning_channels} "
                           "(an SD3 inpainting ControlNet, diffusers' StableDiffusion3ControlNetInpaintingPipeline); "
                           "not supported: give a ControlNet that takes the control image alone")
    for what, theirs, ours in (("in_channels", net.in_channels, latent), ("patch_size", net.patch_size, t.patch_size),
                               ("width (num_attention_heads * attention_head_dim)", net.width,
                                t.num_attention_heads * t.attention_head_dim),
                               ("pooled_projection_dim", net.pooled_projection_dim, t.pooled_projection_dim)):
        if theirs != ours:
            refuse(where, what, theirs, ours, other)
    if net.joint_attention_dim is not None and net.joint_attention_dim != t.joint_attention_dim:
        refuse(where, "joint_attention_dim", net.joint_attention_dim, t.joint_attention_dim, other)
    first = specs.get("controlnet")
    if first is not None and first.args.num_layers != net.num_layers:
        refuse(where, "num_layers", net.num_layers, f"{first.args.num_layers} (the first ControlNet's)",
               "several ControlNets' residuals are summed block by block: give ControlNets of one depth")


def read_controlnets(found, controlnets) -> None:
    """load(controlnets=[(path, scale), ...]) for an SD3.5 model (pipelines/controls.py)."""
    controls.read_controlnets(found, controlnets, CONTROLNET_CLASS, "an SD3", check_controlnet)
