"""What a user names -> component specs: where each component's bytes are, its config and its key mapping.

Accepted: a diffusers pipeline folder (model_index.json), a hub id found in the local Hugging Face cache, or an
original single file (SD3.5: single_file.py); resolve.py picks which. A FLUX.2 text encoder may be one file
(text_encoder_from_file) in place of the folder's text_encoder/. Each reader returns a PipelineSources: the
family, one ComponentSpec per model component (LLM text encoders included), tokenizers, scheduler config and
folder options (both defined in spec.py, with the architecture registry ARCHITECTURES).
A spec holds no weights; `spec.build()` maps them lazily when a phase needs the model.
"""

import json
import math
import os
import stat
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from ..config_checks import (MAX_IMAGE_SIZE, MAX_LAYERS, MAX_POSITIONS, MAX_PROMPT_TOKENS, CheckedArgs, Limit, Rule,
                             between, json_type, one_of, positive, show)
from ..errors import MlxdiffError
from ..formats import PACKAGE_WHATS, check_weight_file, is_coreml, is_gguf, safetensors as st, tensor_shapes
from ..formats.keymaps import remap
from ..models import flux2, mmdit, text_llm, vae, vae_flux2
from .spec import ARCHITECTURES, ComponentSpec, PipelineSources   # also reached as sources.ComponentSpec

# diffusers' text_encoder_out_layers defaults per pipeline
FLUX2_TAPS = {"Flux2Pipeline": (10, 20, 30), "Flux2KleinPipeline": (9, 18, 27)}
# model_index.json `_class_name` -> pipeline family
PIPELINE_FAMILIES = {
    "StableDiffusion3Pipeline": "sd3",
    "Flux2Pipeline": "flux2",
    "Flux2KleinPipeline": "flux2",
    "StableDiffusionPipeline": "sd",          # SD 1.x / 2.x
    "StableDiffusionXLPipeline": "sd",
}
# pipeline classes whose components differ from their family's (COMPONENTS' key)
LAYOUTS = {"StableDiffusionXLPipeline": "sdxl"}
# model_index.json per family: component -> the classes its ["library", "class"] entry may name (None: any class;
# the folder's own files decide, as for tokenizers). OPTIONAL components may be [null, null].
CLIP = ("CLIPTextModelWithProjection",)
SCHEDULER = ("FlowMatchEulerDiscreteScheduler",)
# the UNet family's scheduler classes -> the sampler a folder runs by default (ldm_schedulers.SCHEDULERS)
LDM_SCHEDULERS = {"PNDMScheduler": "pndm", "EulerDiscreteScheduler": "euler",
                  "EulerAncestralDiscreteScheduler": "euler_a", "DDIMScheduler": "ddim",
                  "DPMSolverMultistepScheduler": "dpmpp_2m"}
COMPONENTS = {
    "sd3": {"transformer": ("SD3Transformer2DModel",), "vae": ("AutoencoderKL",), "text_encoder": CLIP,
            "text_encoder_2": CLIP, "text_encoder_3": ("T5EncoderModel",), "tokenizer": None, "tokenizer_2": None,
            "tokenizer_3": None, "scheduler": SCHEDULER},
    "flux2": {"transformer": ("Flux2Transformer2DModel",), "vae": ("AutoencoderKLFlux2",),
              "text_encoder": tuple(text_llm.ARCHITECTURES.values()), "tokenizer": None, "scheduler": SCHEDULER},
    "sd": {"unet": ("UNet2DConditionModel",), "vae": ("AutoencoderKL",), "text_encoder": ("CLIPTextModel",),
           "tokenizer": None, "scheduler": tuple(LDM_SCHEDULERS)},
    "sdxl": {"unet": ("UNet2DConditionModel",), "vae": ("AutoencoderKL",), "text_encoder": ("CLIPTextModel",),
             "text_encoder_2": CLIP, "tokenizer": None, "tokenizer_2": None, "scheduler": tuple(LDM_SCHEDULERS)},
}
OPTIONAL = {"text_encoder_3", "tokenizer_3"}   # SD3.5 without T5 (diffusers then uses zeros for its part)
MAX_CONFIG_BYTES = 16 << 20   # config.json, model_index.json, scheduler_config.json: real ones are a few KB


