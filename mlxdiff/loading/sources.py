"""What a user names -> component specs: where each component's bytes are, its config and its key mapping.

Accepted: a diffusers pipeline folder (model_index.json), a hub id found in the local Hugging Face cache, or an
original single file (SD3.5: single_file.py); resolve.py picks which. Each reader returns a PipelineSources: the
family, one ComponentSpec per model component (LLM text encoders included), tokenizers, scheduler config and
folder options.
A spec holds no weights; `spec.build()` maps them lazily when a phase needs the model.
"""

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

from ..errors import MlxdiffError
from ..formats import check_weight_file, is_gguf, open_weights, safetensors as st, tensor_nbytes, tensor_shapes
from ..formats.keymaps import strip_prefix
from ..models import clip, flux2, mmdit, t5, text_llm, vae, vae_flux2
from .build import build
from .quantize import parameter_nbytes, setting

# diffusers / transformers class name -> our model module
ARCHITECTURES = {
    "SD3Transformer2DModel": mmdit,
    "AutoencoderKL": vae,
    "CLIPTextModelWithProjection": clip,
    "T5EncoderModel": t5,
    "Flux2Transformer2DModel": flux2,
    "AutoencoderKLFlux2": vae_flux2,
    "Mistral3ForConditionalGeneration": text_llm,
    "Qwen3ForCausalLM": text_llm,
}
# diffusers' text_encoder_out_layers defaults per pipeline
FLUX2_TAPS = {"Flux2Pipeline": (10, 20, 30), "Flux2KleinPipeline": (9, 18, 27)}
# config.json key that marks mlxdiff's own format: weights saved in the module's names and layouts (no sanitize)
NATIVE_KEY = "_mlxdiff_native"
# model_index.json `_class_name` -> pipeline family
PIPELINE_FAMILIES = {
    "StableDiffusion3Pipeline": "sd3",
    "Flux2Pipeline": "flux2",
    "Flux2KleinPipeline": "flux2",
}


def model_module(class_name, where):
    try:
        return ARCHITECTURES[class_name]
    except KeyError:
        raise MlxdiffError(f"{where}: unsupported component class {class_name!r}; supported: "
                           + ", ".join(sorted(ARCHITECTURES))) from None


def class_name_of(spec) -> str:
    """The diffusers / transformers class a converted component is saved as."""
    if spec.arch is text_llm:
        return text_llm.ARCHITECTURES[spec.config.get("model_type")]
    return next(name for name, arch in ARCHITECTURES.items() if arch is spec.arch)


@dataclass
class ComponentSpec:
    """One model component: its architecture module, config dict and where its weights are."""
    name: str
    arch: object                      # the mlxdiff.models.<x> module
    config: dict
    files: list                       # safetensors (or GGUF) files holding the weights
    prefix: str = ""                  # only keys under this prefix belong to the component (single files)
    keymap: Callable | None = None    # original names -> diffusers names
    extra: dict = field(default_factory=dict)   # tensors to add after mapping (e.g. SD3's identity CLIP-L projection)
    quantize: dict | None = None      # {"bits", "group_size"}: quantize while loading
    matmul: str | None = None         # "qmm" | "dequantize" for quantized layers (None: backend default)

    @property
    def source(self):
        return ", ".join(str(f) for f in self.files)

    @property
    def args(self):
        """The typed config (the architecture's ModelArgs)."""
        return self.arch.ModelArgs.from_dict(self.config)

    def with_config(self, **changes) -> "ComponentSpec":
        return replace(self, config={**self.config, **changes})

    def weights(self, compute_dtype=None) -> dict:
        weights = {}
        for f in self.files:
            weights.update(open_weights(f, compute_dtype))
        if self.prefix:
            weights = strip_prefix(weights, self.prefix)
        if self.keymap:
            weights = self.keymap(weights)
        for k, fn in self.extra.items():
            weights.setdefault(k, fn(weights))
        return weights

    def nbytes(self) -> int:
        """Bytes, as stored, of the tensors this component reads (headers only; nothing is read)."""
        reads = getattr(self.arch, "reads_stored", None)
        args = self.args if reads else None
        total = 0
        for f in self.files:
            for name, n in tensor_nbytes(f).items():
                if name.startswith(self.prefix) and (reads is None or reads(name[len(self.prefix):], args)):
                    total += n
        return total

    def loaded_nbytes(self, quantize=None) -> int:
        """Bytes in memory once loaded: as stored, or, when quantizing while loading (`self.quantize`, or the
        `quantize` bits or setting to estimate), the exact size of the model built lazily: safetensors are mapped,
        not read, so nothing is read. GGUF weights are already quantized: their stored size."""
        quantize = self.quantize if quantize is None else setting(quantize)
        if not quantize or any(is_gguf(f) for f in self.files):
            return self.nbytes()
        model = replace(self, quantize=quantize).build()
        try:
            return parameter_nbytes(model)
        finally:
            model.clear()

    def build(self, compute_dtype=None):
        check = getattr(self.arch, "check_config", None)   # the LLM encoders: taps and quantization, once final
        if check:
            check(self.config, Path(self.files[0]).parent if self.files else self.name)
        return build(self.arch, self.config, self.weights(compute_dtype), self.source, compute_dtype,
                     native=bool(self.config.get(NATIVE_KEY)), quantize=self.quantize)


