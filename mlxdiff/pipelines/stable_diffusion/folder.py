"""An SD 1.x / 2.x / XL diffusers folder (StableDiffusionPipeline, StableDiffusionXLPipeline) -> PipelineSources,
and what the UNet family's components must agree on."""

from dataclasses import dataclass
from pathlib import Path

from ...config_checks import CheckedArgs, Limit, Rule, between, positive, show
from ...errors import MlxdiffError
from ...loading.sources import (folder_component, read_json, read_scheduler_config, tokenizer_folder,
                                transformer_from_file)
from ...loading.spec import PipelineSources
from ...models import unet as unet_arch
from ...tokenizers import load_tokenizer
from .controlnet_file import controlnet_from_file
# the UNet family's scheduler classes -> the sampler a folder runs by default (ldm_schedulers.SCHEDULERS)
LDM_SCHEDULERS = {"PNDMScheduler": "pndm", "EulerDiscreteScheduler": "euler",
                  "EulerAncestralDiscreteScheduler": "euler_a", "DDIMScheduler": "ddim",
                  "DPMSolverMultistepScheduler": "dpmpp_2m"}
# the SDXL classes of the family's folders (StableDiffusionXLInpaintPipeline: sdxl-1.0-inpainting-0.1's)
XL_CLASSES = ("StableDiffusionXLPipeline", "StableDiffusionXLInpaintPipeline")


@dataclass
class LdmSchedulerArgs(CheckedArgs):
    """scheduler_config.json of the UNet family: the keys ldm_schedulers reads, typed (it refuses the settings it
    does not implement)."""
    num_train_timesteps: int = 1000
    beta_start: float = 0.0001
    beta_end: float = 0.02
    beta_schedule: str = "linear"
    prediction_type: str = "epsilon"
    timestep_spacing: str = "linspace"
    steps_offset: int = 0
    use_karras_sigmas: bool = False
    clip_sample: bool = True
    clip_sample_range: float = 1.0
    set_alpha_to_one: bool = True
    skip_prk_steps: bool = False
    sigma_min: float | None = None
    sigma_max: float | None = None

    WHAT = "scheduler_config.json"
    LIMITS = {
        "num_train_timesteps": between(2, 100000),
        "beta_start": Limit(gt=0, hi=0.999),
        "beta_end": Limit(gt=0, hi=0.999),
        "steps_offset": between(0, 100000),
        "clip_sample_range": positive(1e4),
        "sigma_min": positive(1e4),
        "sigma_max": positive(1e4),
    }
    RULES = (Rule("beta_end", lambda a: a.beta_end > a.beta_start,
                  lambda a: f"above beta_start ({a.beta_start}): the noise schedule rises (SD's: 0.00085 to 0.012)"),)


def sd_folder(root: Path, index, pipeline_class, components, unet=None) -> PipelineSources:
    """A StableDiffusionPipeline (SD 1.x / 2.x) or StableDiffusionXLPipeline folder; `unet`: a file replacing the
    UNet (original or diffusers names). The scheduler's class is the default sampler (LDM_SCHEDULERS)."""
    xl = pipeline_class in XL_CLASSES
    encoders = ("text_encoder", "text_encoder_2") if xl else ("text_encoder",)
    specs = {name: folder_component(root, name, components[name], name == "unet" and unet is not None)
             for name in ("unet", "vae", *encoders)}
    for name in encoders:   # the folder's class says whether the encoder has a projection
        specs[name].config["architectures"] = [components[name]]
    if unet is not None:
        specs["unet"] = transformer_from_file(unet, unet_arch, specs["unet"].config, root / "unet" / "config.json")
        specs["unet"].name = "unet"
    check_unet_together(root, specs)
    tokenizers = {name: load_tokenizer(tokenizer_folder(root, name), components[name])
                  for name in (("tokenizer", "tokenizer_2") if xl else ("tokenizer",))}
    scheduler = dict(read_scheduler_config(root, LdmSchedulerArgs), _class_name=components["scheduler"])
    force_zeros = index.get("force_zeros_for_empty_prompt", xl)
    if not isinstance(force_zeros, bool):
        raise MlxdiffError(f"{root / 'model_index.json'}: force_zeros_for_empty_prompt is {show(force_zeros)}; "
                           "expected true or false")
    return PipelineSources("sd", pipeline_class, specs, tokenizers, scheduler,
                           {"force_zeros_for_empty_prompt": force_zeros})


def check_unet_together(where, specs) -> None:
    """The UNet family's components agree: the VAE's latents are the UNet's input, the encoders' widths its
    cross-attention width (SDXL: both encoders' concatenated) and SDXL's added embedding the pooled width."""
    unet, autoencoder = specs["unet"].args, specs["vae"].args
    latent = autoencoder.latent_channels
    if unet.in_channels not in (latent, 2 * latent + 1):      # 2 x + 1: an inpainting UNet's (+ mask + masked image)
        raise MlxdiffError(f"{where}: the UNet takes in_channels {unet.in_channels} but the VAE gives "
                           f"latent_channels {latent} (an inpainting UNet takes {2 * latent + 1}: the latents, the "
                           "mask and the masked image's latents); the components do not belong together")
    encoders = [specs[n].args for n in ("text_encoder", "text_encoder_2") if n in specs]
    width = sum(e.hidden_size for e in encoders)
    if set(unet.cross_dims) != {width}:
        raise MlxdiffError(f"{where}: the UNet's cross_attention_dim is {unet.cross_attention_dim} but the text "
                           f"encoders give {width}; the components do not belong together (an SDXL UNet needs both "
                           "of SDXL's encoders, SD 1.x one CLIP-L, SD 2.x one OpenCLIP-H)")
    if unet.addition_embed_type == "text_time":
        if len(encoders) < 2:
            raise MlxdiffError(f"{where}: the UNet is SDXL's (text_time conditioning) but there is no second text "
                               "encoder; give the SDXL folder or file whole")
        pooled = encoders[1].projection_dim
        want = pooled + 6 * unet.addition_time_embed_dim
        if unet.projection_class_embeddings_input_dim != want:
            raise MlxdiffError(f"{where}: the UNet's projection_class_embeddings_input_dim is "
                               f"{unet.projection_class_embeddings_input_dim}; the second encoder's projection "
                               f"({pooled}) and six time ids of {unet.addition_time_embed_dim} give {want}")


