"""FLUX.1 (dev, schnell, Krea): FluxPipeline folders, with a transformer file (BFL / ComfyUI names, GGUF) replacing
a folder's."""

from ...models import flux1
from ..family import Family
from .folder import flux1_folder
from .pipeline import Conditioning, Flux1Pipeline  # noqa: F401  (mlxdiff.pipelines.flux1.Flux1Pipeline)

SCHEDULER = ("FlowMatchEulerDiscreteScheduler",)
COMPONENTS = {"transformer": ("FluxTransformer2DModel",), "vae": ("AutoencoderKL",),
              "text_encoder": ("CLIPTextModel",), "text_encoder_2": ("T5EncoderModel",), "tokenizer": None,
              "tokenizer_2": None, "scheduler": SCHEDULER}


def read_folder(path, index, pipeline_class, components, request):
    return flux1_folder(path, index, pipeline_class, components, request.transformer)


def part_of(names):
    if flux1.is_original(names):
        return ("a FLUX.1 transformer alone; give its pipeline folder as the model with this file as transformer=")
    return None


FAMILY = Family(
    name="flux1", title="FLUX.1", article="a", pipeline=Flux1Pipeline,
    layouts={"FluxPipeline": COMPONENTS},
    read_folder=read_folder,
    keywords={"transformer": "a file replacing the denoiser"},
    instead={"text_encoders": "FLUX.1 takes its folder's CLIP-L and T5 encoders",
             "text_encoder": "FLUX.1 takes its folder's CLIP-L and T5 encoders",
             "tokenizer": "FLUX.1 takes its folder's CLIP and T5 tokenizers"},
    reference="mlxdiff.reference.flux1",
    part_of=part_of,
)
