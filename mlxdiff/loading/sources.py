"""What every family's readers share, to turn what a user names into component specs (where each component's bytes
are, its config and its key mapping): a folder's model_index.json checked against the families' layouts, a
component sub-folder, a denoiser or LLM text encoder given as one file, JSON configs read safely inside the model
folder, a hub id fetched into the Hugging Face cache (hub.py). The family readers (pipelines/<family>/) build a
PipelineSources from these (spec.py: ComponentSpec, PipelineSources and the architecture registry ARCHITECTURES);
pipelines.detect picks the family. A spec holds no weights; `spec.build()` maps them lazily when a phase needs it.
"""

import json
import os
import stat
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from ..config_checks import (MAX_IMAGE_SIZE, MAX_POSITIONS, CheckedArgs, Limit, Rule, between, json_type, one_of,
                             positive, show)
from ..errors import MlxdiffError
from ..files import read_capped
from ..formats import check_weight_file, format_of, open_weights, safetensors as st, tensor_shapes
from ..formats.coreml_mil import chunked_unet
from ..formats.keymaps import strip_prefix
from ..models import text_llm
from . import hub
from .spec import ARCHITECTURES, ComponentSpec, coreml_component   # also reached as sources.ComponentSpec

MAX_CONFIG_BYTES = 16 << 20   # config.json, model_index.json, scheduler_config.json: real ones are a few KB


def lazy_under(path, prefix) -> dict:
    """The (gated, lazy) tensors of one file under `prefix`, without it."""
    return strip_prefix(open_weights(path), prefix)


# where ComfyUI keeps a model's other files, relative to its transformer file (models/diffusion_models/)
COMFYUI_FOLDERS = {"encoders": ("", "text_encoders", "../text_encoders", "../clip"), "vae": ("", "vae", "../vae")}


def files_beside(transformer, where: str, patterns) -> list:
    """The files matching `patterns` beside a transformer file and in ComfyUI's folders for `where` ("encoders" or
    "vae"), in that order."""
    folders = [(Path(transformer).parent / d).resolve() for d in COMFYUI_FOLDERS[where]]
    return [f for d in folders if d.is_dir() for p in patterns for f in sorted(d.glob(p))]


def config_from_shapes(arch, infer, weights, path) -> dict:
    """A config read off a file's tensor shapes (`infer(weights)`), then checked like a config.json (the file named
    either way)."""
    try:
        config = infer(weights)
    except MlxdiffError as e:   # the inference knows tensors, not files
        raise MlxdiffError(f"{path}: {e}") from None
    arch.ModelArgs.from_dict(config, f"{path} (config read from its tensor shapes)")
    return config


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
    path = not_a_folder(path, "transformer file")   # a folder of Apple's UNet chunks: its first package
    if format_of(path, header=False).targets:   # a Core ML package (formats/coreml.py): an SD UNet from coremltools
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
                          expected=None, words=None) -> ComponentSpec:
    """An LLM text encoder (models/text_llm.py) given as one file (text_encoder=FILE): safetensors in transformers or
    ComfyUI names (pruned or whole), or a llama.cpp GGUF (kept quantized; llama-arch q/k rows put back in order). The config comes
    from the file's shapes (text_llm.config_from_file), with what shapes cannot give from the GGUF metadata, the
    folder's text_encoder/config.json (`base_config`, read from `base_where`) or the known models' values; checked
    against `taps` here, before anything is read. `words`: text_llm.config_from_file's `kind` and `config_hint` (the
    encoder's name and the advice where its shapes cannot say its settings) for a reader that words its refusals
    otherwise (files without a folder)."""
    path = check_weight_file(not_a_folder(path, "text encoder file"), "text encoder file")
    shapes = tensor_shapes(path)
    fmt = format_of(path, header=False)
    # a GGUF's metadata: its hyperparameters, read typed and bounded by text_llm.gguf_values
    metadata = fmt.metadata(path) if fmt.metadata else None
    try:
        config = text_llm.config_from_file(shapes, metadata, base_config, expected, **(words or {}))
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
    first = chunked_unet(path) if path.is_dir() else None
    if first is not None:    # a folder of Apple's chunked Core ML UNet: its first package (read with the second)
        return first
    fmt = format_of(path, header=False)
    if path.is_dir() and not (fmt.folder and what in fmt.only_as):   # a Core ML package is a folder
        raise MlxdiffError(f"{path}: is a folder; the {what} must be one .safetensors or .gguf file")
    return path


def read_json(path, what, root=None) -> dict:
    """A JSON object from `path` (inside the model folder `root`, when given): a regular file (a FIFO or a device is
    refused before it is opened: files.read_capped) of at most MAX_CONFIG_BYTES."""
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


def check_template_tokenizer(tokenizer, source, tokens, template, rows, encoder_where, folder="tokenizer") -> None:
    """An LLM encoder's tokenizer for a prompt template: the template's control `tokens` in its vocabulary (else
    `template` says whose it needs: "X's prompt template needs Y's tokenizer"), and no more tokens than the
    encoder's embedding `rows` (None: not known). `folder`: the model folder's tokenizer folder, for the advice."""
    vocab = tokenizer.get_vocab()
    missing = [t for t in tokens if t not in vocab]
    if missing:
        raise MlxdiffError(f"{source}: the tokenizer has no {' / '.join(missing)}; {template} (its {folder}/ folder)")
    if rows is not None and len(tokenizer) > rows:
        raise MlxdiffError(f"{source}: the tokenizer has {len(tokenizer)} tokens but the text encoder's embedding "
                           f"({encoder_where}) has {rows} rows; give the model's own {folder} folder")


