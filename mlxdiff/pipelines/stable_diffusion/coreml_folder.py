"""Apple's Core ML Stable Diffusion folders -> PipelineSources: what apple/ml-stable-diffusion's torch2coreml.py
writes (and Apple's `coreml-stable-diffusion-*` repositories ship): TextEncoder (SDXL: and TextEncoder2), Unet (or
its two halves UnetChunk1 + UnetChunk2), VAEDecoder and VAEEncoder packages, as `Resources/` names them, or with the
converter's own names (`Stable_Diffusion_version_<model>_text_encoder.mlpackage`, ..._unet_chunk1, ...), in the
folder given or its `packages/` subfolder; the tokenizer's vocab.json / merges.txt beside them or in the sibling
`compiled/` / `Resources/` folder (else the bundled CLIP BPE, the one Apple's converter downloads).

The weights are read through formats/coreml.py (palettized ones kept as stored). A folder carries no config: each
model's sizes are read off its weights' shapes, and what shapes cannot give follows the released models, as the
single files' readers do (single_file.py). Apple's UNet makes every projection a 1x1 convolution
(unet.py ignores use_linear_projection), so the proj_in shape that tells SD 1.x from 2.x in a checkpoint says
nothing here; the text encoder's program does: OpenCLIP's gelu (a MIL `gelu` op; CLIP-L's quick_gelu is a sigmoid
and a mul) or a 1024-wide text is SD 2.x (64-wide heads, linear projections), else SD 1.x (CLIP-L, 8 heads a level).
A UNet with the added text-time embedding (`add_embedding`) and a TextEncoder2 is SDXL's (--xl-version: the UNet
takes time_ids and text_embeds; its TextEncoder gives CLIP-L's penultimate hidden states, TextEncoder2 OpenCLIP
bigG's with its projected pool), 64-wide heads, six time ids whose width is what the add_embedding's input leaves
beside the pool, the SDXL VAE's scaling (0.13025, as Apple's Swift CLI sets for --xl), both tokenizers from the one
vocab.json / merges.txt (the second padding with "!", as StableDiffusionXL+Resources.swift does). 32 norm groups.
The scheduler is the Swift pipeline's default (StableDiffusionPipeline.Configuration.schedulerType = .pndmScheduler:
diffusers' PNDM with SD's config), epsilon: Apple's Swift schedulers assume it and its SD 2.x folders are the 512 px
-base models; a v-prediction model's folder (2.0-v / 2.1) takes prediction_type="v_prediction", as a single file
does. The negative prompt is encoded even when empty (Swift's encodePrompt(""); no zeros as SDXL's diffusers folder
uses). What Apple's pipeline may lack is skipped as it skips it (a SafetyChecker is never read); a part the run needs
missing is one line, and so is the SDXL refiner (UnetRefiner*, not read: Swift switches UNets mid-run, which
mlxdiff's pipeline does not). Compiled .mlmodelc bundles are refused in one line (formats/coreml.py says why).
"""

import re
from pathlib import Path

from ...errors import MlxdiffError
from ...formats import TensorShape, coreml
from ...loading.spec import ComponentSpec, PipelineSources
from ...models import clip, unet, vae
from ...tokenizers import bundled_clip_tokenizer
from .folder import check_unet_together
from .single_file import PREDICTIONS, SCHEDULERS, VAE_CONFIGS

# component -> (the Resources name, the converter's `_get_out_path` submodule name)
PARTS = {"text_encoder": ("TextEncoder", "text_encoder"), "unet": ("Unet", "unet"),
         "vae_decoder": ("VAEDecoder", "vae_decoder"), "vae_encoder": ("VAEEncoder", "vae_encoder"),
         "text_encoder_2": ("TextEncoder2", "text_encoder_2")}
MODEL_FILE = "Data/com.apple.CoreML/model.mlmodel"
# the SDXL refiner's packages: Resources names (bundle_resources_for_swift_cli) and the converter's
REFINER = re.compile(r"(?i)(UnetRefiner(Chunk[12])?|.*_refiner(_chunk[12])?)\.mlpackage")


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


