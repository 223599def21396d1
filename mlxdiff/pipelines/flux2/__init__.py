"""FLUX.2 (dev, klein 4B / 9B, base and distilled): Flux2Pipeline / Flux2KleinPipeline folders, or the transformer,
text encoder and VAE files alone (ComfyUI's)."""

from ...models import flux2, text_llm
from .. import previews
from ..family import Family
from .files import flux2_files
from .folder import flux2_folder
from .pipeline import Conditioning, Flux2Pipeline  # noqa: F401  (mlxdiff.pipelines.flux2.Flux2Pipeline)

SCHEDULER = ("FlowMatchEulerDiscreteScheduler",)
COMPONENTS = {"transformer": ("Flux2Transformer2DModel",), "vae": ("AutoencoderKLFlux2",),
              "text_encoder": tuple(text_llm.ARCHITECTURES[t] for t in ("mistral3", "qwen3")), "tokenizer": None,
              "scheduler": SCHEDULER}


def read_folder(path, index, pipeline_class, components, request):
    return flux2_folder(path, index, pipeline_class, components, request.transformer, request.text_encoder,
                        request.vae, request.tokenizer)


def read_files_alone(request):
    return flux2_files(request.transformer, request.text_encoder, request.vae, request.tokenizer)


def part_of(names):
    if flux2.is_original(names) and not flux2.is_previous_generation(names):
        return ("a FLUX.2 transformer alone; give its pipeline folder as the model with this file as transformer=, "
                "or no model with transformer=, text_encoder= and vae=")
    return None


FAMILY = Family(
    name="flux2", title="FLUX.2", article="a", pipeline=Flux2Pipeline,
    layouts={"Flux2Pipeline": COMPONENTS, "Flux2KleinPipeline": COMPONENTS},
    read_folder=read_folder,
    keywords={"transformer": "a file replacing the denoiser", "text_encoder": "FLUX.2's one encoder file",
              "vae": "a VAE file replacing the model's", "tokenizer": "a FLUX.2 model's tokenizer folder"},
    instead={"text_encoders": "give its one encoder file as text_encoder=FILE"},
    reference="mlxdiff.reference.flux2",
    order=50,
    preview=previews.FLUX2,   # ComfyUI's latent_rgb_factors (pipelines/previews.py)
    part_of=part_of,
    read_files_alone=read_files_alone,
    files_alone_kinds="a FLUX.2 file in BFL / ComfyUI names (double_blocks.N.*, single_blocks.N.*)",
)
