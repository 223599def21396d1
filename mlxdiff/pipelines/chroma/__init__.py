"""Chroma (lodestones' Chroma1-HD, Chroma1-Base, chroma-unlocked): ChromaPipeline and ChromaImg2ImgPipeline folders
(a transformer or VAE file may replace the folder's), the original single files and GGUFs with their t5xxl and ae
files, or those files alone. The blocks and VAE are FLUX.1's; the pipeline is FLUX.1's with T5 alone, its mask and
true CFG."""

from ...errors import MlxdiffError
from ...models import chroma
from .. import previews
from ..family import Family
from ...loading.component_files import FLUX1_VAE_CONFIG
from ...loading.vae_files import AUTOENCODER_KL, read_vae_file
from .files import chroma_files
from .folder import check_components, chroma_folder
from .pipeline import ChromaPipeline, Conditioning  # noqa: F401  (mlxdiff.pipelines.chroma.ChromaPipeline)

COMPONENTS = {"transformer": ("ChromaTransformer2DModel",), "vae": ("AutoencoderKL",),
              "text_encoder": ("T5EncoderModel",), "tokenizer": None,
              "scheduler": ("FlowMatchEulerDiscreteScheduler",)}


def read_folder(path, index, pipeline_class, components, request):
    found = chroma_folder(path, index, pipeline_class, components, request.transformer)
    if request.text_encoders:
        raise MlxdiffError(f"text_encoders=: {path} is a Chroma folder, which has its own T5; give the files with "
                           "the transformer file as the model instead")
    if request.vae is not None:
        found.components["vae"] = read_vae_file(
            request.vae, AUTOENCODER_KL, found.components["vae"].config or FLUX1_VAE_CONFIG,
            path / "vae" / "config.json", title="a Chroma")
        check_components(request.vae, found.components)
    return found


def read_file(path, request):
    return chroma_files(request.transformer or path, request.text_encoders, request.vae)


def read_files_alone(request):
    return chroma_files(request.transformer, request.text_encoders, request.vae)


def part_of(names):
    if chroma.is_original(names):
        return "a Chroma transformer; give it as the model (its t5xxl and ae files beside it or given)"
    return None


FAMILY = Family(
    name="chroma", title="Chroma", article="a", pipeline=ChromaPipeline,
    layouts={name: COMPONENTS for name in ("ChromaPipeline", "ChromaImg2ImgPipeline")},
    read_folder=read_folder,
    keywords={"transformer": "a file replacing the denoiser",
              "text_encoders": "Chroma's t5xxl file (with its transformer file as the model, or alone)",
              "vae": "a VAE file replacing the model's"},
    instead={"text_encoder": "give text_encoders={'t5xxl': F}",
             "tokenizer": "Chroma takes its own (or the bundled) T5 tokenizer"},
    reference="mlxdiff.reference.chroma",
    order=30,
    preview=previews.FLUX1,   # ComfyUI's latent_rgb_factors (pipelines/previews.py)
    claims_file=chroma.is_original,
    read_file=read_file,
    file_kinds="Chroma files in their original names (distilled_guidance_layer.*, double_blocks.N.*; GGUF too)",
    part_of=part_of,
    read_files_alone=read_files_alone,
    files_alone_kinds="a Chroma file in its original names",
    reference_file_refusal="a Chroma single file",
)
