"""What a pipeline is made of, before anything is read: one ComponentSpec per model component (its architecture
module, config, weight files and key mapping; `spec.build()` maps the weights lazily when a phase needs the model)
and the PipelineSources that gather them with the tokenizers and settings. The readers that make them from what a
user names are the family readers (pipelines/<family>/) on sources.py's shared ones; pipelines.detect picks the
family.

Also here: the architecture registry (diffusers / transformers class name <-> mlxdiff.models module, which is what a
spec's `arch` is and what mlxdiff.convert saves a component as), handed on from models/registry.py, which finds the
modules by convention, and NATIVE_KEY, the mark of mlxdiff's own format. What a module in the registry provides:
mlxdiff/models/protocol.py.
"""

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

from .. import backend  # noqa: F401  (OpenBLAS preload before mlx)
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..errors import MlxdiffError
from ..formats import format_of, loaded_nbytes, open_weights, tensor_nbytes
from ..formats.coreml import read_diffusers
from ..formats.keymaps import strip_prefix
from ..lora import apply_loras, lora_nbytes
from ..models import clip, text_llm, unet   # unet: a Core ML package is read as a UNet only
from ..models.protocol import Architecture
from ..models.registry import ARCHITECTURES  # noqa: F401  (handed on: loading/ and pipelines/ read it here)
from ..policy import current_dtype
from .build import build
from .quantize import parameter_nbytes, setting

# config.json key that marks mlxdiff's own format: weights saved in the module's names and layouts (no sanitize)
NATIVE_KEY = "_mlxdiff_native"


def class_name_of(spec) -> str:
    """The diffusers / transformers class a converted component is saved as."""
    if spec.arch is text_llm:
        return text_llm.ARCHITECTURES[spec.config.get("model_type")]
    if spec.arch is clip and not spec.args.with_projection:
        return "CLIPTextModel"
    return spec.arch.CLASS_NAMES[0]


