"""Krea 2 (Krea2Pipeline folders): text-to-image. The transformer is models/krea2.py, the VAE Qwen-Image's
(models/vae_qwenimage.py), the text encoder Qwen3-VL's language model through models/text_llm.py (mlx-lm's Qwen3
layers, the taps and positions Krea2Pipeline uses; models/text_qwen3vl.py). A transformer file (diffusers' or
krea-ai's names, safetensors or GGUF) replaces the folder's with transformer=."""

from ...models import krea2, text_qwen3vl
from .. import previews
from ..family import Family
from .folder import krea2_folder
from .pipeline import Conditioning, Krea2Pipeline  # noqa: F401  (mlxdiff.pipelines.krea2.Krea2Pipeline)

COMPONENTS = {"transformer": ("Krea2Transformer2DModel",), "vae": ("AutoencoderKLQwenImage",),
              "text_encoder": text_qwen3vl.CLASSES, "tokenizer": None,
              "scheduler": ("FlowMatchEulerDiscreteScheduler",)}


def read_folder(path, index, pipeline_class, components, request):
    return krea2_folder(path, index, pipeline_class, components, request.transformer)


def part_of(names):
    if krea2.is_original(names):
        return ("a Krea 2 transformer; give it as transformer= with a Krea 2 diffusers folder (Krea2Pipeline) as the "
                "model")
    return None


FAMILY = Family(
    name="krea2", title="Krea 2", article="a", pipeline=Krea2Pipeline,
    layouts={"Krea2Pipeline": COMPONENTS},
    read_folder=read_folder,
    keywords={"transformer": "a file replacing the denoiser"},
    instead={"text_encoder": "its folder has its own Qwen3-VL; give a transformer file with transformer=",
             "text_encoders": "its folder has its own Qwen3-VL; give a transformer file with transformer=",
             "vae": "its folder has its own VAE", "tokenizer": "its folder has its own tokenizer"},
    reference="mlxdiff.reference.krea2",
    order=40,
    preview=previews.WAN21,   # the Qwen-Image VAE's latents: ComfyUI's latent_rgb_factors (pipelines/previews.py)
    part_of=part_of,
)