def _unet_config(package: Path, shapes: dict, sd2: bool, pooled=None) -> dict:
    """SD 1.x / 2.x / XL's UNet2DConditionModel config off the UNet's shapes (module docstring for what they
    cannot give); `sd2`: the text encoder is OpenCLIP's; `pooled`: SDXL's TextEncoder2 projection width (None for
    SD 1.x / 2.x)."""
    levels = _count(shapes, r"down_blocks_(\d+)_resnets_0_conv1_weight")
    if levels == 0 or "conv_out_weight" not in shapes:
        raise MlxdiffError(f"{package}: no down_blocks.*.resnets or conv_out weights; not an SD UNet package")
    xl = "add_embedding_linear_1_weight" in shapes
    if xl and pooled is None:
        raise MlxdiffError(f"{package}: an SDXL UNet (added text-time embedding) without a TextEncoder2.mlpackage "
                           "beside it; convert the model with torch2coreml.py --xl-version --convert-text-encoder "
                           "(it writes both encoders) or download the folder whole")
    widths = [shapes[f"down_blocks_{i}_resnets_0_conv1_weight"][0] for i in range(levels)]
    attention = [any(n.startswith(f"down_blocks_{i}_attentions_") for n in shapes) for i in range(levels)]
    up_attention = [any(n.startswith(f"up_blocks_{i}_attentions_") for n in shapes) for i in range(levels)]
    depths = [_count(shapes, rf"down_blocks_{i}_attentions_0_transformer_blocks_(\d+)_attn1_to_q_weight") or 1
              for i in range(levels)]
    key = next((n for n in shapes if n.endswith("attn2_to_k_weight")), None)
    if key is None:
        raise MlxdiffError(f"{package}: no cross-attention (attn2.to_k) weights; not an SD UNet package")
    cross = shapes[key][1]
    linear = sd2 or xl or cross == 1024                     # 64-wide heads (SD 2.x, SDXL)
    if linear and any(w % 64 for w, a in zip(widths, attention) if a):
        raise MlxdiffError(f"{package}: the widths {[w for w, a in zip(widths, attention) if a]} of its levels with "
                           "attention are not multiples of 64, the head size of SD 2.x / SDXL UNets")
    config = {
        "sample_size": 64, "in_channels": shapes["conv_in_weight"][1], "out_channels": shapes["conv_out_weight"][0],
        "block_out_channels": widths,
        "layers_per_block": _count(shapes, r"down_blocks_0_resnets_(\d+)_conv1_weight"),
        "down_block_types": ["CrossAttnDownBlock2D" if a else "DownBlock2D" for a in attention],
        "up_block_types": ["CrossAttnUpBlock2D" if a else "UpBlock2D" for a in up_attention],
        "cross_attention_dim": cross,
        "attention_head_dim": [max(1, w // 64) for w in widths] if linear else 8,
        "use_linear_projection": linear,
        "transformer_layers_per_block": depths if len(set(depths)) > 1 else depths[0],
        "norm_num_groups": 32,
    }
    if xl:       # six time ids (sizes and crop), each as wide as what the pool leaves of add_embedding's input
        add_in = shapes["add_embedding_linear_1_weight"][1]
        if add_in <= pooled or (add_in - pooled) % 6:
            raise MlxdiffError(f"{package}: add_embedding takes {add_in} features, which are not TextEncoder2's "
                               f"pool ({pooled}) and six time ids (an SDXL refiner's five are not read)")
        config.update(sample_size=128, addition_embed_type="text_time", addition_time_embed_dim=(add_in - pooled) // 6,
                      projection_class_embeddings_input_dim=add_in)
    return config


def _openclip(package: Path) -> bool:
    """The text encoder computes OpenCLIP's gelu (a MIL gelu op), not CLIP-L's quick_gelu (x * sigmoid(1.702 x))."""
    ops = coreml._guard(package, lambda: coreml.program(package)).ops
    return any(op.type == "gelu" for op in ops)


def _clip_config(package: Path, shapes: dict, gelu: bool, projection=False) -> dict:
    """CLIPTextModel's config off the TextEncoder's shapes (clip.config_from_weights: 64-wide heads), the
    activation the program's (`gelu`: OpenCLIP's); `projection`: CLIPTextModelWithProjection (SDXL's second)."""
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
    if projection:       # beside text_model (transformers' CLIPTextModelWithProjection), so outside its prefix
        found = next((n for n in shapes if n == "text_projection_weight" or n.endswith("_text_projection_weight")),
                     None)
        if found is None:
            raise MlxdiffError(f"{package}: SDXL's second text encoder without its text_projection; not a package "
                               "torch2coreml.py made of CLIPTextModelWithProjection")
        names["text_projection.weight"] = TensorShape(shapes[found][:2])
    try:
        config = clip.config_from_weights({k: v for k, v in names.items() if v})
    except MlxdiffError as e:
        raise MlxdiffError(f"{package}: {e}") from None
    config.update(hidden_act="gelu" if gelu else "quick_gelu",
                  architectures=["CLIPTextModelWithProjection" if projection else "CLIPTextModel"])
    clip.ModelArgs.from_dict(config, f"{package} (config read from its weight shapes)")
    return config


def _vae_config(decoder: Path, shapes: dict, family: str) -> dict:
    """AutoencoderKL's config off the VAEDecoder's shapes, the rest the `family`'s VAE (single_file.VAE_CONFIGS)."""
    levels = _count(shapes, r"decoder_up_blocks_(\d+)_resnets_0_conv1_weight")
    if levels == 0 or "decoder_conv_in_weight" not in shapes:
        raise MlxdiffError(f"{decoder}: no decoder.up_blocks weights; not an SD VAEDecoder package")
    widths = [shapes[f"decoder_up_blocks_{i}_resnets_0_conv1_weight"][0] for i in range(levels)][::-1]
    config = dict(VAE_CONFIGS[family])
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
    """Apple's Core ML folder (module docstring) -> PipelineSources of a StableDiffusionPipeline (SD 1.x / 2.x) or
    a StableDiffusionXLPipeline (SDXL: a TextEncoder2 beside an SDXL UNet)."""
    path = Path(path)
    given = [k for k in request.given() if k != "prediction_type"]
    if given:
        raise MlxdiffError(f"{', '.join(k + '=' for k in given)}: {path} is Apple's Core ML folder, read "
                           "whole; leave these out")
    if request.prediction_type is not None and request.prediction_type not in PREDICTIONS:
        raise MlxdiffError(f"prediction_type is {request.prediction_type!r}; expected one of "
                           + ", ".join(map(repr, PREDICTIONS)))
    folder = packages_folder(path)
    if folder is None:
        raise MlxdiffError(f"{path}: holds compiled Core ML bundles ({', '.join(_compiled(path)[:4])}), which "
                           "mlxdiff does not read; give the folder of the .mlpackage files they were compiled from "
                           "(Apple's repositories ship them beside: packages/)")
    refiner = next((p for p in sorted(folder.iterdir()) if REFINER.fullmatch(p.name)), None)
    if refiner is not None:
        raise MlxdiffError(f"{refiner}: Apple's SDXL refiner UNet is not read (mlxdiff runs one UNet a run); move "
                           "the UnetRefiner packages out of the folder to run the base model alone")
    found = {part: _package(folder, part) for part in PARTS if part != "unet"}
    found["unet"] = _unet_package(folder)
    xl = found["text_encoder_2"] is not None
    parts = ("unet", "text_encoder", "text_encoder_2", "vae_decoder", "vae_encoder") if xl else \
        ("unet", "text_encoder", "vae_decoder", "vae_encoder")
    for part in parts:
        if found[part] is None:
            apple = PARTS[part][0]
            shown = "Unet.mlpackage or UnetChunk1.mlpackage + UnetChunk2.mlpackage" if part == "unet" else \
                f"{apple}.mlpackage"
            why = " (mlxdiff's VAE loads its encoder with its decoder)" if part == "vae_encoder" else \
                " (an SDXL folder with TextEncoder2 only is a refiner's, not read)" if part == "text_encoder" and xl \
                else ""
            raise MlxdiffError(f"{folder}: Apple's Core ML folder without its {shown}{why}; convert the model "
                               "with ml-stable-diffusion's torch2coreml.py (--convert-text-encoder --convert-unet "
                               "--convert-vae-decoder --convert-vae-encoder) or download the folder whole")
    encoders = {}
    for name in ("text_encoder", "text_encoder_2") if xl else ("text_encoder",):   # each one's activation its own
        package = found[name]
        config = _clip_config(package, _shapes(package, "embeddings_token_embedding_weight"), _openclip(package),
                              projection=name == "text_encoder_2")
        encoders[name] = ComponentSpec(name, clip, config, [package])
    pooled = encoders["text_encoder_2"].config["projection_dim"] if xl else None
    openclip = encoders["text_encoder"].config["hidden_act"] == "gelu"
    unet_config = _unet_config(found["unet"], _shapes(found["unet"], "conv_in_weight"), openclip and not xl, pooled)
    family = "sdxl" if xl else "sd2" if unet_config["use_linear_projection"] else "sd1"
    specs = {
        "unet": ComponentSpec("unet", unet, unet_config, [found["unet"]]),
        **encoders,
        # the decoder's package stands for the AutoencoderKL: its VAEEncoder beside it is read with it
        # (formats/coreml.PARTNERS)
        "vae": ComponentSpec("vae", vae, _vae_config(found["vae_decoder"],
                                                     _shapes(found["vae_decoder"], "decoder_conv_in_weight"), family),
                             [found["vae_decoder"]]),
    }
    for spec in specs.values():       # every weight found by name and shape now, none read (one line if not)
        coreml.read_diffusers(spec.files[0], spec.diffusers_targets()["targets"], prefix=None)
    check_unet_together(folder, specs)
    scheduler = dict(SCHEDULERS["sd1"], prediction_type=request.prediction_type or "epsilon")
    tokenizers = {"tokenizer": _tokenizer(path, folder, family == "sd2")}
    if xl:
        tokenizers["tokenizer_2"] = _tokenizer(path, folder, True)       # padding with "!"
    return PipelineSources("sd", "StableDiffusionXLPipeline" if xl else "StableDiffusionPipeline", specs, tokenizers,
                           scheduler, {"force_zeros_for_empty_prompt": False})
