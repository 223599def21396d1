"""Qwen-Image 2.1 (QwenImage21Pipeline folders): text-to-image and generation from condition images (image=). The
transformer is models/qwenimage21.py (single stream, block-causal, the prompt's and condition images' keys / values
cached across steps), the VAE models/vae_qwenimage21.py (Wan 2.2's residual VAE made 2-D, RGBA), the text encoder
Qwen3-VL's language model through models/text_llm.py, its vision tower models/vision_qwen3vl.py (condition images
only). A transformer file (diffusers' or ComfyUI's names, safetensors or GGUF) replaces the folder's with
transformer=; LoRAs in diffusers' / PEFT, ComfyUI's and kohya's names."""

from ...models import qwenimage21
from ..family import Family
from .folder import qwenimage21_folder
from .pipeline import Conditioning, QwenImage21Pipeline  # noqa: F401  (mlxdiff.pipelines.qwenimage21.*)

COMPONENTS = {"transformer": ("QwenImage21Transformer2DModel",), "vae": ("AutoencoderKLQwenImage21",),
              "text_encoder": ("Qwen3VLForConditionalGeneration", "Qwen3VLModel"), "processor": None,
              "scheduler": ("FlowMatchEulerDiscreteScheduler",)}


def read_folder(path, index, pipeline_class, components, request):
    return qwenimage21_folder(path, index, pipeline_class, components, request.transformer)


def part_of(names):
    if qwenimage21.is_original(names):
        return ("a Qwen-Image 2.1 transformer; give it as transformer= with a Qwen-Image 2.1 diffusers folder "
                "(QwenImage21Pipeline) as the model")
    return None


FAMILY = Family(
    name="qwenimage21", title="Qwen-Image 2.1", article="a", pipeline=QwenImage21Pipeline,
    layouts={"QwenImage21Pipeline": COMPONENTS},
    read_folder=read_folder,
    keywords={"transformer": "a file replacing the denoiser"},
    instead={"text_encoder": "its folder has its own Qwen3-VL", "text_encoders": "its folder has its own Qwen3-VL",
             "vae": "its folder has its own VAE", "tokenizer": "its folder has its own processor/ tokenizer"},
    reference="mlxdiff.reference.qwenimage21",
    order=100,
    part_of=part_of,
)
