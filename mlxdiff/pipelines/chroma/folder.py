"""A Chroma diffusers folder (ChromaPipeline, ChromaImg2ImgPipeline) -> PipelineSources."""

from pathlib import Path

from ...errors import MlxdiffError
from ...formats import tensor_shapes
from ...loading.sources import folder_component, read_scheduler_config, tokenizer_folder, transformer_from_file
from ...loading.spec import PipelineSources
from ...models import chroma
from ...tokenizers import load_tokenizer
from ..family import identify


def check_components(where, specs) -> None:
    """T5's width is what the transformer takes; the transformer takes and gives 4 x the VAE's latent channels."""
    transformer, t5, autoencoder = specs["transformer"].args, specs["text_encoder"].args, specs["vae"].args
    if t5.d_model != transformer.joint_attention_dim:
        raise MlxdiffError(f"{where}: the transformer's joint_attention_dim is {transformer.joint_attention_dim} but "
                           f"the T5 text encoder gives {t5.d_model}; the components do not belong together")
    latent = 4 * autoencoder.latent_channels
    if transformer.in_channels != latent or (transformer.out_channels or latent) != latent:
        raise MlxdiffError(f"{where}: the transformer takes in_channels {transformer.in_channels} but the VAE has "
                           f"{autoencoder.latent_channels} latent channels (expected 4 x, the 2x2 patches); the "
                           "components do not belong together")


def check_is_chroma(path) -> None:
    """A transformer file another family says is its own (FLUX.1's or FLUX.2's BFL names, ...) refused in one line."""
    names = list(tensor_shapes(path))
    if not chroma.is_original(names):
        hint = identify(names, but="chroma")
        if hint is not None:
            raise MlxdiffError(f"{path}: {hint}; this is a Chroma model")


def chroma_folder(root: Path, index, pipeline_class, components, transformer=None) -> PipelineSources:
    specs = {name: folder_component(root, name, components[name], name == "transformer" and transformer is not None)
             for name in ("transformer", "vae", "text_encoder")}
    if transformer is not None:
        check_is_chroma(transformer)
        specs["transformer"] = transformer_from_file(transformer, chroma, specs["transformer"].config,
                                                     root / "transformer" / "config.json")
    check_components(root / "model_index.json", specs)
    tokenizers = {"tokenizer": load_tokenizer(tokenizer_folder(root, "tokenizer"), components["tokenizer"])}
    return PipelineSources("chroma", pipeline_class, specs, tokenizers, read_scheduler_config(root))
