"""File formats, below the models: every weight file is opened here, and nothing here imports a model.

Each format is one row of `FORMATS` (table.py: a `WeightFormat`), and `format_of(path)` the one lookup of it: a
safetensors file goes through the gate (safetensors.py); one with float8 weights or ComfyUI's fp8 markers through
fp8.py (its fp8 weights stay at 8 bits, scales folded in); a GGUF file through its own checked reader (gguf.py, on
gguf_header / gguf_blocks / gguf_layers), whose quantized tensors stay quantized (quantized.py); a Core ML package
(an .mlpackage folder coremltools made from a diffusers UNet) through coreml.py (on coreml_mil / coreml_weights), its
palettized Linear weights kept palettized (formats/palettized.py). A package is a weight "file" where a UNet file may
be given (its row's `only_as`); its names are the traced module's, mapped onto the model's by `targets`
(coreml.open_diffusers). Key-map tables (keymaps.py) rename what the readers return. The functions below ask the
path's row; what else the package asks of a format (is it a package, does it convert as it opens, ...) is the row's
fields.

A reader's `compute_dtype` is its own parameter: the dtype it converts what it reads to (decoded GGUF blocks, float8
scales folded in; None: backend.compute_dtype's default), given by its caller. The run's compute dtype is chosen once,
in its policy (mlxdiff/policy.py), and read by loading/, not here.
"""

from pathlib import Path

from ..errors import MlxdiffError
from ..files import file_kind
from .table import (COREML, FILE_SUFFIXES, FORMATS, GGUF, Request, WeightFormat, claimed, format_of,  # noqa: F401
                    reuse_headers)

WEIGHT_SUFFIXES = FILE_SUFFIXES               # (".safetensors", ".gguf")
COREML_SUFFIX = COREML.suffix
PACKAGE_WHATS = COREML.only_as                # where a Core ML package may stand for the weights file (SD's UNet)
_ONE_FILE = " or ".join(FILE_SUFFIXES)        # ".safetensors or .gguf", as the lines below say it


def is_gguf(path) -> bool:
    """By the path alone: format_of(path, header=False) is GGUF (what only GGUF files are: llama.cpp-named T5
    encoders, encoders without a tekken vocabulary: loading/component_files.py)."""
    return format_of(path, header=False) is GGUF


def is_coreml(path) -> bool:
    """A Core ML package: an .mlpackage folder (formats/coreml.py)."""
    return format_of(path, header=False) is COREML


def check_weight_file(path, what="weights file") -> Path:
    """A path that names an existing .safetensors or .gguf file (or a package folder where its row may stand for
    `what`), or one line saying what is wrong."""
    path = Path(path)
    try:
        kind = file_kind(path.stat().st_mode)
    except FileNotFoundError:
        raise MlxdiffError(f"{path}: {what} not found") from None
    except OSError as e:
        raise MlxdiffError(f"{path}: cannot read the {what} ({e.strerror or e})") from None
    fmt = format_of(path, header=False)
    if fmt.folder:
        if what not in fmt.only_as:   # the Core ML packages of diffusion models are SD UNets (Apple's converter's)
            raise MlxdiffError(f"{path}: a Core ML package is read only as an SD 1.x / SDXL UNet (transformer=); "
                               f"the {what} must be one {_ONE_FILE} file")
        if kind != "a folder":
            raise MlxdiffError(f"{path}: is {kind or 'a file'}; a Core ML package is the .mlpackage folder "
                               "coremltools saves")
        return path
    if kind == "a folder":
        raise MlxdiffError(f"{path}: is a folder; expected a {_ONE_FILE} {what}")
    if kind is not None:
        raise MlxdiffError(f"{path}: is {kind}, not a regular file; give the {_ONE_FILE} {what} itself")
    if path.suffix not in WEIGHT_SUFFIXES:
        raise MlxdiffError(f"{path}: expected a {_ONE_FILE} {what}")
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
    required), the palettized weights of the names in `linear` and `convs` kept palettized (coreml.open_diffusers);
    read whole (no stand-ins: its blocks are not streamed)."""
    fmt, header = claimed(path)
    request = Request(compute_dtype, gguf_layout, names, targets, linear, convs)
    return (fmt.standins if standins else fmt.open)(path, header, request)


def tensor_ranges(path) -> dict:
    """{name: (byte offset, bytes)} of every tensor of a safetensors or GGUF file, from its checked header."""
    return format_of(path, header=False).ranges(path)


def loaded_nbytes(path, compute_dtype=None, gguf_layout=None, names=None, targets=None, linear=frozenset(),
                  convs=frozenset()) -> int:
    """Bytes a weight file's tensors take once opened: a GGUF file's in its layout, a float8 safetensors file's in
    fp8.py's form, another safetensors file's as stored. `names`: only these tensors (a float8 file's in
    proportion to their stored bytes). A Core ML package's, mapped onto `targets` as open_weights maps it: its
    palettized Linear and Conv2d weights as kept, the others decoded (coreml.loaded_nbytes)."""
    fmt, header = claimed(path)
    return fmt.loaded_nbytes(path, header, Request(compute_dtype, gguf_layout, names, targets, linear, convs))


class TensorShape:
    """Stands in for an array where only its shape is needed (config inference from a file's header)."""

    def __init__(self, shape):
        self.shape = tuple(shape)
        self.ndim = len(self.shape)


def tensor_shapes(path) -> dict:
    """{name: TensorShape} from a safetensors or GGUF header (a Core ML package's program: its const names, which
    coreml.read_diffusers maps), without reading any tensor."""
    return {k: TensorShape(shape) for k, shape in format_of(path, header=False).shapes(path).items()}


def tensor_nbytes(path) -> dict:
    """{name: bytes as stored} from a safetensors or GGUF header (a Core ML package's program), without reading any
    tensor."""
    return format_of(path, header=False).nbytes(path)
