"""FLUX.1 (dev, schnell, Krea; Kontext; Fill; Depth / Canny): FluxPipeline, FluxKontextPipeline, FluxFillPipeline
and FluxControlPipeline folders (a transformer or VAE file may replace the folder's), BFL's and
ComfyUI's single files and GGUFs with their clip_l / t5xxl / ae files, or those files alone."""

from ...errors import MlxdiffError
from ...models import controlnet_flux1, flux1
from .. import previews
from ..family import Family
from ...loading.vae_files import AUTOENCODER_KL, read_vae_file
from ...loading.component_files import FLUX1_VAE_CONFIG
from .files import flux1_files
from .folder import check_latents, flux1_folder, read_controlnets
from .pipeline import Conditioning, Flux1Pipeline  # noqa: F401  (mlxdiff.pipelines.flux1.Flux1Pipeline)

SCHEDULER = ("FlowMatchEulerDiscreteScheduler",)
COMPONENTS = {"transformer": ("FluxTransformer2DModel",), "vae": ("AutoencoderKL",),
              "text_encoder": ("CLIPTextModel",), "text_encoder_2": ("T5EncoderModel",), "tokenizer": None,
              "tokenizer_2": None, "scheduler": SCHEDULER}


def read_folder(path, index, pipeline_class, components, request):
    found = flux1_folder(path, index, pipeline_class, components, request.transformer)
    if request.text_encoders:
        raise MlxdiffError(f"text_encoders=: {path} is a FLUX.1 folder, which has its own CLIP-L and T5; give the "
                           "files with the transformer file as the model instead")
    if request.vae is not None:
        found.components["vae"] = read_vae_file(
            request.vae, AUTOENCODER_KL, found.components["vae"].config or FLUX1_VAE_CONFIG,
            path / "vae" / "config.json", title="a FLUX.1")
        check_latents(request.vae, found.components, pipeline_class)
    return found


def read_file(path, request):
    """The model given as one file: BFL's transformer (its encoders and VAE found beside it or given) or ComfyUI's
    all-in-one checkpoint."""
    return flux1_files(request.transformer or path, request.text_encoders, request.vae, bundle=path)


def read_files_alone(request):
    return flux1_files(request.transformer, request.text_encoders, request.vae)


def part_of(names):
    if flux1.is_original(names):
        return "a FLUX.1 transformer; give it as the model (its clip_l, t5xxl and ae files beside it or given)"
    return None


FAMILY = Family(
    name="flux1", title="FLUX.1", article="a", pipeline=Flux1Pipeline,
    layouts={name: COMPONENTS for name in ("FluxPipeline", "FluxKontextPipeline", "FluxFillPipeline",
                                           "FluxControlPipeline")},
    read_folder=read_folder,
    keywords={"transformer": "a file replacing the denoiser",
              "text_encoders": "FLUX.1's clip_l / t5xxl files (with its transformer file as the model, or alone)",
              "vae": "a VAE file replacing the model's"},
    instead={"text_encoder": "give text_encoders={'clip_l': F, 't5xxl': F} (either of them)",
             "tokenizer": "FLUX.1 takes its own (or the bundled) CLIP and T5 tokenizers"},
    reference="mlxdiff.reference.flux1",
    order=20,
    preview=previews.FLUX1,   # ComfyUI's latent_rgb_factors (pipelines/previews.py)
    claims_file=flux1.is_original,
    read_file=read_file,
    file_kinds="FLUX.1 files in BFL / ComfyUI names (double_blocks.N.img_mod.*, vector_in.*; GGUF too)",
    part_of=part_of,
    read_files_alone=read_files_alone,
    files_alone_kinds="a FLUX.1 file in BFL / ComfyUI names",
    reference_file_refusal="a FLUX.1 single file",
    read_controlnets=read_controlnets,     # FluxControlNetModel folders (FluxControlNetPipeline)
    control_modes=controlnet_flux1.UNION_MODES,
)
