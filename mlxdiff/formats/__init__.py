"""File formats, below the models: every weight file is opened here, and nothing here imports a model.

`open_weights(path)` decides by file type once: a safetensors file through the gate (safetensors.py), a GGUF file
through its own checked reader (gguf.py), whose quantized tensors stay quantized (quantized.py); a safetensors file
with float8 weights or ComfyUI's fp8 markers through fp8.py (its fp8 weights stay at 8 bits, scales folded in);
a Core ML package (an .mlpackage folder coremltools made from a diffusers UNet) through coreml.py, its palettized
Linear weights kept palettized (formats/palettized.py). A package is a weight "file" where a UNet file may be given
(PACKAGE_WHATS); its names are the traced module's, mapped onto the model's by `targets` (coreml.open_diffusers).
Key-map tables (keymaps.py) rename what the readers return.
"""

from pathlib import Path

from ..errors import MlxdiffError
from ..files import file_kind
from . import fp8, safetensors

WEIGHT_SUFFIXES = (".safetensors", ".gguf")
COREML_SUFFIX = ".mlpackage"
PACKAGE_WHATS = ("transformer file",)   # where a Core ML package may stand for the weights file (SD's UNet)


def is_gguf(path) -> bool:
    return Path(path).suffix == ".gguf"


def is_coreml(path) -> bool:
    """A Core ML package: an .mlpackage folder (formats/coreml.py)."""
    return Path(path).suffix == COREML_SUFFIX


def check_weight_file(path, what="weights file") -> Path:
    """A path that names an existing .safetensors or .gguf file, or one line saying what is wrong."""
    path = Path(path)
    try:
        kind = file_kind(path.stat().st_mode)
    except FileNotFoundError:
        raise MlxdiffError(f"{path}: {what} not found") from None
    except OSError as e:
        raise MlxdiffError(f"{path}: cannot read the {what} ({e.strerror or e})") from None
    if is_coreml(path):
        if what not in PACKAGE_WHATS:
            raise MlxdiffError(f"{path}: a Core ML package is read only as an SD 1.x / SDXL UNet (transformer=); "
                               f"the {what} must be one .safetensors or .gguf file")
        if kind != "a folder":
            raise MlxdiffError(f"{path}: is {kind or 'a file'}; a Core ML package is the .mlpackage folder "
                               "coremltools saves")
        return path
    if kind == "a folder":
        raise MlxdiffError(f"{path}: is a folder; expected a .safetensors or .gguf {what}")
    if kind is not None:
        raise MlxdiffError(f"{path}: is {kind}, not a regular file; give the .safetensors or .gguf {what} itself")
    if path.suffix not in WEIGHT_SUFFIXES:
        raise MlxdiffError(f"{path}: expected a .safetensors or .gguf {what}")
    return path


def open_weights(path, compute_dtype=None, gguf_layout=None, names=None, standins=False, targets=None,
                 linear=frozenset(), convs=frozenset()) -> dict:
    """{name: mx.array} from a safetensors file (mx.array | Float8Weight for float8 ones, formats/fp8.py), or
    {name: mx.array | QuantizedTensor | RawBlocks} from a GGUF file (in `gguf_layout`, formats/gguf.py); lazy where
    the format allows (safetensors are mapped, not read). Every header is checked first.

    `names`: only these tensors (a GGUF reads only them). `standins`: nothing read at all: a GGUF's tensors as lazy
    zeros of the form they load in (formats/gguf.standins), a safetensors file's as its lazy mapped arrays, for a
    model whose blocks are streamed (loading/streaming.py) to be built around.

    A Core ML package: {diffusers name: mx.array | PalettizedWeight} of `targets` ({diffusers name: PyTorch shape},
    required), the palettized weights of the names in `linear` and `convs` kept palettized (coreml.open_diffusers); read whole
    (no stand-ins: its blocks are not streamed)."""
    if is_coreml(path):
        from . import coreml
        if targets is None:
            raise MlxdiffError(f"{path}: a Core ML package's weights are named after the traced module; give the "
                               "package as a UNet (transformer=) of a pipeline folder")
        if standins:
            raise MlxdiffError(f"{path}: a Core ML package is loaded whole, not streamed block by block; free "
                               "memory or give the UNet as a safetensors file")
        wanted = targets if names is None else {k: v for k, v in targets.items() if k in names}
        return coreml.open_diffusers(path, wanted, linear, convs)
    if is_gguf(path):
        from .gguf import load_gguf, standins as gguf_standins
        return (gguf_standins if standins else load_gguf)(path, compute_dtype, gguf_layout, names=names)
    info, meta = safetensors.check_safetensors(path, with_metadata=True)
    if fp8.applies(info, meta):
        arrays = fp8.load(path, info, meta, compute_dtype)
    else:
        arrays = safetensors.load_safetensors(path, info=info)
    return arrays if names is None else {k: v for k, v in arrays.items() if k in names}