def resolve_path(model, hub_request=None, reads=None) -> Path:
    """What `model` names: a local path, else a hub id (ORG/NAME) fetched into the Hugging Face cache through
    loading/hub.py (`hub_request`: download, revision, variant; `reads(folder)`: the components the run reads from
    its model_index.json)."""
    hub_request = hub.HubRequest() if hub_request is None else hub_request.checked()
    path = Path(model).expanduser()
    if path.exists():
        if hub_request.revision is not None:
            raise MlxdiffError(f"revision={hub_request.revision!r}: for a hub id (ORG/NAME); {model} is a local path")
        return path
    if hub.looks_like_hub_id(model):
        return hub.fetch(model, hub_request, reads or (lambda root: {}))
    raise MlxdiffError(f"{model}: not a local path (no such file or folder) nor a hub id (ORG/NAME, e.g. "
                       "black-forest-labs/FLUX.2-klein-4B); give an existing folder or file, or a hub id")


def _entry_class(where, name, entry, optional):
    """A component entry ["library", "class"] -> the class name; None for an optional component set to null."""
    if isinstance(entry, list) and len(entry) == 3 and isinstance(entry[2], dict):
        entry = entry[:2]       # a modular pipeline's entry: [library, class, its loading spec]
    if optional and (entry is None or entry == [None, None]):
        return None
    if entry is None or entry == [None, None]:
        raise MlxdiffError(f"{where}: component {name!r} is missing (null); this pipeline needs it")
    if not (isinstance(entry, list) and len(entry) == 2 and all(isinstance(x, str) for x in entry)):
        raise MlxdiffError(f"{where}: component {name!r} is {show(entry)}; expected [\"library\", \"ClassName\"], "
                           'e.g. ["diffusers", "AutoencoderKL"]')
    return entry[1]


MODULAR_INDEX = "modular_model_index.json"    # diffusers' ModularPipeline.save_pretrained writes this instead


def index_file(root) -> Path:
    """A pipeline folder's index: model_index.json, or the modular_model_index.json of a folder that has only that."""
    root = Path(root)
    where = root / "model_index.json"
    return root / MODULAR_INDEX if not where.is_file() and (root / MODULAR_INDEX).is_file() else where


def read_pipeline_folder(root: Path, layouts: dict):
    """model_index.json, checked -> (the whole index, pipeline class name, {component: class name or None}): the
    pipeline class is one of `layouts` ({class: (its components -> the classes each may name, or None for any;
    the components that may be null)}), and each component it needs is a ["library", "class"] entry naming a
    class that component may be."""
    where = root / "model_index.json"
    if not where.exists() and chunked_unet(root) is not None:   # Apple's chunked Core ML UNet: say what it is
        raise MlxdiffError(f"{root}: Apple's chunked Core ML UNet (UnetChunk1 + UnetChunk2) without the rest of "
                           "Apple's folder; give it as transformer= of the model's folder, or Apple's folder whole")
    where = index_file(root)
    index = read_json(where, where.name, root)
    pipeline_class = index.get("_class_name")
    if not isinstance(pipeline_class, str) or pipeline_class not in layouts:
        raise MlxdiffError(f"{where}: _class_name is {show(pipeline_class)}; expected one of "
                           + ", ".join(sorted(layouts)))
    components = {}
    layout, optional = layouts[pipeline_class]
    for name, allowed in layout.items():
        if name not in index and name not in optional:
            raise MlxdiffError(f"{where}: component {name!r} is missing; a {pipeline_class} needs "
                               + ", ".join(layout))
        cls = _entry_class(where, name, index.get(name), name in optional)
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


def read_scheduler_config(root, args=SchedulerArgs) -> dict:
    """scheduler/scheduler_config.json of the folder `root`, checked by `args` (a CheckedArgs: the keys its sampler
    reads)."""
    where = inside(root, root / "scheduler", "the scheduler folder") / "scheduler_config.json"
    config = read_json(where, "the scheduler config", root)
    args.from_dict(config, where)
    return config


def check_together(root, specs, latent_patch=1, token_patch=None, sample_size=None) -> None:
    """What one component's config must agree on with another's, checked when the folder is read, not when a run
    reaches the mismatch: the VAE's latents are the transformer's input (`latent_patch`: channels the latents
    gain when patchified before it, FLUX.2's 2x2), and the folder's default image size is a multiple of what the
    VAE and the patches (`token_patch`, else the transformer's patch_size) divide it by."""
    transformer, autoencoder = specs["transformer"].args, specs["vae"].args
    patch = latent_patch
    if autoencoder.latent_channels * patch != transformer.in_channels:
        given = specs["transformer"].files[0]   # a --transformer file, or the folder's
        where = root / "transformer" / "config.json" if Path(given).parent == root / "transformer" else given
        given_vae = specs["vae"].files[0]   # a vae= file, or the folder's
        vae_where = root / "vae" / "config.json" if Path(given_vae).parent == root / "vae" else given_vae
        raise MlxdiffError(f"{where}: the transformer takes in_channels "
                           f"{transformer.in_channels} but {vae_where} gives latent_channels "
                           f"{autoencoder.latent_channels}" + (f" x {patch} (2x2 patches)" if patch > 1 else "")
                           + "; the components do not belong together")
    factor = 2 ** (len(autoencoder.block_out_channels) - 1) * (token_patch or transformer.patch_size)
    if sample_size is not None and sample_size % factor:
        raise MlxdiffError(f"{root / 'model_index.json'}: sample_size is {sample_size}; expected a multiple of "
                           f"{factor} (the VAE's factor x the transformer's patches) up to {MAX_IMAGE_SIZE}")