@dataclass
class Flux2FolderOptions(CheckedArgs):
    """model_index.json keys mlxdiff reads beside the components (diffusers ignores them): a small model's defaults
    (klein-shapes: 64x64 images, 64-token prompts, its own taps)."""
    is_distilled: bool = False
    sample_size: int | None = None                      # default image size in pixels
    max_sequence_length: int = 512
    text_encoder_out_layers: tuple[int, ...] | None = None

    WHAT = "model_index.json"
    LIMITS = {
        "sample_size": between(1, MAX_IMAGE_SIZE),
        "max_sequence_length": between(1, MAX_PROMPT_TOKENS),
        "text_encoder_out_layers": between(0, MAX_LAYERS, items=(1, 16)),
    }


def model_module(class_name, where):
    try:
        return ARCHITECTURES[class_name]
    except KeyError:
        raise MlxdiffError(f"{where}: unsupported component class {class_name!r}; supported: "
                           + ", ".join(sorted(ARCHITECTURES))) from None


def transformer_from_file(path, arch, base_config=None, base_where=None) -> ComponentSpec:
    """A denoiser given as one file (safetensors or GGUF) with original (SAI / BFL) names, with or without the
    `model.diffusion_model.` prefix, or with diffusers names. The config comes from the file's shapes
    (arch.config_from_original), plus the few values shapes cannot give (arch.FROM_BASE_CONFIG) from the pipeline
    folder's transformer config (`base_where` names it); diffusers-named files need that folder config."""
    if is_coreml(path):   # a Core ML package (formats/coreml.py): an SD UNet converted by coremltools
        from .spec import coreml_component
        return coreml_component(check_weight_file(path, "transformer file"), arch, base_config, base_where)
    path = check_weight_file(not_a_folder(path, "transformer file"), "transformer file")
    shapes = tensor_shapes(path)
    prefix = arch.ORIGINAL_PREFIX if any(n.startswith(arch.ORIGINAL_PREFIX) for n in shapes) else ""
    if arch.is_original(list(shapes)):
        try:
            config = arch.config_from_original({k[len(prefix):]: v for k, v in shapes.items()
                                                if k.startswith(prefix)})
        except MlxdiffError as e:   # the inference knows tensors, not files
            raise MlxdiffError(f"{path}: {e}") from None
        arch.ModelArgs.from_dict(config, f"{path} (config read from its tensor shapes)")
        base = {key: base_config[key] for key in arch.FROM_BASE_CONFIG if base_config and key in base_config}
        if base:
            try:
                arch.ModelArgs.from_dict({**config, **base}, base_where or "the pipeline folder's config")
            except MlxdiffError as e:
                raise MlxdiffError(f"{path}: this file does not fit the model folder's transformer ({e})") from None
        return ComponentSpec("transformer", arch, {**config, **base}, [path], prefix, arch.original_to_diffusers)
    if base_config is None:
        raise MlxdiffError(f"{path}: a diffusers-named transformer file needs its config.json; load the pipeline "
                           "folder and pass this file as transformer=")
    return ComponentSpec("transformer", arch, dict(base_config), [path], prefix)


def text_encoder_from_file(path, taps, base_config=None, base_where=None, explicit_taps=False,
                          expected=None) -> ComponentSpec:
    """A FLUX.2 text encoder given as one file (text_encoder=FILE): safetensors in transformers or ComfyUI names
    (pruned or whole), or a llama.cpp GGUF (kept quantized; llama-arch q/k rows put back in order). The config comes
    from the file's shapes (text_llm.config_from_file), with what shapes cannot give from the GGUF metadata, the
    folder's text_encoder/config.json (`base_config`, read from `base_where`) or the known models' values; checked
    against `taps` here, before anything is read."""
    path = check_weight_file(not_a_folder(path, "text encoder file"), "text encoder file")
    shapes = tensor_shapes(path)
    metadata = None   # a GGUF's metadata: its hyperparameters, read typed and bounded by text_llm.gguf_values
    if is_gguf(path):
        from ..formats.gguf import check_gguf
        metadata = check_gguf(path).metadata
    try:
        config = text_llm.config_from_file(shapes, metadata, base_config, expected)
    except MlxdiffError as e:   # the inference knows tensors, not files
        raise MlxdiffError(f"{path}: {e}") from None
    config["taps"] = list(taps)
    where = f"{path} (config read from its tensor shapes" + (f" and {base_where})" if base_config else ")")
    text_llm.check_config(config, where, taps=False)
    args = text_llm.ModelArgs.from_dict(config, where)
    # the taps are checked now when they are the folder's own or fit the model; a small model tapped per call
    # (text_encoder_out_layers=) is checked with those taps when it is built, as a folder's encoder is
    if explicit_taps or args.depth <= args.num_layers:
        text_llm.check_args(args, path)
    keymap = None
    if metadata is not None and text_llm.gguf_is_permuted(metadata, config):
        text = text_llm.ModelArgs.from_dict(config).text_config
        keymap = partial(text_llm.gguf_unpermute, heads=text["num_attention_heads"],
                         kv_heads=text["num_key_value_heads"])
    return ComponentSpec("text_encoder", text_llm, config, [path], keymap=keymap)