def tensor_ranges(path) -> dict:
    """{name: (byte offset, bytes)} of every tensor of a safetensors or GGUF file, from its checked header."""
    if is_coreml(path):
        raise MlxdiffError(f"{path}: a Core ML package is loaded whole, not read by byte ranges")
    if is_gguf(path):
        from .gguf import check_gguf
        return {t.name: (t.offset, t.nbytes) for t in check_gguf(path).tensors}
    return safetensors.tensor_ranges(path)


def loaded_nbytes(path, compute_dtype=None, gguf_layout=None, names=None, targets=None, linear=frozenset(),
                  convs=frozenset()) -> int:
    """Bytes a weight file's tensors take once opened: a GGUF file's in its layout, a float8 safetensors file's in
    fp8.py's form, another safetensors file's as stored. `names`: only these tensors (a float8 file's in
    proportion to their stored bytes). A Core ML package's, mapped onto `targets` as open_weights maps it: its
    palettized Linear and Conv2d weights as kept, the others decoded (coreml.loaded_nbytes)."""
    if is_coreml(path):
        from . import coreml
        if targets is None:
            raise MlxdiffError(f"{path}: a Core ML package's weights are named after the traced module; give the "
                               "package as a UNet (transformer=) of a pipeline folder")
        return coreml.loaded_nbytes(path, targets if names is None else
                                    {k: v for k, v in targets.items() if k in names}, linear, convs)
    if is_gguf(path):
        from .gguf import loaded_nbytes as gguf_loaded_nbytes
        return gguf_loaded_nbytes(path, compute_dtype, gguf_layout, names=names)
    info, meta = safetensors.check_safetensors(path, with_metadata=True)
    stored = {k: safetensors.nbytes(dtype, shape) for k, (dtype, shape) in info.items()}
    chosen = sum(n for k, n in stored.items() if names is None or k in names)
    if fp8.applies(info, meta):
        total = fp8.loaded_nbytes(info, meta, compute_dtype)
        return total if names is None else round(total * chosen / max(1, sum(stored.values())))
    return chosen


class TensorShape:
    """Stands in for an array where only its shape is needed (config inference from a file's header)."""

    def __init__(self, shape):
        self.shape = tuple(shape)
        self.ndim = len(self.shape)


def tensor_shapes(path) -> dict:
    """{name: TensorShape} from a safetensors or GGUF header (a Core ML package's program: its const names, which
    coreml.read_diffusers maps), without reading any tensor."""
    if is_coreml(path):
        from . import coreml
        return {k: TensorShape(shape) for k, shape in coreml.shapes(path).items()}
    if is_gguf(path):
        from .gguf import check_gguf
        return {t.name: TensorShape(t.shape) for t in check_gguf(path).tensors}
    return {k: TensorShape(shape) for k, (_, shape) in safetensors.check_safetensors(path).items()}


def tensor_nbytes(path) -> dict:
    """{name: bytes as stored} from a safetensors or GGUF header (a Core ML package's program), without reading any
    tensor."""
    if is_coreml(path):
        from . import coreml
        return coreml.nbytes(path)
    if is_gguf(path):
        from .gguf import check_gguf
        return {t.name: t.nbytes for t in check_gguf(path).tensors}
    return {k: safetensors.nbytes(dtype, shape) for k, (dtype, shape) in safetensors.check_safetensors(path).items()}
