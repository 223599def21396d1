"""Apple's Core ML Stable Diffusion folders -> PipelineSources: what apple/ml-stable-diffusion's torch2coreml.py
writes (and Apple's `coreml-stable-diffusion-*` repositories ship): TextEncoder, Unet (or its two halves
UnetChunk1 + UnetChunk2), VAEDecoder and VAEEncoder packages, as `Resources/` names them, or with the converter's
own names (`Stable_Diffusion_version_<model>_text_encoder.mlpackage`, ..._unet_chunk1, ...), in the folder given
or its `packages/` subfolder; the tokenizer's vocab.json / merges.txt beside them or in the sibling `compiled/` /
`Resources/` folder (else the bundled CLIP BPE, the one Apple's converter downloads).

The weights are read through formats/coreml.py (palettized ones kept as stored). A folder carries no config: each
model's sizes are read off its weights' shapes, and what shapes cannot give follows the released models, as the
single files' readers do (single_file.py): SD 1.x (CLIP-L, quick_gelu, 8 heads a level, convolution projections)
unless the UNet attends over 1024-wide text (SD 2.x base: OpenCLIP-H's gelu, 64-wide heads, linear projections),
32 norm groups, the SD VAE's scaling. The scheduler is the Swift pipeline's default (StableDiffusionPipeline
.Configuration.schedulerType = .pndmScheduler: diffusers' PNDM with SD's config, epsilon). What Apple's pipeline
may lack is skipped as it skips it (a SafetyChecker is never read); a part the run needs missing is one line.
Compiled .mlmodelc bundles are refused in one line (formats/coreml.py says why).
"""

import re
from pathlib import Path

from ...errors import MlxdiffError
from ...formats import TensorShape, coreml
from ...loading.spec import ComponentSpec, PipelineSources
from ...models import clip, unet, vae
from ...tokenizers import bundled_clip_tokenizer
from .folder import check_unet_together
from .single_file import SCHEDULERS, VAE_CONFIGS

# component -> (the Resources name, the converter's `_get_out_path` submodule name)
PARTS = {"text_encoder": ("TextEncoder", "text_encoder"), "unet": ("Unet", "unet"),
         "vae_decoder": ("VAEDecoder", "vae_decoder"), "vae_encoder": ("VAEEncoder", "vae_encoder"),
         "text_encoder_2": ("TextEncoder2", "text_encoder_2")}
MODEL_FILE = "Data/com.apple.CoreML/model.mlmodel"
NOT_YET = "SDXL"


def _package(folder: Path, part: str):
    """The package of `part` (PARTS) in `folder`, by Apple's name or the converter's; None when absent."""
    apple, converter = PARTS[part]
    found = [p for p in sorted(folder.glob("*.mlpackage"))
             if p.name[:-len(".mlpackage")] == apple or p.name[:-len(".mlpackage")].endswith("_" + converter)]
    if len(found) > 1:
        raise MlxdiffError(f"{folder}: holds {len(found)} {apple} packages ({', '.join(p.name for p in found)}); "
                           "keep one model's packages in a folder")
    return found[0] if found else None


def _unet_package(folder: Path):
    """The UNet: Unet.mlpackage, or the first of its chunks (formats/coreml reads both), or None."""
    whole = _package(folder, "unet")
    if whole is not None:
        return whole
    for stem in ["Unet"] + sorted({m.group(1) for p in folder.iterdir()
                                   if (m := coreml.CHUNK.fullmatch(p.name)) and m.group(1).endswith("_unet")}):
        first = coreml.chunked_unet(folder, stem)
        if first is not None:
            return first
    return None


def packages_folder(path: Path):
    """The folder of Apple's packages that `path` names (itself or its packages/ subfolder), or None."""
    for folder in (path, path / "packages"):
        try:
            if folder.is_dir() and (_package(folder, "text_encoder") or _unet_package(folder)):
                return folder
        except (OSError, MlxdiffError):
            return folder                                  # Apple's, but wrong: read_apple_folder says how
    return None


def _compiled(path: Path) -> list:
    return sorted(p.name for f in (path, path / "compiled", path / "Resources") if f.is_dir()
                  for p in f.glob("*.mlmodelc"))


def claims_folder(path) -> bool:
    """A folder without model_index.json holding Apple's Core ML packages (or only compiled bundles of them)."""
    path = Path(path)
    if path.suffix in (".mlpackage", ".mlmodelc") or (path / "model_index.json").exists() or \
            (path / "modular_model_index.json").exists():     # a package itself is not Apple's folder
        return False
    return packages_folder(path) is not None or bool(_compiled(path))


def _shapes(package: Path, anchor: str) -> dict:
    """{weight name without the traced wrapper's prefix and coremltools' suffixes: shape} of one package's own
    program, the prefix being what comes before `anchor` (a name every such model has)."""
    names = {coreml._base(k): tuple(v.shape) for k, v in
             coreml._guard(package, lambda: coreml.program(package)).weights().items()}
    prefix = next((n[:-len(anchor)] for n in names if n.endswith(anchor)), None)
    if prefix is None:
        raise MlxdiffError(f"{package}: no {anchor} weight; not a package Apple's converter made of this part of "
                           "an SD model")
    return {n[len(prefix):] if n.startswith(prefix) else n: s for n, s in names.items()}