# -- ControlNets (load(controlnets=)): diffusers' ControlNetModel folders --------------------------------------------
CONTROLNET_CLASS = "ControlNetModel"


def controlnet_name(index: int) -> str:
    """The component name of the index-th ControlNet: controlnet, controlnet_2, ... (as text_encoder_2)."""
    return "controlnet" if index == 0 else f"controlnet_{index + 1}"


def controlnet_spec(path, name, unet_spec=None):
    """A diffusers ControlNetModel folder (config.json + diffusion_pytorch_model.safetensors), or an original single
    file (controlnet_file.py; its heads from `unet_spec`'s config) -> its ComponentSpec; another class's ControlNet
    (SD3.5's, FLUX.1's, a Union one) refused in one line."""
    path = Path(path)
    if not path.exists():
        raise MlxdiffError(f"ControlNet {path}: no such folder or file; give a diffusers ControlNetModel folder "
                           "(config.json + diffusion_pytorch_model.safetensors) or an original ControlNet file")
    if not path.is_dir():
        if unet_spec is None:
            raise MlxdiffError(f"ControlNet {path}: a single file's config needs the UNet it steers; give it with "
                               "the model (load(model, controlnets=[...]))")
        return controlnet_from_file(path, name, unet_spec)
    config = read_json(path / "config.json", "the ControlNet config", path)
    cls = config.get("_class_name", CONTROLNET_CLASS)
    if cls != CONTROLNET_CLASS:
        raise MlxdiffError(f"ControlNet {path}: its config.json says {show(cls)}, not an SD 1.x / SDXL ControlNet "
                           f"({CONTROLNET_CLASS}); give a ControlNet made for this model")
    spec = folder_component(path.parent, path.name, CONTROLNET_CLASS)
    spec.name = name
    return spec


def check_controlnet(where, net, specs) -> None:
    """A ControlNet fits the UNet it steers: the same cross-attention width and added conditioning (its family: SD
    1.x, 2.x or SDXL), the same down path (its residuals are the UNet's skips), the VAE's latents as its input and a
    control image at the VAE's factor."""
    unet, autoencoder = specs["unet"].args, specs["vae"].args

    def refuse(what, theirs, ours, why):
        raise MlxdiffError(f"ControlNet {where}: its {what} is {theirs} but the model's is {ours}; {why}")
    family = "a ControlNet made for another model family (SD 1.x: 768, SD 2.x: 1024, SDXL: 2048)"
    if set(net.cross_dims) != set(unet.cross_dims):
        refuse("cross_attention_dim", net.cross_attention_dim, unet.cross_attention_dim, family)
    if net.addition_embed_type != unet.addition_embed_type or (
            net.projection_class_embeddings_input_dim != unet.projection_class_embeddings_input_dim):
        refuse("added conditioning", show(net.addition_embed_type), show(unet.addition_embed_type),
               "an SDXL ControlNet steers an SDXL model, an SD 1.x / 2.x one an SD 1.x / 2.x model")
    for key in ("block_out_channels", "layers", "down_block_types"):
        if tuple(getattr(net, key)) != tuple(getattr(unet, key)):
            refuse(key.replace("layers", "layers_per_block"), show(getattr(net, key)), show(getattr(unet, key)),
                   "its residuals must match the UNet's blocks: a ControlNet of another size")
    if net.in_channels != autoencoder.latent_channels:
        refuse("in_channels", net.in_channels, autoencoder.latent_channels, "it takes the VAE's latents")
    factor = 2 ** (len(autoencoder.block_out_channels) - 1)
    if 2 ** (len(net.conditioning_embedding_out_channels) - 1) != factor:
        refuse("control image factor", 2 ** (len(net.conditioning_embedding_out_channels) - 1), factor,
               "its conditioning_embedding_out_channels must bring the control image to the latents' size")


def read_controlnets(found, controlnets) -> None:
    """load(controlnets=[(path, scale), ...]): each ControlNet read and checked against the model, added to its
    components (controlnet, controlnet_2, ...) with its scale in found.options["controlnet_scales"]."""
    if found.components["unet"].args.in_channels != found.components["vae"].args.latent_channels:
        raise MlxdiffError("controlnets=: this model's UNet is an inpainting one (9 input channels); mlxdiff runs "
                           "ControlNets with the text-to-image UNets (diffusers' "
                           "StableDiffusion(XL)ControlNetPipeline)")
    for index, (path, _) in enumerate(controlnets):
        spec = controlnet_spec(path, controlnet_name(index), found.components["unet"])
        check_controlnet(path, spec.args, found.components)
        found.components[spec.name] = spec
    found.options["controlnet_scales"] = [scale for _, scale in controlnets]