@dataclass
class ComponentSpec:
    """One model component: its architecture module, config dict and where its weights are."""
    name: str
    arch: Architecture                # the mlxdiff.models.<x> module (what it provides: models/protocol.py)
    config: dict
    files: list                       # safetensors (or GGUF) files holding the weights
    prefix: str = ""                  # only keys under this prefix belong to the component (single files)
    keymap: Callable | None = None    # original names -> diffusers names
    extra: dict = field(default_factory=dict)   # tensors to add after mapping (e.g. SD3's identity CLIP-L projection)
    quantize: dict | None = None      # {"bits", "group_size"}: quantize while loading
    matmul: str | None = None         # "qmm" | "dequantize" for quantized layers (None: backend default)
    gguf_layout: str | None = None    # "raw" | "affine" for GGUF files (None: "auto", formats/gguf.py); the memory
                                      # budget may pick "raw" (memory.check_fits)
    loras: tuple = ()                 # ((file, scale), ...): LoRAs added to the built model (mlxdiff/lora/)
    stream_budget: int | None = None  # bytes the weights must fit by streaming blocks from the file (memory.check_fits
                                      # sets it when they do not fit resident; loading/streaming.py)

    @property
    def source(self):
        return ", ".join(str(f) for f in self.files)

    @property
    def args(self):
        """The typed config (the architecture's ModelArgs)."""
        return self.arch.ModelArgs.from_dict(self.config)

    def with_config(self, **changes) -> "ComponentSpec":
        return replace(self, config={**self.config, **changes})

    def weights(self, compute_dtype=None, names=None, standins=frozenset()) -> dict:
        """The component's tensors in diffusers names (mapped from the file's), lazy where the format allows;
        `compute_dtype`: the readers' target dtype where they convert (formats.open_weights), not the run's.
        `names`: only these file tensors (a streamed block's, loading/streaming.py; no `extra`); `standins`: these
        file tensors as stand-ins that read nothing (formats.open_weights), for the blocks streamed later."""
        weights = {}
        for f in self.files:
            fmt = format_of(f, header=False)
            if fmt.targets:   # a Core ML package: its traced names mapped onto the model's (formats/coreml.py)
                weights.update(open_weights(f, compute_dtype, names=names, standins=bool(standins),
                                            **self.diffusers_targets()))
            elif standins:
                chosen = set(tensor_nbytes(f)) if names is None else set(tensor_nbytes(f)) & set(names)
                if chosen & standins:
                    weights.update(open_weights(f, compute_dtype, self.gguf_layout, names=chosen & standins,
                                                standins=True))
                if chosen - standins:
                    weights.update(open_weights(f, compute_dtype, self.gguf_layout, names=chosen - standins))
            else:
                chosen = names
                if chosen is None and self.prefix and fmt.converts:   # one component of a whole-model GGUF (sd.cpp):
                    chosen = {n for n in tensor_nbytes(f) if n.startswith(self.prefix)}   # convert only its tensors
                weights.update(open_weights(f, compute_dtype, self.gguf_layout, names=chosen))
        if self.prefix:
            weights = strip_prefix(weights, self.prefix)
        if self.keymap:
            weights = self.keymap(weights)
        if names is None:
            for k, fn in self.extra.items():
                weights.setdefault(k, fn(weights))
        return weights

    def diffusers_targets(self) -> dict:
        """{"targets": {diffusers name: PyTorch shape}, "linear" / "convs": the Linear / Conv2d layers' weight names} of this
        component's model (built lazily from the config: nothing is computed), for a Core ML package's names to be
        mapped onto (formats/coreml.open_diffusers). A UNet's: sanitize's only change is a conv weight's OIHW ->
        OHWI, undone here."""
        model = self.arch.Model(self.args)
        targets = {k: ((v.shape[0], v.shape[3], v.shape[1], v.shape[2]) if v.ndim == 4 and k.endswith(".weight")
                       else tuple(v.shape)) for k, v in tree_flatten(model.parameters())}
        linear = {f"{path}.weight" for path, m in model.named_modules() if type(m) is nn.Linear}
        convs = {f"{path}.weight" for path, m in model.named_modules() if isinstance(m, nn.Conv2d)}
        return {"targets": targets, "linear": frozenset(linear), "convs": frozenset(convs)}

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

    def loaded_nbytes(self, quantize=None, compute_dtype=None) -> int:
        """Bytes in memory once loaded: as stored, or, when quantizing while loading (`self.quantize`, or the
        `quantize` bits or setting to estimate), the exact size of the model built lazily: safetensors are mapped,
        not read, so nothing is read. GGUF weights are already quantized: their size in the layout they load in
        (from the header)."""
        stored_as = [format_of(f, header=False) for f in self.files]
        if any(fmt.targets for fmt in stored_as) and not (self.quantize if quantize is None else quantize):
            return sum(loaded_nbytes(f, **self.diffusers_targets()) for f in self.files) + self.lora_nbytes()
        if any(fmt.kept_quantized for fmt in stored_as):
            total = sum(loaded_nbytes(f, compute_dtype, self.gguf_layout) for f in self.files)
            if getattr(self.arch, "reads_stored", None) is None:
                return total + self.lora_nbytes()
            # an LLM encoder reads only the tapped layers: the loaded size in proportion to the bytes it reads
            stored = sum(sum(tensor_nbytes(f).values()) for f in self.files)
            return round(total * self.nbytes() / stored) if stored else total
        quantize = self.quantize if quantize is None else setting(quantize)
        if not quantize:
            return self.nbytes() + self.lora_nbytes()
        model = replace(self, quantize=quantize, loras=()).build()
        try:
            return parameter_nbytes(model) + self.lora_nbytes()
        finally:
            model.clear()

    def lora_nbytes(self) -> int:
        """Bytes of the LoRA files' tensors (their headers; mlxdiff/lora/ keeps them as stored, or in the compute
        dtype where theirs would promote it)."""
        if not self.loras:
            return 0
        return sum(lora_nbytes(f) for f, _ in self.loras)

    def build(self, standins=frozenset(), check=True):
        """The model, its weights lazily mapped (GGUF ones read), in the installed policy's compute dtype (float32
        with none); `standins`: file tensors left as stand-ins that read nothing (the blocks loading/streaming.py
        streams); `check`: the small tensors' values checked (build)."""
        check_config = getattr(self.arch, "check_config", None)   # the LLM encoders: taps and quantization
        if check_config:   # once final; a folder's encoder is named by its folder, a text_encoder=FILE by the file
            single = self.config.get("file_layers") is not None
            check_config(self.config, (Path(self.files[0]) if single else Path(self.files[0]).parent) if self.files
                  else self.name)
        model = build(self.arch, self.config, self.weights(current_dtype(), standins=standins), self.source,
                      native=bool(self.config.get(NATIVE_KEY)), quantize=self.quantize, check=check)
        if self.loras:
            apply_loras(model, self.arch, self.loras, component=self.name)
        return model


@dataclass
class PipelineSources:
    """Everything a pipeline is made from: specs, tokenizers and settings; no weights."""
    family: str                        # "sd3" | "flux2"
    pipeline_class: str                # diffusers' pipeline class name
    components: dict                   # name -> ComponentSpec (None for an absent text_encoder_3)
    tokenizers: dict                   # name -> transformers tokenizer
    scheduler_config: dict
    options: dict = field(default_factory=dict)   # folder defaults: is_distilled, sample_size, max_sequence_length


def coreml_component(path, arch, base_config=None, base_where=None) -> ComponentSpec:
    """A UNet given as a Core ML package (an .mlpackage coremltools converted from diffusers' UNet2DConditionModel,
    palettized or not): the pipeline folder's UNet config, the package's weights mapped onto it by name and checked
    by shape now (formats/coreml.read_diffusers; the program is parsed, no weight decoded), one line if they do not
    fit."""
    if arch is not unet:
        raise MlxdiffError(f"{path}: a Core ML package is read as an SD 1.x / SDXL UNet only (transformer= of a "
                           "StableDiffusion folder); give this model's transformer as a .safetensors or .gguf file")
    if base_config is None:
        raise MlxdiffError(f"{path}: a Core ML package's UNet needs its config.json; load the pipeline folder and "
                           "pass the package as transformer=")
    spec = ComponentSpec("unet", arch, dict(base_config), [Path(path)])
    read_diffusers(path, spec.diffusers_targets()["targets"], prefix=None)
    return spec