def not_a_folder(path, what) -> Path:
    """A path given as a file must not be a folder (check_weight_file would only say "not found")."""
    path = Path(path)
    if path.is_dir() and not (is_coreml(path) and what in PACKAGE_WHATS):   # a Core ML package is a folder
        raise MlxdiffError(f"{path}: is a folder; the {what} must be one .safetensors or .gguf file")
    return path


def read_json(path, what, root=None) -> dict:
    """A JSON object from `path` (inside the model folder `root`, when given): a regular file (a FIFO or a device is
    refused before it is opened: files.read_capped) of at most MAX_CONFIG_BYTES."""
    from ..files import read_capped
    if root is not None:
        inside(root, path, what)
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise MlxdiffError(f"{path}: {what} is missing; the model folder is incomplete") from None
    except OSError as e:
        raise MlxdiffError(f"{path}: cannot read {what} ({e.strerror or e})") from None
    if stat.S_ISDIR(info.st_mode):
        raise MlxdiffError(f"{path}: {what} is a folder, not a file; the model folder is broken")
    if stat.S_ISREG(info.st_mode) and info.st_size > MAX_CONFIG_BYTES:
        raise MlxdiffError(f"{path}: {what} is {info.st_size} bytes; a config is a few KB (at most "
                           f"{MAX_CONFIG_BYTES})")
    data = read_capped(path, MAX_CONFIG_BYTES, f"{path}: {what}", "a config is a few KB")
    try:
        value = json.loads(data.decode("utf-8"))
    except RecursionError:
        raise MlxdiffError(f"{path}: cannot read {what} (nested too deeply)") from None
    except ValueError as e:   # UnicodeDecodeError included
        raise MlxdiffError(f"{path}: cannot read {what} ({str(e).splitlines()[0][:200]})") from None
    if not isinstance(value, dict):
        raise MlxdiffError(f"{path}: {what} is {json_type(value)}; expected a JSON object ({{\"key\": value, ...}})")
    return value


def model_base(root) -> Path:
    """Where the paths of a model folder may lead: the folder itself, resolved; for a snapshot in the Hugging Face
    cache, its repo folder (the snapshot's files are links into ../../blobs)."""
    root = Path(root).resolve()
    if root.parent.name == "snapshots" and (root.parent.parent / "blobs").is_dir():
        return root.parent.parent
    return root


def inside(root, path, what) -> Path:
    """`path`, which the model folder `root` names, resolved (symlinks included) must stay inside it; checked
    before anything is opened. Returns `path` as given."""
    base, resolved = model_base(root), Path(path).resolve()
    if resolved != base and base not in resolved.parents:
        raise MlxdiffError(f"{path}: {what} leads outside the model folder (to {resolved}); every file of a model "
                           f"must be inside {base}")
    return Path(path)


def files_inside(root, files, what) -> list:
    return [inside(root, f, what) for f in files]


