"""SD 1.x / 2.x / SDXL (the UNet family): StableDiffusion(XL)Pipeline folders and the original single files (ldm /
SGM names, or stable-diffusion.cpp's GGUF)."""

from dataclasses import replace

from ...loading.sources import transformer_from_file
from ...loading.vae_files import AUTOENCODER_KL, read_vae_file
from ...models import unet
from .. import previews
from ..family import Family
from .coreml_folder import claims_folder, read_apple_folder
from .folder import LDM_SCHEDULERS, check_unet_together, read_controlnets, sd_folder
from .pipeline import Conditioning, StableDiffusionPipeline  # noqa: F401
from .single_file import sd_single_file

UNET_MARK = "model.diffusion_model.input_blocks."   # an ldm UNet: SD 1.x / 2.x / XL checkpoints


def layout(*encoders):
    clip_classes = {"text_encoder": ("CLIPTextModel",), "text_encoder_2": ("CLIPTextModelWithProjection",)}
    return {"unet": ("UNet2DConditionModel",), "vae": ("AutoencoderKL",),
            **{name: clip_classes[name] for name in encoders},
            **{name.replace("text_encoder", "tokenizer"): None for name in encoders},
            "scheduler": tuple(LDM_SCHEDULERS)}


def read_folder(path, index, pipeline_class, components, request):
    found = sd_folder(path, index, pipeline_class, components, request.transformer)
    if request.vae is not None:
        found.components["vae"] = read_vae_file(request.vae, AUTOENCODER_KL, found.components["vae"].config,
                                                path / "vae" / "config.json", title="an SD")
        check_unet_together(request.vae, found.components)
    return found


def read_file(path, request):
    found = sd_single_file(path, vae_file=request.vae, prediction_type=request.prediction_type)
    if request.transformer is not None:    # a UNet file replacing the checkpoint's
        found.components["unet"] = replace(transformer_from_file(request.transformer, unet,
                                                                 found.components["unet"].config, path), name="unet")
        check_unet_together(request.transformer, found.components)
    return found


SD_ONLY = ("it takes its own text encoders and tokenizers (from its folder or single file); leave text_encoder(s)= "
           "and tokenizer= out")

FAMILY = Family(
    name="sd", title="SD 1.x / SDXL", article="an", pipeline=StableDiffusionPipeline,
    layouts={"StableDiffusionPipeline": layout("text_encoder"),        # SD 1.x / 2.x
             "StableDiffusionXLPipeline": layout("text_encoder", "text_encoder_2"),
             # the inpainting models' folders (9-channel UNets; a 4-channel one blends latents)
             "StableDiffusionInpaintPipeline": layout("text_encoder"),
             "StableDiffusionXLInpaintPipeline": layout("text_encoder", "text_encoder_2")},
    read_folder=read_folder,
    claims_folder=claims_folder, read_claimed_folder=read_apple_folder,   # Apple's Core ML folders
    keywords={"transformer": "a file replacing the denoiser", "vae": "a VAE file replacing the model's",
              "prediction_type": "an SD 2.x single file's or Apple Core ML folder's prediction (its tensors do "
                                 "not say)"},
    instead={"text_encoders": SD_ONLY, "text_encoder": SD_ONLY, "tokenizer": SD_ONLY},
    reference="mlxdiff.reference.stable_diffusion",
    order=60,
    preview=lambda pipeline_class: previews.SDXL if "XL" in pipeline_class else previews.SD15,
    claims_file=lambda names: any(n.startswith(UNET_MARK) for n in names),
    read_file=read_file,
    file_kinds="SD 1.x / 2.x / SDXL checkpoints (model.diffusion_model.input_blocks.*, .safetensors or "
               "stable-diffusion.cpp's .gguf)",
    reference_dtypes=("bfloat16", "float32"),
    reference_file_refusal="an SD 1.x / 2.x / XL single file",
    read_controlnets=read_controlnets,
)
