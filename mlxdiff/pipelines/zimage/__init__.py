"""Z-Image (Tongyi-MAI's Z-Image, Z-Image-Turbo): ZImagePipeline folders (and its img2img and inpaint twins'):
text-to-image, image-to-image and inpainting, and text-to-image with a ControlNet (ZImageControlNetPipeline: a
ZImageControlNetModel folder or alibaba-pai's Fun ControlNet Union file); or Tongyi-MAI's / ComfyUI's transformer
file or GGUF with its qwen_3_4b and ae files (beside it or given), or those files alone (files.py). The transformer
is models/zimage.py (its ControlNet models/controlnet_zimage.py), the VAE FLUX.1's AutoencoderKL, the text encoder
Qwen3 through models/text_llm.py."""

from ...errors import MlxdiffError
from ...models import zimage
from .. import previews
from ..family import Family
from ...loading.component_files import FLUX1_VAE_CONFIG
from ...loading.vae_files import AUTOENCODER_KL, read_vae_file
from .files import zimage_files
from .folder import TEXT_ENCODER_CLASSES, read_controlnets, zimage_folder
from .pipeline import Conditioning, ZImagePipeline  # noqa: F401  (mlxdiff.pipelines.zimage.ZImagePipeline)

COMPONENTS = {"transformer": ("ZImageTransformer2DModel",), "vae": ("AutoencoderKL",),
              "text_encoder": TEXT_ENCODER_CLASSES, "tokenizer": None,
              "scheduler": ("FlowMatchEulerDiscreteScheduler",)}


def read_folder(path, index, pipeline_class, components, request):
    for keyword in ("text_encoder", "tokenizer"):
        if getattr(request, keyword) is not None:
            raise MlxdiffError(f"{keyword}=: {path} is a Z-Image folder, which has its own Qwen3 and tokenizer; give "
                               "the files with the transformer file as the model (or no model) instead")
    found = zimage_folder(path, index, pipeline_class, components, request.transformer)
    if request.vae is not None:
        vae = found.components["vae"] = read_vae_file(
            request.vae, AUTOENCODER_KL, found.components["vae"].config or FLUX1_VAE_CONFIG,
            path / "vae" / "config.json", title="a Z-Image")
        channels = found.components["transformer"].args.in_channels
        if vae.args.latent_channels != channels:
            raise MlxdiffError(f"{request.vae}: its {vae.args.latent_channels} latent channels are not the "
                               f"transformer's in_channels {channels}; give this model's VAE")
    return found


def read_file(path, request):
    """The transformer given as the model: its Qwen3 and VAE files given or found beside it (ComfyUI's folders)."""
    return zimage_files(request.transformer or path, request.text_encoder, request.vae, request.tokenizer)


def read_files_alone(request):
    return zimage_files(request.transformer, request.text_encoder, request.vae, request.tokenizer)


def part_of(names):
    if zimage.is_original(names):
        return ("a Z-Image transformer; give it as the model (its qwen_3_4b and ae files beside it or given), or no "
                "model with transformer=, text_encoder= and vae=")
    return None


FAMILY = Family(
    name="zimage", title="Z-Image", article="a", pipeline=ZImagePipeline,
    layouts={name: COMPONENTS for name in ("ZImagePipeline", "ZImageImg2ImgPipeline", "ZImageInpaintPipeline")},
    read_folder=read_folder,
    keywords={"transformer": "a file replacing the denoiser",
              "text_encoder": "Z-Image's Qwen3 file (with its transformer file as the model, or alone)",
              "vae": "a VAE file replacing the model's",
              "tokenizer": "a Z-Image model's tokenizer folder (with its files)"},
    instead={"text_encoders": "give its one Qwen3 file as text_encoder=FILE"},
    reference="mlxdiff.reference.zimage",
    order=70,
    preview=previews.FLUX1,   # ComfyUI's latent_rgb_factors (pipelines/previews.py)
    claims_file=zimage.is_original,
    read_file=read_file,
    file_kinds="Z-Image files in their original / ComfyUI names (x_pad_token, layers.N.attention.qkv.*; GGUF too)",
    part_of=part_of,
    read_files_alone=read_files_alone,
    files_alone_kinds="a Z-Image file in its original / ComfyUI names",
    reference_file_refusal="a Z-Image single file",
    read_controlnets=read_controlnets,     # ZImageControlNetModel folders and files (ZImageControlNetPipeline)
)
