"""What a user names -> component specs: where each component's bytes are, its config and its key mapping.

Accepted: a diffusers pipeline folder (model_index.json), a hub id found in the local Hugging Face cache, or an
original single file (SD3.5: `model.diffusion_model.*` + `first_stage_model.*`, text encoders beside it or inside).
A spec holds no weights; `spec.build()` maps them lazily when a phase needs the model.
"""

import importlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ..errors import MlxdiffError
from . import safetensors as st
from .keymaps import strip_prefix
from .weights import build

# diffusers / transformers class name -> our model module (mlxdiff.models.<name>)
ARCHITECTURES = {
    "SD3Transformer2DModel": "mmdit",
    "AutoencoderKL": "vae",
    "CLIPTextModelWithProjection": "clip",
    "T5EncoderModel": "t5",
    "Flux2Transformer2DModel": "flux2",
    "AutoencoderKLFlux2": "vae_flux2",
}
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
        return importlib.import_module(f"mlxdiff.models.{ARCHITECTURES[class_name]}")
    except KeyError:
        raise MlxdiffError(f"{where}: unsupported component class {class_name!r}; supported: "
                           + ", ".join(sorted(ARCHITECTURES))) from None


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

    def weights(self, compute_dtype=None) -> dict:
        weights = {}
        for f in self.files:
            weights.update(read_weights_file(f, compute_dtype))
        if self.prefix:
            weights = strip_prefix(weights, self.prefix)
        if self.keymap:
            weights = self.keymap(weights)
        for k, fn in self.extra.items():
            weights.setdefault(k, fn(weights))
        return weights

    def nbytes(self) -> int:
        """Bytes of this component's tensors as stored (headers only; nothing is read)."""
        total = 0
        for f in self.files:
            if Path(f).suffix == ".gguf":
                from .gguf import check_gguf
                total += sum(t.nbytes for t in check_gguf(f).tensors if t.name.startswith(self.prefix))
                continue
            for name, (dtype, shape) in st.check_safetensors(f).items():
                if name.startswith(self.prefix):
                    n = st.ITEMSIZE[dtype]
                    for d in shape:
                        n *= d
                    total += n
        return total

    def loaded_nbytes(self) -> int:
        """Bytes in memory once loaded: as stored, or after quantize-while-loading (Linear weights outside the
        full-precision rule become bits/8 per weight plus a 16-bit scale and bias per group)."""
        if not self.quantize:
            return self.nbytes()
        from .quantize import keeps_full_precision
        bits, group = self.quantize["bits"], self.quantize.get("group_size", 64)
        total = 0
        for f in self.files:
            for name, shape in tensor_shapes(f).items():
                if not name.startswith(self.prefix):
                    continue
                n = 1
                for d in shape.shape:
                    n *= d
                layer = name[len(self.prefix):].rsplit(".", 1)[0]
                if (len(shape.shape) == 2 and name.endswith(".weight") and not keeps_full_precision(layer)
                        and shape.shape[-1] % group == 0):
                    total += n * bits // 8 + n // group * 4
                else:
                    total += n * 2
        return total

    def build(self, compute_dtype=None):
        return build(self.arch, self.config, self.weights(compute_dtype), self.source, compute_dtype,
                     native=bool(self.config.get(NATIVE_KEY)), quantize=self.quantize)


WEIGHT_SUFFIXES = (".safetensors", ".gguf")


def read_weights_file(path, compute_dtype=None) -> dict:
    """{name: array} from a safetensors file, or {name: array | QuantizedTensor} from a GGUF file (checked first)."""
    if Path(path).suffix == ".gguf":
        from .gguf import load_gguf
        return load_gguf(path, compute_dtype)
    return st.load_safetensors(path)


class TensorShape:
    """Stands in for an array where only its shape is needed (config inference from a file's header)."""

    def __init__(self, shape):
        self.shape = tuple(shape)
        self.ndim = len(self.shape)


def tensor_shapes(path) -> dict:
    """{name: TensorShape} from a safetensors or GGUF header, without reading any tensor."""
    path = Path(path)
    if path.suffix == ".gguf":
        from .gguf import check_gguf
        return {t.name: TensorShape(t.shape) for t in check_gguf(path).tensors}
    return {k: TensorShape(shape) for k, (_, shape) in st.check_safetensors(path).items()}


def transformer_from_file(path, arch, base_config=None) -> ComponentSpec:
    """A denoiser given as one file (safetensors or GGUF) with original (SAI / BFL) names, with or without the
    `model.diffusion_model.` prefix, or with diffusers names. The config comes from the file's shapes
    (arch.config_from_original), plus the few values shapes cannot give (arch.FROM_BASE_CONFIG) from the pipeline
    folder's transformer config; diffusers-named files need that folder config."""
    path = Path(path)
    if not path.is_file():
        raise MlxdiffError(f"{path}: transformer file not found")
    if path.suffix not in WEIGHT_SUFFIXES:
        raise MlxdiffError(f"{path}: expected a .safetensors or .gguf transformer file")
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
    folder = root / name
    if not folder.is_dir():
        raise MlxdiffError(f"{folder}: component folder {name!r} named in model_index.json is missing")
    arch = model_module(class_name, folder)
    config = read_json(folder / "config.json", f"the {name} config")
    return ComponentSpec(name, arch, config, st.safetensors_files(folder))


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
    """model_index.json -> (pipeline class name, {component: (library, class)})."""
    index = read_json(root / "model_index.json", "model_index.json")
    pipeline_class = index.get("_class_name")
    if pipeline_class not in PIPELINE_FAMILIES:
        raise MlxdiffError(f"{root / 'model_index.json'}: unsupported pipeline {pipeline_class!r}; "
                           "supported: " + ", ".join(sorted(PIPELINE_FAMILIES)))
    components = {k: v for k, v in index.items() if not k.startswith("_")}
    return pipeline_class, components


def apply_quantize(components: dict, quantize) -> None:
    """quantize: bits for every model component, or {component: bits | {"bits", "group_size"}}."""
    from .quantize import check_settings
    if quantize is None:
        return
    present = {k: v for k, v in components.items() if v is not None}
    plan = {name: quantize for name in present} if not isinstance(quantize, dict) else dict(quantize)
    for name, setting in plan.items():
        if name not in present:
            raise MlxdiffError(f"quantize: unknown component {name!r}; this pipeline has "
                               + ", ".join(sorted(present)))
        setting = {"bits": setting} if isinstance(setting, int) else dict(setting)
        setting.setdefault("group_size", 64)
        check_settings(setting["bits"], setting["group_size"], f"quantize[{name!r}]")
        present[name].quantize = setting