@dataclass
class PipelineSources:
    """Everything a pipeline is made from: specs, tokenizers and settings; no weights."""
    family: str                        # "sd3" | "flux2"
    pipeline_class: str                # diffusers' pipeline class name
    components: dict                   # name -> ComponentSpec (None for an absent text_encoder_3)
    tokenizers: dict                   # name -> transformers tokenizer
    scheduler_config: dict
    options: dict = field(default_factory=dict)   # folder defaults: is_distilled, sample_size, max_sequence_length


def transformer_from_file(path, arch, base_config=None) -> ComponentSpec:
    """A denoiser given as one file (safetensors or GGUF) with original (SAI / BFL) names, with or without the
    `model.diffusion_model.` prefix, or with diffusers names. The config comes from the file's shapes
    (arch.config_from_original), plus the few values shapes cannot give (arch.FROM_BASE_CONFIG) from the pipeline
    folder's transformer config; diffusers-named files need that folder config."""
    path = check_weight_file(path, "transformer file")
    shapes = tensor_shapes(path)
    prefix = arch.ORIGINAL_PREFIX if any(n.startswith(arch.ORIGINAL_PREFIX) for n in shapes) else ""
    if arch.is_original(list(shapes)):
        config = arch.config_from_original({k[len(prefix):]: v for k, v in shapes.items() if k.startswith(prefix)})
        for key in arch.FROM_BASE_CONFIG:
            if base_config and key in base_config:
                config[key] = base_config[key]
        return ComponentSpec("transformer", arch, config, [path], prefix, arch.original_to_diffusers)
    if base_config is None:
        raise MlxdiffError(f"{path}: a diffusers-named transformer file needs its config.json; load the pipeline "
                           "folder and pass this file as transformer=")
    return ComponentSpec("transformer", arch, dict(base_config), [path], prefix)


def read_json(path, what):
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise MlxdiffError(f"{path}: {what} is missing; the model folder is incomplete") from None
    except (OSError, ValueError) as e:
        raise MlxdiffError(f"{path}: cannot read {what} ({e})") from None


def folder_component(root: Path, name: str, class_name: str) -> ComponentSpec:
    """A component sub-folder: config.json + safetensors, sharded or not."""
    folder = root / name
    if not folder.is_dir():
        raise MlxdiffError(f"{folder}: component folder {name!r} named in model_index.json is missing")
    arch = model_module(class_name, folder)
    return ComponentSpec(name, arch, read_json(folder / "config.json", f"the {name} config"),
                         st.safetensors_files(folder))


