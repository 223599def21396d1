"""A FLUX.1 diffusers folder (FluxPipeline: dev, schnell, Krea; FluxKontextPipeline; FluxFillPipeline;
FluxControlPipeline) -> PipelineSources."""

from pathlib import Path

from ...errors import MlxdiffError
from ...formats import check_weight_file, tensor_shapes
from ...loading.sources import config_from_shapes, folder_component, read_scheduler_config, tokenizer_folder, \
    transformer_from_file
from ...loading.spec import ComponentSpec, PipelineSources
from ...models import controlnet_flux1, flux1
from ...tokenizers import load_tokenizer
from .. import controls
from ..controls import refuse
from ..family import identify

ENCODERS = ("text_encoder", "text_encoder_2")     # CLIP-L (pooled), T5-XXL


def check_encoders(where, specs) -> None:
    """The encoders' widths are what the transformer takes: CLIP-L's pooled vector and T5's features."""
    transformer = specs["transformer"].args
    clip, t5 = specs["text_encoder"].args, specs["text_encoder_2"].args
    if clip.hidden_size != transformer.pooled_projection_dim:
        raise MlxdiffError(f"{where}: the transformer's pooled_projection_dim is {transformer.pooled_projection_dim} "
                           f"but the CLIP text encoder gives {clip.hidden_size}; the components do not belong "
                           "together")
    if t5.d_model != transformer.joint_attention_dim:
        raise MlxdiffError(f"{where}: the transformer's joint_attention_dim is {transformer.joint_attention_dim} but "
                           f"the T5 text encoder gives {t5.d_model}; the components do not belong together")


def check_is_flux1(path) -> None:
    """A transformer file given to a FLUX.1 model that another family says is its own (FLUX.2's BFL names, an SD3.5
    transformer, ...) is refused in one line saying what it is."""
    names = list(tensor_shapes(path))
    if not flux1.is_original(names):
        hint = identify(names, but="flux1")
        if hint is not None:
            raise MlxdiffError(f"{path}: {hint}; this is a FLUX.1 model")


def fill_channels(vae_args) -> int:
    """A Fill transformer's input channels: the packed noise and masked-image latents (4 x the VAE's latent
    channels each) and the mask's f x f pixel patches packed 2 x 2 (f the VAE's factor): 64 + 64 + 256 = 384."""
    f = 2 ** (len(vae_args.block_out_channels) - 1)
    return 8 * vae_args.latent_channels + 4 * f * f


# what a transformer takes beside the noise, by pipeline class: Fill the masked image and the mask, Control the
# control image (the others nothing)
EXTRA_INPUTS = {"FluxFillPipeline": "fill", "FluxControlPipeline": "control"}


def expected_in_channels(kind, vae_args) -> int:
    latent = vae_args.latent_channels
    return {"fill": fill_channels(vae_args), "control": 8 * latent}.get(kind, 4 * latent)


def kind_of(in_channels, vae_args):
    """The pipeline class a transformer file's input width says (Fill's 384, Control's 128), else None."""
    for cls, kind in EXTRA_INPUTS.items():
        if in_channels == expected_in_channels(kind, vae_args):
            return cls
    return None


def check_latents(where, specs, pipeline_class) -> None:
    """The transformer takes what the VAE gives: 4 x its latent channels (2 x 2 patches), Fill also the masked
    image and the mask (fill_channels), Control the control image's latents (8 x); and puts out 4 x the latent
    channels."""
    transformer, autoencoder = specs["transformer"].args, specs["vae"].args
    kind = EXTRA_INPUTS.get(pipeline_class)
    takes, gives = transformer.in_channels, autoencoder.latent_channels
    expected = expected_in_channels(kind, autoencoder)
    out = transformer.out_channels or takes
    if takes != expected or out != 4 * gives:
        what = {"fill": "a Fill transformer's input is 8 x the latent channels + 4 x the VAE factor squared (the "
                        "mask)", "control": "a Depth / Canny transformer's input is 8 x the latent channels"}.get(
            kind, "4 x the latent channels (2x2 patches)")
        raise MlxdiffError(f"{where}: the transformer takes in_channels {takes} and gives {out} but the VAE has "
                           f"{gives} latent channels ({what}: expected {expected} in, {4 * gives} out); the "
                           "components do not belong together")


def flux1_folder(root: Path, index, pipeline_class, components, transformer=None) -> PipelineSources:
    """A FluxPipeline folder; `transformer`: a file replacing its transformer (BFL / ComfyUI names, GGUF, or
    diffusers names with the folder's config)."""
    specs = {name: folder_component(root, name, components[name], name == "transformer" and transformer is not None)
             for name in ("transformer", "vae", *ENCODERS)}
    specs["text_encoder"].config["architectures"] = [components["text_encoder"]]   # CLIPTextModel: no projection
    if transformer is not None:
        check_is_flux1(transformer)
        specs["transformer"] = transformer_from_file(transformer, flux1, specs["transformer"].config,
                                                     root / "transformer" / "config.json")
    check_latents(root / "model_index.json", specs, pipeline_class)
    check_encoders(root / "model_index.json", specs)
    tokenizers = {name: load_tokenizer(tokenizer_folder(root, name), components[name])
                  for name in ("tokenizer", "tokenizer_2")}
    return PipelineSources("flux1", pipeline_class, specs, tokenizers, read_scheduler_config(root))


