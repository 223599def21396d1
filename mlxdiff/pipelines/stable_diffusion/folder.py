"""An SD 1.x / 2.x / XL diffusers folder (StableDiffusionPipeline, StableDiffusionXLPipeline) -> PipelineSources,
and what the UNet family's components must agree on."""

from dataclasses import dataclass
from pathlib import Path

from ...config_checks import CheckedArgs, Limit, between, positive, show
from ...errors import MlxdiffError
from ...loading.sources import folder_component, read_scheduler_config, tokenizer_folder, transformer_from_file
from ...loading.spec import PipelineSources
from ...models import unet as unet_arch
from ...tokenizers import load_tokenizer
# the UNet family's scheduler classes -> the sampler a folder runs by default (ldm_schedulers.SCHEDULERS)
LDM_SCHEDULERS = {"PNDMScheduler": "pndm", "EulerDiscreteScheduler": "euler",
                  "EulerAncestralDiscreteScheduler": "euler_a", "DDIMScheduler": "ddim",
                  "DPMSolverMultistepScheduler": "dpmpp_2m"}


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


def sd_folder(root: Path, index, pipeline_class, components, unet=None) -> PipelineSources:
    """A StableDiffusionPipeline (SD 1.x / 2.x) or StableDiffusionXLPipeline folder; `unet`: a file replacing the
    UNet (original or diffusers names). The scheduler's class is the default sampler (LDM_SCHEDULERS)."""
    xl = pipeline_class == "StableDiffusionXLPipeline"
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
    if autoencoder.latent_channels != unet.in_channels:
        raise MlxdiffError(f"{where}: the UNet takes in_channels {unet.in_channels} but the VAE gives "
                           f"latent_channels {autoencoder.latent_channels}; the components do not belong together")
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
