"""SD3.5 (Medium, Large, Large Turbo): StableDiffusion3Pipeline folders and Stability's single files, with clip_l /
clip_g / t5xxl files replacing a model's encoders."""

from ...errors import MlxdiffError
from ...loading.sources import check_together
from ...loading.vae_files import AUTOENCODER_KL, read_vae_file
from ...models import mmdit
from .. import previews
from ..family import Family
from .folder import read_controlnets, sd3_folder
from .pipeline import Conditioning, SD3Pipeline  # noqa: F401  (mlxdiff.pipelines.sd3.SD3Pipeline)
from .single_file import TEXT_ENCODER_FILES, sd3_single_file, text_encoder_file

CLIP = ("CLIPTextModelWithProjection",)
SCHEDULER = ("FlowMatchEulerDiscreteScheduler",)
SINGLE_FILE_MARK = "model.diffusion_model.joint_blocks."   # Stability's whole-model file (an MMDiT inside)


def read_folder(path, index, pipeline_class, components, request):
    found = sd3_folder(path, index, pipeline_class, components, request.transformer)
    if request.vae is not None:
        found.components["vae"] = read_vae_file(request.vae, AUTOENCODER_KL, found.components["vae"].config,
                                                path / "vae" / "config.json", title="an SD3.5")
        check_together(path, found.components)
    for short, file in (request.text_encoders or {}).items():
        if short == "t5xxl" and found.components.get("text_encoder_3") is None:
            raise MlxdiffError(f"{path}: this SD3.5 folder has no T5 (text_encoder_3 is null, and so is its "
                               "tokenizer_3); t5xxl= cannot be given to it")
        component = TEXT_ENCODER_FILES[short][0]
        found.components[component] = text_encoder_file(short, file, base_config=found.components[component].config)
    return found


def read_file(path, request):
    return sd3_single_file(path, transformer=request.transformer, text_encoders=request.text_encoders,
                           vae_file=request.vae)


def part_of(names):
    if mmdit.is_original(names):
        return ("an SD3.5 transformer alone; give the SD3.5 single file (or folder) as the model, with this file as "
                "transformer=")
    return None


FAMILY = Family(
    name="sd3", title="SD3.5", article="an", pipeline=SD3Pipeline,
    layouts={"StableDiffusion3Pipeline": {
        "transformer": ("SD3Transformer2DModel",), "vae": ("AutoencoderKL",), "text_encoder": CLIP,
        "text_encoder_2": CLIP, "text_encoder_3": ("T5EncoderModel",), "tokenizer": None, "tokenizer_2": None,
        "tokenizer_3": None, "scheduler": SCHEDULER}},
    optional=frozenset({"text_encoder_3", "tokenizer_3"}),   # without T5 (diffusers then uses zeros for its part)
    read_folder=read_folder,
    keywords={"transformer": "a file replacing the denoiser",
              "text_encoders": "SD3.5's clip_l / clip_g / t5xxl files (for an SD3.5 folder or single-file model)",
              "vae": "a VAE file replacing the model's"},
    instead={"text_encoder": "give text_encoders={'clip_l': F, 'clip_g': F, 't5xxl': F} (any of them)",
             "tokenizer": "SD3.5 takes its own (or the bundled) CLIP and T5 tokenizers"},
    reference="mlxdiff.reference.sd3",
    order=10,
    preview=previews.SD3,   # ComfyUI's latent_rgb_factors (pipelines/previews.py)
    claims_file=lambda names: any(n.startswith(SINGLE_FILE_MARK) for n in names),
    read_file=read_file,
    file_kinds="SD3.5 single files (Stability's sd3.5_*.safetensors: model.diffusion_model.joint_blocks.*)",
    part_of=part_of,
    read_controlnets=read_controlnets,     # SD3ControlNetModel folders (StableDiffusion3ControlNetPipeline)
)