def folder_component(root: Path, name: str, class_name: str, replaced=False) -> ComponentSpec:
    """A component sub-folder: config.json (checked against the model's ModelArgs) + safetensors, sharded or not.
    `replaced`: a file given by the user replaces the weights, so the folder may hold only the config."""
    folder = inside(root, root / name, f"component folder {name!r}")
    if not folder.is_dir():
        raise MlxdiffError(f"{folder}: component folder {name!r} named in model_index.json is missing")
    arch = model_module(class_name, folder)
    config_path = folder / "config.json"
    config = read_json(config_path, f"the {name} config", root)
    arch.ModelArgs.from_dict(config, config_path)
    if replaced and not any(folder.glob("*.safetensors")):
        return ComponentSpec(name, arch, config, [])
    return ComponentSpec(name, arch, config, files_inside(root, st.safetensors_files(folder), f"a {name} weight file"))


def text_encoder_spec(folder, taps, root=None) -> ComponentSpec:
    """A FLUX.2 LLM text encoder folder (diffusers' `text_encoder/` or an mlx-lm converted one; the config says
    Mistral3 or Qwen3), read up to the deepest of `taps`; inside the model folder `root` when given."""
    folder = Path(folder)
    root = folder if root is None else root
    inside(root, folder, "the text encoder folder")
    if not folder.is_dir():
        raise MlxdiffError(f"{folder}: text encoder folder is missing")
    config_path = folder / "config.json"
    config = {**read_json(config_path, "the text encoder config", root), "taps": list(taps)}
    text_llm.check_config(config, config_path, taps=False)
    return ComponentSpec(folder.name, text_llm, config,
                         files_inside(root, st.safetensors_files(folder), "a text encoder weight file"))


def tokenizer_folder(root, name) -> Path:
    """A tokenizer folder of the model and every file in it, inside the model folder (transformers opens them)."""
    folder = inside(root, root / name, f"tokenizer folder {name!r}")
    if folder.is_dir():
        files_inside(root, sorted(folder.iterdir()), f"a file of tokenizer folder {name!r}")
    return folder