def _count(shapes: dict, pattern: str) -> int:
    return len({m.group(1) for n in shapes if (m := re.fullmatch(pattern, n))})


def _unet_config(package: Path, shapes: dict) -> dict:
    """SD 1.x / 2.x's UNet2DConditionModel config off the UNet's shapes (module docstring for what they cannot
    give)."""
    levels = _count(shapes, r"down_blocks_(\d+)_resnets_0_conv1_weight")
    if levels == 0 or "conv_out_weight" not in shapes:
        raise MlxdiffError(f"{package}: no down_blocks.*.resnets or conv_out weights; not an SD UNet package")
    if any(n.startswith("add_embedding_") for n in shapes):
        raise MlxdiffError(f"{package}: an {NOT_YET} UNet (added text-time embedding); Apple's {NOT_YET} folders "
                           "are not read yet: give the model's diffusers folder or single file")
    widths = [shapes[f"down_blocks_{i}_resnets_0_conv1_weight"][0] for i in range(levels)]
    attention = [any(n.startswith(f"down_blocks_{i}_attentions_") for n in shapes) for i in range(levels)]
    up_attention = [any(n.startswith(f"up_blocks_{i}_attentions_") for n in shapes) for i in range(levels)]
    depths = [_count(shapes, rf"down_blocks_{i}_attentions_0_transformer_blocks_(\d+)_attn1_to_q_weight") or 1
              for i in range(levels)]
    key = next((n for n in shapes if n.endswith("attn2_to_k_weight")), None)
    if key is None:
        raise MlxdiffError(f"{package}: no cross-attention (attn2.to_k) weights; not an SD UNet package")
    cross = shapes[key][1]
    sd2 = cross == 1024                                     # OpenCLIP-H's width: SD 2.x
    return {
        "sample_size": 64, "in_channels": shapes["conv_in_weight"][1], "out_channels": shapes["conv_out_weight"][0],
        "block_out_channels": widths,
        "layers_per_block": _count(shapes, r"down_blocks_0_resnets_(\d+)_conv1_weight"),
        "down_block_types": ["CrossAttnDownBlock2D" if a else "DownBlock2D" for a in attention],
        "up_block_types": ["CrossAttnUpBlock2D" if a else "UpBlock2D" for a in up_attention],
        "cross_attention_dim": cross,
        "attention_head_dim": [max(1, w // 64) for w in widths] if sd2 else 8,
        "use_linear_projection": sd2,
        "transformer_layers_per_block": depths if len(set(depths)) > 1 else depths[0],
        "norm_num_groups": 32,
    }


def _clip_config(package: Path, shapes: dict, sd2: bool) -> dict:
    """CLIPTextModel's config off the TextEncoder's shapes (clip.config_from_weights: 64-wide heads), the
    activation the released model's."""
    def shape_of(name):
        return TensorShape(shapes[name]) if name in shapes else None
    layers = _count(shapes, r"(?:text_model_)?encoder_layers_(\d+)_self_attn_q_proj_weight")
    lead = "text_model_" if any(n.startswith("text_model_") for n in shapes) else ""
    positions = shapes.get(f"{lead}embeddings_position_embedding_weight") or shapes.get("position_embeddings", ())[1:]
    names = {"text_model.embeddings.token_embedding.weight": shape_of(f"{lead}embeddings_token_embedding_weight"),
             "text_model.embeddings.position_embedding.weight": positions and TensorShape(positions),
             "text_model.encoder.layers.0.mlp.fc1.weight": shape_of(f"{lead}encoder_layers_0_mlp_fc1_weight"),
             **{f"text_model.encoder.layers.{i}.self_attn.q_proj.weight": TensorShape((1, 1))
                for i in range(layers)}}
    try:
        config = clip.config_from_weights({k: v for k, v in names.items() if v})
    except MlxdiffError as e:
        raise MlxdiffError(f"{package}: {e}") from None
    config.update(hidden_act="gelu" if sd2 else "quick_gelu", architectures=["CLIPTextModel"])
    clip.ModelArgs.from_dict(config, f"{package} (config read from its weight shapes)")
    return config


def _vae_config(decoder: Path, shapes: dict) -> dict:
    """AutoencoderKL's config off the VAEDecoder's shapes, the rest SD's VAE (single_file.VAE_CONFIGS)."""
    levels = _count(shapes, r"decoder_up_blocks_(\d+)_resnets_0_conv1_weight")
    if levels == 0 or "decoder_conv_in_weight" not in shapes:
        raise MlxdiffError(f"{decoder}: no decoder.up_blocks weights; not an SD VAEDecoder package")
    widths = [shapes[f"decoder_up_blocks_{i}_resnets_0_conv1_weight"][0] for i in range(levels)][::-1]
    config = dict(VAE_CONFIGS["sd1"])
    config.update(block_out_channels=widths, latent_channels=shapes["decoder_conv_in_weight"][1],
                  layers_per_block=_count(shapes, r"decoder_up_blocks_0_resnets_(\d+)_conv1_weight") - 1,
                  down_block_types=["DownEncoderBlock2D"] * levels, up_block_types=["UpDecoderBlock2D"] * levels)
    vae.ModelArgs.from_dict(config, f"{decoder} (config read from its weight shapes)")
    return config


def _tokenizer(path: Path, folder: Path, sd2: bool):
    """CLIP's BPE from vocab.json + merges.txt beside the packages, in compiled/ or Resources/ beside them, or in
    the folder given; else the bundled one (the same BPE: Apple's converter downloads CLIP's)."""
    pad = "!" if sd2 else "<|endoftext|>"                  # as SD 2.x's / SD 1.x's tokenizers pad
    for where in (folder, folder.parent / "compiled", folder.parent / "Resources", path, path / "compiled",
                  path / "Resources"):
        if (where / "vocab.json").is_file() or (where / "merges.txt").is_file():
            return _bpe(where, pad)
    return bundled_clip_tokenizer(pad)


def _bpe(where: Path, pad: str):
    from transformers import CLIPTokenizer  # heavy: transformers (about 0.7 s, torch with it)
    for name in ("vocab.json", "merges.txt"):
        if not (where / name).is_file():
            raise MlxdiffError(f"{where / name}: missing beside the tokenizer's other file; Apple's folders hold "
                               "vocab.json and merges.txt together, copy both")
    try:
        return CLIPTokenizer(str(where / "vocab.json"), str(where / "merges.txt"), model_max_length=77,
                             pad_token=pad)
    except Exception as e:  # the user's files: transformers raises whatever it meets
        detail = (str(e).splitlines() or [""])[0][:200]
        raise MlxdiffError(f"{where}: cannot load the tokenizer from vocab.json / merges.txt ({type(e).__name__}: "
                           f"{detail})") from None


def read_apple_folder(path, request) -> PipelineSources:
    """Apple's Core ML folder (module docstring) -> PipelineSources of a StableDiffusionPipeline."""
    path = Path(path)
    if request.given():
        raise MlxdiffError(f"{', '.join(k + '=' for k in request.given())}: {path} is Apple's Core ML folder, read "
                           "whole; leave these out")
    folder = packages_folder(path)
    if folder is None:
        raise MlxdiffError(f"{path}: holds compiled Core ML bundles ({', '.join(_compiled(path)[:4])}), which "
                           "mlxdiff does not read; give the folder of the .mlpackage files they were compiled from "
                           "(Apple's repositories ship them beside: packages/)")
    found = {part: _package(folder, part) for part in PARTS if part != "unet"}
    found["unet"] = _unet_package(folder)
    if found["text_encoder_2"] is not None:
        raise MlxdiffError(f"{found['text_encoder_2']}: a second text encoder: Apple's {NOT_YET} folders are not "
                           f"read yet; give the {NOT_YET} model's diffusers folder or single file")
    for part in ("unet", "text_encoder", "vae_decoder", "vae_encoder"):
        if found[part] is None:
            apple = PARTS[part][0]
            shown = "Unet.mlpackage or UnetChunk1.mlpackage + UnetChunk2.mlpackage" if part == "unet" else \
                f"{apple}.mlpackage"
            why = " (mlxdiff's VAE loads its encoder with its decoder)" if part == "vae_encoder" else ""
            raise MlxdiffError(f"{folder}: Apple's Core ML folder without its {shown}{why}; convert the model "
                               "with ml-stable-diffusion's torch2coreml.py (--convert-text-encoder --convert-unet "
                               "--convert-vae-decoder --convert-vae-encoder) or download the folder whole")
    unet_shapes = _shapes(found["unet"], "conv_in_weight")
    unet_config = _unet_config(found["unet"], unet_shapes)
    sd2 = unet_config["use_linear_projection"]
    text_shapes = _shapes(found["text_encoder"], "embeddings_token_embedding_weight")
    specs = {
        "unet": ComponentSpec("unet", unet, unet_config, [found["unet"]]),
        "text_encoder": ComponentSpec("text_encoder", clip, _clip_config(found["text_encoder"], text_shapes, sd2),
                                      [found["text_encoder"]]),
        # the decoder's package stands for the AutoencoderKL: its VAEEncoder beside it is read with it
        # (formats/coreml.PARTNERS)
        "vae": ComponentSpec("vae", vae, _vae_config(found["vae_decoder"],
                                                     _shapes(found["vae_decoder"], "decoder_conv_in_weight")),
                             [found["vae_decoder"]]),
    }
    for spec in specs.values():       # every weight found by name and shape now, none read (one line if not)
        coreml.read_diffusers(spec.files[0], spec.diffusers_targets()["targets"], prefix=None)
    check_unet_together(folder, specs)
    scheduler = dict(SCHEDULERS["sd1"], prediction_type="epsilon")
    return PipelineSources("sd", "StableDiffusionPipeline", specs, {"tokenizer": _tokenizer(path, folder, sd2)},
                           scheduler, {"force_zeros_for_empty_prompt": False})
