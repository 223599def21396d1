"""FLUX 3 Image Klein (distilled and base): diffusers' modular-pipeline folders (Flux3DistilledModularPipeline,
Flux3ModularPipeline: modular_model_index.json, folder.py). The transformer is models/flux3.py, the VAE FLUX.2's
(models/vae_flux2.py), the text encoder Qwen3-VL's language model through models/text_llm.py."""

from ...models import flux3, text_qwen3vl
from .. import previews
from ..family import Family
from .folder import flux3_folder
from .pipeline import Conditioning, Flux3Pipeline  # noqa: F401  (mlxdiff.pipelines.flux3.Flux3Pipeline)

COMPONENTS = {"transformer": ("Flux3Transformer2DModel",), "vae": ("AutoencoderKLFlux2",),
              "text_encoder": text_qwen3vl.CLASSES, "tokenizer": None}


def read_folder(path, index, pipeline_class, components, request):
    return flux3_folder(path, index, pipeline_class, components, request.transformer, request.vae)


def part_of(names):
    if flux3.is_original(names):
        return "a FLUX 3 transformer alone; give its pipeline folder as the model with this file as transformer="
    return None


FAMILY = Family(
    name="flux3", title="FLUX 3", article="a", pipeline=Flux3Pipeline,
    layouts={"Flux3DistilledModularPipeline": COMPONENTS, "Flux3ModularPipeline": COMPONENTS},
    read_folder=read_folder,
    keywords={"transformer": "a file replacing the denoiser (FLUX 3: in diffusers' names)",
              "vae": "a VAE file replacing the model's"},
    reference="mlxdiff.reference.flux3",
    order=90,
    part_of=part_of,
    preview=previews.FLUX2,   # the FLUX.2 VAE's latents (ComfyUI's latent_rgb_factors, pipelines/previews.py)
)