def find_in_hf_cache(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError
    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except (LocalEntryNotFoundError, OSError, ValueError):
        raise MlxdiffError(f"{repo_id!r} is neither a local path nor a model in the local Hugging Face cache; "
                           "download it first (huggingface-cli download) or pass a folder/file path") from None


def resolve_path(model) -> Path:
    path = Path(model).expanduser()
    if path.exists():
        return path
    if isinstance(model, str) and model.count("/") == 1 and not model.startswith((".", "/", "~")):
        return find_in_hf_cache(model)
    raise MlxdiffError(f"{model}: no such file or folder")


def _entry_class(where, name, entry, optional):
    """A component entry ["library", "class"] -> the class name; None for an optional component set to null."""
    if optional and (entry is None or entry == [None, None]):
        return None
    if entry is None or entry == [None, None]:
        raise MlxdiffError(f"{where}: component {name!r} is missing (null); this pipeline needs it")
    if not (isinstance(entry, list) and len(entry) == 2 and all(isinstance(x, str) for x in entry)):
        raise MlxdiffError(f"{where}: component {name!r} is {show(entry)}; expected [\"library\", \"ClassName\"], "
                           'e.g. ["diffusers", "AutoencoderKL"]')
    return entry[1]


def read_pipeline_folder(root: Path):
    """model_index.json, checked -> (the whole index, pipeline class name, {component: class name or None}): the
    pipeline class is one we run, and each component the family needs is a ["library", "class"] entry naming a
    class that component may be."""
    where = root / "model_index.json"
    index = read_json(where, "model_index.json", root)
    pipeline_class = index.get("_class_name")
    if not isinstance(pipeline_class, str) or pipeline_class not in PIPELINE_FAMILIES:
        raise MlxdiffError(f"{where}: _class_name is {show(pipeline_class)}; expected one of "
                           + ", ".join(sorted(PIPELINE_FAMILIES)))
    components = {}
    layout = COMPONENTS[LAYOUTS.get(pipeline_class, PIPELINE_FAMILIES[pipeline_class])]
    for name, allowed in layout.items():
        if name not in index and name not in OPTIONAL:
            raise MlxdiffError(f"{where}: component {name!r} is missing; a {pipeline_class} needs "
                               + ", ".join(layout))
        cls = _entry_class(where, name, index.get(name), name in OPTIONAL)
        if cls is not None and allowed is not None and cls not in allowed:
            raise MlxdiffError(f"{where}: component {name!r} names class {cls!r}; a {pipeline_class}'s {name} is "
                               + " or ".join(allowed))
        components[name] = cls
    return index, pipeline_class, components


@dataclass
class SchedulerArgs(CheckedArgs):
    """scheduler_config.json: the FlowMatchEulerDiscreteScheduler keys mlxdiff's sampler reads (schedulers.py, which
    refuses the options it does not implement), typed as diffusers' __init__ has them."""
    num_train_timesteps: int = 1000
    shift: float = 1.0
    use_dynamic_shifting: bool = False
    base_shift: float | None = 0.5
    max_shift: float | None = 1.15
    base_image_seq_len: int | None = 256
    max_image_seq_len: int | None = 4096
    invert_sigmas: bool = False
    shift_terminal: float | None = None
    use_karras_sigmas: bool = False
    use_exponential_sigmas: bool = False
    use_beta_sigmas: bool = False
    time_shift_type: str = "exponential"
    stochastic_sampling: bool = False

    WHAT = "scheduler_config.json"
    LIMITS = {
        "num_train_timesteps": between(1, 100000),
        "shift": positive(1e4),
        "base_shift": between(-1e4, 1e4),
        "max_shift": between(-1e4, 1e4),
        "base_image_seq_len": between(1, MAX_POSITIONS),
        "max_image_seq_len": between(1, MAX_POSITIONS),
        "shift_terminal": Limit(gt=0, hi=0.999),        # sigmas are divided by 1 - shift_terminal
        "time_shift_type": one_of("exponential", "linear"),
    }
    RULES = (
        Rule("max_image_seq_len", lambda a: not a.use_dynamic_shifting or None not in (
             a.base_shift, a.max_shift, a.base_image_seq_len) and (a.max_image_seq_len or 0) > a.base_image_seq_len,
             lambda a: "with use_dynamic_shifting: base_shift, max_shift and base_image_seq_len given, and "
                       "max_image_seq_len above base_image_seq_len"),
    )


@dataclass
class LdmSchedulerArgs(CheckedArgs):
    """scheduler_config.json of the UNet family: the keys ldm_schedulers reads, typed (it refuses the settings it
    does not implement)."""
    num_train_timesteps: int = 1000
    beta_start: float = 0.0001
    beta_end: float = 0.02
    beta_schedule: str = "linear"
    prediction_type: str = "epsilon"
    timestep_spacing: str = "linspace"
    steps_offset: int = 0
    use_karras_sigmas: bool = False
    clip_sample: bool = True
    clip_sample_range: float = 1.0
    set_alpha_to_one: bool = True
    skip_prk_steps: bool = False
    sigma_min: float | None = None
    sigma_max: float | None = None

    WHAT = "scheduler_config.json"
    LIMITS = {
        "num_train_timesteps": between(2, 100000),
        "beta_start": Limit(gt=0, hi=0.999),
        "beta_end": Limit(gt=0, hi=0.999),
        "steps_offset": between(0, 100000),
        "clip_sample_range": positive(1e4),
        "sigma_min": positive(1e4),
        "sigma_max": positive(1e4),
    }


def read_scheduler_config(root, family="flow") -> dict:
    where = inside(root, root / "scheduler", "the scheduler folder") / "scheduler_config.json"
    config = read_json(where, "the scheduler config", root)
    (LdmSchedulerArgs if family == "sd" else SchedulerArgs).from_dict(config, where)
    return config


def sd_folder(root: Path, index, pipeline_class, components, unet=None) -> PipelineSources:
    """A StableDiffusionPipeline (SD 1.x / 2.x) or StableDiffusionXLPipeline folder; `unet`: a file replacing the
    UNet (original or diffusers names). The scheduler's class is the default sampler (LDM_SCHEDULERS)."""
    from ..models import unet as unet_arch
    from ..tokenizers import load_tokenizer
    xl = pipeline_class == "StableDiffusionXLPipeline"
    encoders = ("text_encoder", "text_encoder_2") if xl else ("text_encoder",)
    specs = {name: folder_component(root, name, components[name], name == "unet" and unet is not None)
             for name in ("unet", "vae", *encoders)}
    for name in encoders:   # the folder's class says whether the encoder has a projection
        specs[name].config["architectures"] = [components[name]]
    if unet is not None:
        specs["unet"] = transformer_from_file(unet, unet_arch, specs["unet"].config, root / "unet" / "config.json")
        specs["unet"].name = "unet"
    check_unet_together(root, specs)
    tokenizers = {name: load_tokenizer(tokenizer_folder(root, name), components[name])
                  for name in (("tokenizer", "tokenizer_2") if xl else ("tokenizer",))}
    scheduler = dict(read_scheduler_config(root, "sd"), _class_name=components["scheduler"])
    force_zeros = index.get("force_zeros_for_empty_prompt", xl)
    if not isinstance(force_zeros, bool):
        raise MlxdiffError(f"{root / 'model_index.json'}: force_zeros_for_empty_prompt is {show(force_zeros)}; "
                           "expected true or false")
    return PipelineSources("sd", pipeline_class, specs, tokenizers, scheduler,
                           {"force_zeros_for_empty_prompt": force_zeros})


def check_unet_together(where, specs) -> None:
    """The UNet family's components agree: the VAE's latents are the UNet's input, the encoders' widths its
    cross-attention width (SDXL: both encoders' concatenated) and SDXL's added embedding the pooled width."""
    unet, autoencoder = specs["unet"].args, specs["vae"].args
    if autoencoder.latent_channels != unet.in_channels:
        raise MlxdiffError(f"{where}: the UNet takes in_channels {unet.in_channels} but the VAE gives "
                           f"latent_channels {autoencoder.latent_channels}; the components do not belong together")
    encoders = [specs[n].args for n in ("text_encoder", "text_encoder_2") if n in specs]
    width = sum(e.hidden_size for e in encoders)
    if set(unet.cross_dims) != {width}:
        raise MlxdiffError(f"{where}: the UNet's cross_attention_dim is {unet.cross_attention_dim} but the text "
                           f"encoders give {width}; the components do not belong together (an SDXL UNet needs both "
                           "of SDXL's encoders, SD 1.x one CLIP-L, SD 2.x one OpenCLIP-H)")
    if unet.addition_embed_type == "text_time":
        if len(encoders) < 2:
            raise MlxdiffError(f"{where}: the UNet is SDXL's (text_time conditioning) but there is no second text "
                               "encoder; give the SDXL folder or file whole")
        pooled = encoders[1].projection_dim
        want = pooled + 6 * unet.addition_time_embed_dim
        if unet.projection_class_embeddings_input_dim != want:
            raise MlxdiffError(f"{where}: the UNet's projection_class_embeddings_input_dim is "
                               f"{unet.projection_class_embeddings_input_dim}; the second encoder's projection "
                               f"({pooled}) and six time ids of {unet.addition_time_embed_dim} give {want}")


def sd3_folder(root: Path, index, pipeline_class, components, transformer=None) -> PipelineSources:
    from ..tokenizers import load_tokenizer
    specs = {name: folder_component(root, name, components[name], name == "transformer" and transformer is not None)
             for name in ("transformer", "vae", "text_encoder", "text_encoder_2")}
    has_t5 = components["text_encoder_3"] is not None
    specs["text_encoder_3"] = folder_component(root, "text_encoder_3", components["text_encoder_3"]) \
        if has_t5 else None   # diffusers then uses zeros for the T5 part
    if has_t5 and components["tokenizer_3"] is None:
        raise MlxdiffError(f"{root / 'model_index.json'}: component 'tokenizer_3' is missing; text_encoder_3 "
                           "needs its tokenizer")
    if transformer is not None:
        specs["transformer"] = transformer_from_file(transformer, mmdit, specs["transformer"].config,
                                                     root / "transformer" / "config.json")
    check_together(root, "sd3", specs)
    tokenizers = {name: load_tokenizer(tokenizer_folder(root, name), components[name])
                  for name in ("tokenizer", "tokenizer_2", "tokenizer_3") if name != "tokenizer_3" or has_t5}
    return PipelineSources("sd3", pipeline_class, specs, tokenizers, read_scheduler_config(root))


VAE_PREFIXES = ("first_stage_model.", "vae.")   # a VAE inside a checkpoint (ComfyUI's bundles); else no prefix


def vae_from_file(path, base_config=None, base_where=None) -> ComponentSpec:
    """A FLUX.2 VAE from one file: BFL / ComfyUI names (ldm names, quant convs inside encoder/decoder, `bn.*`; the
    config read off the shapes, the group count and batch-norm settings from the folder's vae config when given,
    else FLUX.2's), or diffusers names (with a folder's vae config only)."""
    path = check_weight_file(not_a_folder(path, "VAE file"), "VAE file")
    shapes = tensor_shapes(path)
    prefix = next((p for p in VAE_PREFIXES if any(n.startswith(p + "decoder.") for n in shapes)), "")
    names = {k[len(prefix):]: v for k, v in shapes.items() if k.startswith(prefix)}
    if not {"bn.running_mean", "bn.running_var"} <= set(names) and "decoder.conv_in.weight" in names:
        raise MlxdiffError(f"{path}: a VAE without FLUX.2's latent statistics (bn.running_mean, bn.running_var): "
                           "FLUX.1's or SD3.5's ae, not FLUX.2's; give flux2-vae.safetensors / FLUX.2's ae.safetensors")
    if any(n.startswith(("encoder.down.", "decoder.up.")) for n in names):
        try:
            config = vae_flux2.config_from_original(names)
        except MlxdiffError as e:   # the inference knows tensors, not files
            raise MlxdiffError(f"{path}: {e}") from None
        config.update({k: base_config[k] for k in ("norm_num_groups", "batch_norm_eps", "batch_norm_momentum",
                                                     "act_fn", "sample_size") if base_config and k in base_config})
        where = f"{path} (config read from its tensor shapes" + (f" and {base_where})" if base_config else ")")
        vae_flux2.ModelArgs.from_dict(config, where)
        rules = vae_flux2.original_keymap(vae.ldm_num_blocks(names))
        return ComponentSpec("vae", vae_flux2, config, [path], prefix, lambda w: remap(w, rules))
    if "decoder.conv_in.weight" in names and "bn.running_mean" in names:
        if base_config is None:
            raise MlxdiffError(f"{path}: a diffusers-named VAE file needs its config.json; load the pipeline folder "
                               "and pass this file as vae=, or give BFL's ae.safetensors / ComfyUI's flux2-vae")
        return ComponentSpec("vae", vae_flux2, dict(base_config), [path], prefix)
    shown = ", ".join(sorted(shapes)[:4]) or "no tensors"
    raise MlxdiffError(f"{path}: not a FLUX.2 VAE in a naming mlxdiff reads (BFL / ComfyUI: encoder.down.N.*, "
                       f"decoder.up.N.*, bn.running_mean; or diffusers' with a pipeline folder); its tensors are "
                       f"{shown}")


def flux2_folder(root: Path, index, pipeline_class, components, transformer=None, text_encoder=None, vae=None,
                 tokenizer=None) -> PipelineSources:
    """A FLUX.2 pipeline folder; `transformer`, `text_encoder` and `vae` files and a `tokenizer` folder replace its
    own."""
    from ..tokenizers import load_chat_tokenizer
    where = root / "model_index.json"
    options = Flux2FolderOptions.from_dict(index, where)
    specs = {name: folder_component(root, name, components[name], replacement is not None)
             for name, replacement in (("transformer", transformer), ("vae", vae))}
    # a folder may name its own taps (a small encoder has fewer layers); diffusers ignores this key and takes
    # text_encoder_out_layers per call instead
    taps = options.text_encoder_out_layers or FLUX2_TAPS[pipeline_class]
    folder_config = root / "text_encoder" / "config.json"
    if text_encoder is None:
        specs["text_encoder"] = text_encoder_spec(root / "text_encoder", taps, root)
    else:   # the file replaces the folder's encoder; the folder's config (if any) gives what shapes cannot
        base = read_json(folder_config, "the text encoder config", root) if folder_config.is_file() else None
        specs["text_encoder"] = text_encoder_from_file(text_encoder, taps, base, folder_config,
                                                        bool(options.text_encoder_out_layers),
                                                        components["text_encoder"])
    encoder = specs["text_encoder"].args
    source = folder_config if text_encoder is None else text_encoder
    if text_llm.ARCHITECTURES[encoder.model_type] != components["text_encoder"]:
        raise MlxdiffError(f"{where}: component 'text_encoder' names class {components['text_encoder']!r} but "
                           f"{source} is a {text_llm.ARCHITECTURES[encoder.model_type]}")
    if options.text_encoder_out_layers and encoder.depth > encoder.num_layers:
        raise MlxdiffError(f"{where}: text_encoder_out_layers is {show(options.text_encoder_out_layers)}; expected "
                           f"layer indices 0 to {encoder.num_layers} (the text encoder's num_hidden_layers)")
    positions = encoder.text_config.get("max_position_embeddings")
    if "max_sequence_length" in index and positions is not None and options.max_sequence_length > positions:
        raise MlxdiffError(f"{where}: max_sequence_length is {options.max_sequence_length}; expected at most the "
                           f"text encoder's max_position_embeddings {positions}")
    if transformer is not None:
        specs["transformer"] = transformer_from_file(transformer, flux2, specs["transformer"].config,
                                                     root / "transformer" / "config.json")
    if vae is not None:
        specs["vae"] = vae_from_file(vae, specs["vae"].config, root / "vae" / "config.json")
    check_together(root, "flux2", specs, options.sample_size)
    if tokenizer is not None and not Path(tokenizer).is_dir():
        raise MlxdiffError(f"{tokenizer}: tokenizer folder not found; give the model's tokenizer/ folder "
                           "(tokenizer.json, tokenizer_config.json with its chat template)")
    folder = Path(tokenizer) if tokenizer is not None else tokenizer_folder(root, "tokenizer")
    if text_encoder is not None and not folder.is_dir():
        raise MlxdiffError(f"{folder}: missing; with text_encoder={text_encoder} the tokenizer still comes from the "
                           "pipeline folder: add the model's tokenizer/ folder (tokenizer.json, tokenizer_config.json "
                           "with its chat template) from its diffusers repository")
    tokenizer_ = load_chat_tokenizer(folder, encoder.model_type, source)   # of the encoder's family
    vocab = encoder.text_config.get("vocab_size")
    if vocab is not None and len(tokenizer_) > vocab:   # ids past the embedding would read other memory's rows
        raise MlxdiffError(f"{folder}: the tokenizer has {len(tokenizer_)} tokens but the text encoder's embedding "
                           f"({source}) has {vocab} rows; give the model's own tokenizer folder")
    tokenizers = {"tokenizer": tokenizer_}
    # optional folder defaults (diffusers ignores these keys): image size and prompt length of a small model
    return PipelineSources("flux2", pipeline_class, specs, tokenizers, read_scheduler_config(root),
                           {"is_distilled": options.is_distilled, "sample_size": options.sample_size,
                            "max_sequence_length": options.max_sequence_length})


def check_together(root, family, specs, sample_size=None) -> None:
    """What one component's config must agree on with another's, checked when the folder is read, not when a run
    reaches the mismatch: the VAE's latents are the transformer's input (FLUX.2: patchified 2x2 first), and the
    folder's default image size is a multiple of what the VAE and the patches divide it by."""
    transformer, autoencoder = specs["transformer"].args, specs["vae"].args
    patch = math.prod(autoencoder.patch_size) if family == "flux2" else 1
    if autoencoder.latent_channels * patch != transformer.in_channels:
        given = specs["transformer"].files[0]   # a --transformer file, or the folder's
        where = root / "transformer" / "config.json" if Path(given).parent == root / "transformer" else given
        given_vae = specs["vae"].files[0]   # a vae= file, or the folder's
        vae_where = root / "vae" / "config.json" if Path(given_vae).parent == root / "vae" else given_vae
        raise MlxdiffError(f"{where}: the transformer takes in_channels "
                           f"{transformer.in_channels} but {vae_where} gives latent_channels "
                           f"{autoencoder.latent_channels}" + (f" x {patch} (2x2 patches)" if patch > 1 else "")
                           + "; the components do not belong together")
    factor = 2 ** (len(autoencoder.block_out_channels) - 1) * (2 if family == "flux2" else transformer.patch_size)
    if sample_size is not None and sample_size % factor:
        raise MlxdiffError(f"{root / 'model_index.json'}: sample_size is {sample_size}; expected a multiple of "
                           f"{factor} (the VAE's factor x the transformer's patches) up to {MAX_IMAGE_SIZE}")