# -- ControlNets (load(controlnets=)): diffusers' FluxControlNetModel folders, or their files alone ------------------
CONTROLNET_CLASS = "FluxControlNetModel"
OWN_INPUTS = ("FluxKontextPipeline", "FluxFillPipeline", "FluxControlPipeline")   # no FluxControlNetPipeline there


def check_controlnet(where, net, specs) -> None:
    """A FLUX.1 ControlNet fits the transformer it steers: the same packed latents as its input, the same width
    (its residuals join the image stream), prompt and pooled widths, the depths of the ControlNets already given
    (their residuals are summed); XLabs' conv stack must bring the control image to the tokens' grid."""
    t, vae = specs["transformer"].args, specs["vae"].args
    other = "a ControlNet of another family or size (FLUX.1's take 64 packed channels, 3072 wide)"
    for what, theirs, ours in (("in_channels", net.in_channels, t.in_channels),
                               ("width (num_attention_heads * attention_head_dim)", net.width, t.width),
                               ("joint_attention_dim", net.joint_attention_dim, t.joint_attention_dim),
                               ("pooled_projection_dim", net.pooled_projection_dim, t.pooled_projection_dim)):
        if theirs != ours:
            refuse(where, what, theirs, ours, other)
    if net.conditioning_embedding_channels is not None:
        factor = 2 ** (len(vae.block_out_channels) - 1) * 2          # pixels per token side
        hint = 2 ** 3 * net.patch_size
        if hint != factor or net.conditioning_embedding_channels * net.patch_size ** 2 != net.in_channels:
            refuse(where, "control image factor (input_hint_block's 8 x patch_size)", hint, factor,
                   "its control tokens must match the noise tokens")
    first = specs.get("controlnet")
    if first is not None:
        for key in ("num_layers", "num_single_layers"):
            if getattr(first.args, key) != getattr(net, key):
                refuse(where, key, getattr(net, key), f"{getattr(first.args, key)} (the first ControlNet's)",
                       "several ControlNets' residuals are summed block by block: give ControlNets of one depth")
        if first.args.guidance_embeds != net.guidance_embeds:     # FluxControlNetPipeline reads the first's for all
            refuse(where, "guidance_embeds", net.guidance_embeds, f"{first.args.guidance_embeds} (the first "
                   "ControlNet's)", "diffusers gives every ControlNet the guidance the first one takes")


def controlnet_file(path, components) -> ComponentSpec:
    """A FLUX.1 ControlNet as one file without its config.json: InstantX's / Shakker-Labs' (Union, Union-Pro, -Pro
    2.0) diffusion_pytorch_model.safetensors in diffusers names, or XLabs' x-flux file (canny / depth / hed v3);
    the config read off its shapes, axes_dims_rope the model's transformer's (controlnet_flux1.config_from_file)."""
    path = check_weight_file(path, "ControlNet file")
    shapes = tensor_shapes(path)
    layout = controlnet_flux1.file_layout(shapes)
    if layout == "mistoline":
        raise MlxdiffError(f"ControlNet {path}: a MistoLine ControlNet (controlnet_blocks.N.linear): not read; use a "
                           "diffusers FluxControlNetModel folder or file, or an XLabs x-flux ControlNet file")
    if layout is None:
        hint = identify(list(shapes))
        raise MlxdiffError(f"ControlNet {path}: {hint + ', ' if hint else ''}not a FLUX.1 ControlNet file (no "
                           "controlnet_blocks with controlnet_x_embedder or x-flux's double_blocks); give a diffusers "
                           "FluxControlNetModel folder or its safetensors, or an XLabs x-flux ControlNet file")
    transformer = components.get("transformer")
    axes = transformer.args.axes_dims_rope if transformer is not None else None
    config = config_from_shapes(controlnet_flux1, lambda s: controlnet_flux1.config_from_file(s, layout, axes),
                                shapes, path)
    return ComponentSpec("controlnet", controlnet_flux1, config, [path],
                         keymap=controlnet_flux1.xlabs_to_diffusers if layout == "xlabs" else None)


def read_controlnets(found, controlnets) -> None:
    """load(controlnets=[(path, scale), ...]) for a FLUX.1 dev / schnell / Krea model (pipelines/controls.py)."""
    if found.pipeline_class in OWN_INPUTS:
        raise MlxdiffError(f"controlnets=: this is a {found.pipeline_class} model; diffusers' FluxControlNetPipeline "
                           "steers FLUX.1 dev, schnell or Krea (FluxPipeline): give one of those as the model")
    controls.read_controlnets(found, controlnets, CONTROLNET_CLASS, "a FLUX.1", check_controlnet, controlnet_file)