def text_encoder_spec(folder, taps) -> ComponentSpec:
    """A FLUX.2 LLM text encoder folder (diffusers' `text_encoder/` or an mlx-lm converted one; the config says
    Mistral3 or Qwen3), read up to the deepest of `taps`."""
    folder = Path(folder)
    if not folder.is_dir():
        raise MlxdiffError(f"{folder}: text encoder folder is missing")
    config = {**read_json(folder / "config.json", "the text encoder config"), "taps": list(taps)}
    text_llm.check_config(config, folder, taps=False)
    return ComponentSpec(folder.name, text_llm, config, st.safetensors_files(folder))




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


def read_pipeline_folder(root: Path):
    """model_index.json -> (the whole index, pipeline class name, {component: (library, class)})."""
    index = read_json(root / "model_index.json", "model_index.json")
    pipeline_class = index.get("_class_name")
    if pipeline_class not in PIPELINE_FAMILIES:
        raise MlxdiffError(f"{root / 'model_index.json'}: unsupported pipeline {pipeline_class!r}; "
                           "supported: " + ", ".join(sorted(PIPELINE_FAMILIES)))
    components = {k: v for k, v in index.items() if not k.startswith("_")}
    return index, pipeline_class, components


def _require(root, components, names):
    for name in names:
        entry = components.get(name)
        if not entry or entry[1] is None:
            raise MlxdiffError(f"{root / 'model_index.json'}: component {name!r} is missing")


def sd3_folder(root: Path, index, pipeline_class, components, transformer=None) -> PipelineSources:
    from ..tokenizers import load_tokenizer
    _require(root, components, ("transformer", "vae", "text_encoder", "text_encoder_2", "tokenizer",
                                "tokenizer_2"))
    specs = {name: folder_component(root, name, components[name][1])
             for name in ("transformer", "vae", "text_encoder", "text_encoder_2")}
    has_t5 = bool(components.get("text_encoder_3")) and components["text_encoder_3"][1] is not None
    specs["text_encoder_3"] = folder_component(root, "text_encoder_3", components["text_encoder_3"][1]) \
        if has_t5 else None   # diffusers then uses zeros for the T5 part
    if has_t5:
        _require(root, components, ("tokenizer_3",))
    tokenizers = {name: load_tokenizer(root / name, components[name][1])
                  for name in ("tokenizer", "tokenizer_2", "tokenizer_3") if name != "tokenizer_3" or has_t5}
    if transformer is not None:
        specs["transformer"] = transformer_from_file(transformer, mmdit, specs["transformer"].config)
    scheduler = read_json(root / "scheduler" / "scheduler_config.json", "the scheduler config")
    return PipelineSources("sd3", pipeline_class, specs, tokenizers, scheduler)


def flux2_folder(root: Path, index, pipeline_class, components, transformer=None) -> PipelineSources:
    from ..tokenizers import load_chat_tokenizer
    _require(root, components, ("transformer", "vae", "text_encoder", "tokenizer", "scheduler"))
    specs = {name: folder_component(root, name, components[name][1]) for name in ("transformer", "vae")}
    # a folder may name its own taps (a small encoder has fewer layers); diffusers ignores this key and takes
    # text_encoder_out_layers per call instead
    taps = index.get("text_encoder_out_layers") or FLUX2_TAPS[pipeline_class]
    specs["text_encoder"] = text_encoder_spec(root / "text_encoder", taps)
    tokenizers = {"tokenizer": load_chat_tokenizer(root / "tokenizer")}
    if transformer is not None:
        specs["transformer"] = transformer_from_file(transformer, flux2, specs["transformer"].config)
    scheduler = read_json(root / "scheduler" / "scheduler_config.json", "the scheduler config")
    # optional folder defaults (diffusers ignores these keys): image size and prompt length of a small model
    options = {"is_distilled": bool(index.get("is_distilled", False)), "sample_size": index.get("sample_size"),
               "max_sequence_length": index.get("max_sequence_length", 512)}
    return PipelineSources("flux2", pipeline_class, specs, tokenizers, scheduler, options)
