"""Qwen-Image (Qwen/Qwen-Image): QwenImagePipeline folders (QwenImageImg2ImgPipeline's and
QwenImageInpaintPipeline's too), text-to-image, image-to-image and inpainting; QwenImageEditPipeline and
QwenImageEditPlusPipeline folders (Qwen-Image-Edit, -2509, -2511: one and several input images; with a mask
QwenImageEditInpaintPipeline, whose folders are Edit's; edit.py, with the Qwen2.5-VL vision tower of
models/vision_qwen25vl.py, mlx-vlm's); or ComfyUI's
transformer file (or a GGUF) with its qwen_2.5_vl_7b and qwen_image_vae files (beside it or given), or those files
alone (files.py); load(controlnets=) with QwenImageControlNetModel folders (InstantX's Union ControlNet:
QwenImageControlNetPipeline; its Inpainting ControlNet with control_mask=: QwenImageControlNetInpaintPipeline).
The transformer is models/qwenimage.py, the VAE models/vae_qwenimage.py (Wan's causal VAE on one frame), the text
encoder Qwen2.5-VL's language model through models/text_llm.py (mlx-lm's Qwen2 layers; the vision tower is read
only by the Edit pipelines)."""

from ...models import qwenimage, text_llm
from ...errors import MlxdiffError
from .. import previews
from ..family import Family
from .files import qwenimage_files
from .folder import qwenimage_folder, read_controlnets
from .edit import QwenImageEditPipeline
from .pipeline import Conditioning, QwenImagePipeline  # noqa: F401  (mlxdiff.pipelines.qwenimage.QwenImagePipeline)

COMPONENTS = {"transformer": ("QwenImageTransformer2DModel",), "vae": ("AutoencoderKLQwenImage",),
              "text_encoder": (text_llm.ARCHITECTURES["qwen2_5_vl"],), "tokenizer": None,
              "scheduler": ("FlowMatchEulerDiscreteScheduler",)}
# the Edit pipelines tokenize with their processor (Qwen2VLProcessor: its tokenizer and image processor, processor/)
EDIT_COMPONENTS = {**COMPONENTS, "processor": None}


def read_folder(path, index, pipeline_class, components, request):
    for keyword in ("text_encoder", "vae", "tokenizer"):
        if getattr(request, keyword) is not None:
            raise MlxdiffError(f"{keyword}=: {path} is a Qwen-Image folder, which has its own Qwen2.5-VL, VAE and "
                               "tokenizer; give the files with the transformer file as the model (or no model) "
                               "instead")
    return qwenimage_folder(path, index, pipeline_class, components, request.transformer)


def read_file(path, request):
    """The transformer given as the model: its Qwen2.5-VL and VAE files given or found beside it (ComfyUI's
    folders)."""
    return qwenimage_files(request.transformer or path, request.text_encoder, request.vae, request.tokenizer)


def read_files_alone(request):
    return qwenimage_files(request.transformer, request.text_encoder, request.vae, request.tokenizer)


def part_of(names):
    if qwenimage.is_original(names):
        return ("a Qwen-Image transformer; give it as the model (its qwen_2.5_vl_7b and qwen_image_vae files "
                "beside it or given), or no model with transformer=, text_encoder= and vae=")
    return None


FAMILY = Family(
    name="qwenimage", title="Qwen-Image", article="a", pipeline=QwenImagePipeline,
    layouts={**{name: COMPONENTS for name in ("QwenImagePipeline", "QwenImageImg2ImgPipeline",
                                              "QwenImageInpaintPipeline")},
             **{name: EDIT_COMPONENTS for name in QwenImagePipeline.EDIT_PIPELINES}},
    pipelines={name: QwenImageEditPipeline for name in QwenImagePipeline.EDIT_PIPELINES},
    read_folder=read_folder,
    keywords={"transformer": "a file replacing the denoiser",
              "text_encoder": "Qwen-Image's Qwen2.5-VL file (with its transformer file as the model, or alone)",
              "vae": "Qwen-Image's VAE file in Wan's names (with its transformer file)",
              "tokenizer": "a Qwen-Image model's tokenizer folder (with its files)"},
    instead={"text_encoders": "give its one Qwen2.5-VL file as text_encoder=FILE"},
    reference="mlxdiff.reference.qwenimage",
    order=80,
    preview=previews.WAN21,   # ComfyUI's latent_rgb_factors (pipelines/previews.py)
    claims_file=qwenimage.is_original,
    read_file=read_file,
    file_kinds="Qwen-Image transformer files (diffusers' names, bare or under model.diffusion_model.: txt_norm, "
               "transformer_blocks.N.img_mod.*; GGUF too)",
    part_of=part_of,
    read_files_alone=read_files_alone,
    files_alone_kinds="a Qwen-Image transformer file (diffusers' / ComfyUI's names)",
    reference_file_refusal="a Qwen-Image single file",
    read_controlnets=read_controlnets,     # QwenImageControlNetModel folders (QwenImageControlNetPipeline)
)
