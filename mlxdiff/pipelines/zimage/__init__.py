"""Z-Image (Tongyi-MAI's Z-Image, Z-Image-Turbo): ZImagePipeline folders, text-to-image. The transformer is
models/zimage.py, the VAE FLUX.1's AutoencoderKL, the text encoder Qwen3 through models/text_llm.py."""

from ...models import text_llm
from ..family import Family
from .folder import zimage_folder
from .pipeline import Conditioning, ZImagePipeline  # noqa: F401  (mlxdiff.pipelines.zimage.ZImagePipeline)

COMPONENTS = {"transformer": ("ZImageTransformer2DModel",), "vae": ("AutoencoderKL",),
              "text_encoder": (text_llm.ARCHITECTURES["qwen3"],), "tokenizer": None,
              "scheduler": ("FlowMatchEulerDiscreteScheduler",)}


def read_folder(path, index, pipeline_class, components, request):
    return zimage_folder(path, index, pipeline_class, components, request.transformer)


FAMILY = Family(
    name="zimage", title="Z-Image", article="a", pipeline=ZImagePipeline,
    layouts={"ZImagePipeline": COMPONENTS},
    read_folder=read_folder,
    keywords={"transformer": "a file replacing the denoiser"},
    instead={"text_encoders": "load its ZImagePipeline folder, which has its own Qwen3",
             "text_encoder": "load its ZImagePipeline folder, which has its own Qwen3",
             "vae": "load its ZImagePipeline folder, which has its own VAE",
             "tokenizer": "load its ZImagePipeline folder, which has its own tokenizer"},
    reference="mlxdiff.reference.zimage",
)
