"""The weight formats, one `WeightFormat` row each in FORMATS; `format_of(path)` is the one lookup that says which.

A row claims a path by its suffix and, where rows share one (a float8 safetensors file and a plain one), by the
file's checked header (`claims`). It gives its readers, each called with the path and, for a row that `header`
reads one, that checked header (read once per call: the readers never parse it again), and what the rest of the
package asks of a file's format instead of testing its type: whether a Core ML package stands for the file
(`folder`, `only_as`), whether its names are a traced program's (`targets`), whether opening it reads and converts
(`converts`), whether its quantized tensors load as stored (`kept_quantized`) and what then makes it smaller
(`smaller`), whether a text encoder of it shards, its metadata, how its streamed blocks reuse its parsed headers.
Adding a format: its reader file and one row here.

formats.gguf is imported only when a GGUF row calls it: it imports gguf-py, heavy at import.
"""

from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..errors import MlxdiffError
from . import coreml, fp8, safetensors


@dataclass(frozen=True)
class WeightFormat:
    name: str
    suffix: str                            # the path's suffix it claims
    shapes: Callable                       # (path) -> {name: shape as stored}, from the header alone
    nbytes: Callable                       # (path) -> {name: bytes as stored}, from the header alone
    open: Callable                         # (path, header, request) -> {name: mx.array | a kept form (quantized.py)}
    loaded_nbytes: Callable                # (path, header, request) -> bytes `open` holds, from the header alone
    ranges: Callable                       # (path) -> {name: (byte offset, bytes)}: where a streamed block lies
    standins: Callable                     # (path, header, request) -> `open`'s forms with nothing read, for a
                                           # model whose blocks are streamed (loading/streaming.py) to be built around
    header: Callable | None = None         # (path) -> the checked header its `claims` and readers take
    claims: Callable | None = None         # (header) -> whether it is this row's, among the rows of its suffix
    folder: bool = False                   # the path is a package folder, not one file
    only_as: tuple | None = None           # the `what`s (check_weight_file) it may stand for; None: any weights file
    targets: bool = False                  # named after a traced program: opened onto the model's own names, which
                                           # the reader needs (ComponentSpec.diffusers_targets)
    converts: bool = False                 # opening reads and converts every tensor it opens (nothing mapped
                                           # lazily): only a component's own tensors are opened, and their values
                                           # are checked as they are read and built, not before
    kept_quantized: bool = False           # its quantized tensors load as stored, in a layout (ComponentSpec's
                                           # gguf_layout): the loaded size is the header's, whatever quantize= says
    smaller: str = ""                      # with kept_quantized: what makes a component of it fit where
                                           # quantize= cannot (memory.fit_hint's refusal)
    shards: bool = True                    # a text encoder in it splits over the ranks of a tensor-parallel run
    metadata: Callable | None = None       # (path) -> its header's metadata, for a config read off it; None: none
    reuse_headers: Callable | None = None  # (cache) -> a context in which its parsed headers are kept in `cache`


@dataclass(frozen=True)
class Request:
    """What a reader is asked for: the compute dtype, the GGUF layout, only these tensor names, and for a package
    named after a traced program its targets ({diffusers name: PyTorch shape}) and the Linear / Conv2d weights kept
    palettized."""
    compute_dtype: object = None      # the reader's target dtype for what it converts (formats/__init__.py)
    gguf_layout: str | None = None
    names: object = None
    targets: dict | None = None
    linear: frozenset = frozenset()
    convs: frozenset = frozenset()

    def chosen(self, arrays: dict) -> dict:
        return arrays if self.names is None else {k: v for k, v in arrays.items() if k in self.names}

    def wanted_targets(self, path) -> dict:
        if self.targets is None:
            raise MlxdiffError(f"{path}: a Core ML package's weights are named after the traced module; give the "
                               "package as a UNet (transformer=) of a pipeline folder")
        return self.chosen(self.targets)


# -- safetensors: plain, or float8 (ComfyUI's layouts; fp8.py) -----------------------------------------------------

def _st_header(path):
    return safetensors.check_safetensors(path, with_metadata=True)


def _st_shapes(path) -> dict:
    return {k: shape for k, (_, shape) in safetensors.check_safetensors(path).items()}


def _st_nbytes(path) -> dict:
    return {k: safetensors.nbytes(dtype, shape) for k, (dtype, shape) in safetensors.check_safetensors(path).items()}


def _st_open(path, header, request):
    return request.chosen(safetensors.load_safetensors(path, info=header[0]))


def _stored_nbytes(info, names) -> tuple:
    """(bytes of the tensors in `names`, bytes of all) as stored."""
    stored = {k: safetensors.nbytes(dtype, shape) for k, (dtype, shape) in info.items()}
    return sum(n for k, n in stored.items() if names is None or k in names), sum(stored.values())


def _st_loaded_nbytes(path, header, request):
    return _stored_nbytes(header[0], request.names)[0]


def _fp8_open(path, header, request):
    return request.chosen(fp8.load(path, *header, request.compute_dtype))


def _fp8_loaded_nbytes(path, header, request):
    """fp8.py's form of the file; of `names` only, in proportion to their stored bytes."""
    total = fp8.loaded_nbytes(*header, request.compute_dtype)
    if request.names is None:
        return total
    chosen, stored = _stored_nbytes(header[0], request.names)
    return round(total * chosen / max(1, stored))


SAFETENSORS_FILE = dict(suffix=".safetensors", shapes=_st_shapes, nbytes=_st_nbytes,
                        ranges=safetensors.tensor_ranges, header=_st_header)
# a safetensors file's stand-ins are its lazy mapped arrays: nothing is read until one is evaluated
FP8 = WeightFormat("fp8", **SAFETENSORS_FILE, open=_fp8_open, loaded_nbytes=_fp8_loaded_nbytes, standins=_fp8_open,
                   claims=lambda header: fp8.applies(*header))
SAFETENSORS = WeightFormat("safetensors", **SAFETENSORS_FILE, open=_st_open, loaded_nbytes=_st_loaded_nbytes,
                           standins=_st_open)


# -- GGUF (gguf.py) ------------------------------------------------------------------------------------------------

def _gguf_tensors(path):
    from .gguf import check_gguf  # heavy: formats.gguf imports the gguf package (~0.7 s)
    return check_gguf(path).tensors


def _gguf_reader(name):
    def read(path, header, request):
        from . import gguf  # heavy: formats.gguf imports the gguf package (~0.7 s)
        return getattr(gguf, name)(path, request.compute_dtype, request.gguf_layout, names=request.names)
    return read


def _gguf_metadata(path) -> dict:
    from .gguf import check_gguf  # heavy: formats.gguf imports the gguf package (~0.7 s)
    return check_gguf(path).metadata


def _gguf_reuse_headers(cache):
    from .gguf import reuse_headers  # heavy: formats.gguf imports the gguf package (~0.7 s)
    return reuse_headers(cache)


GGUF = WeightFormat(
    "gguf", ".gguf",
    shapes=lambda path: {t.name: t.shape for t in _gguf_tensors(path)},
    nbytes=lambda path: {t.name: t.nbytes for t in _gguf_tensors(path)},
    ranges=lambda path: {t.name: (t.offset, t.nbytes) for t in _gguf_tensors(path)},
    open=_gguf_reader("load_gguf"), standins=_gguf_reader("standins"), loaded_nbytes=_gguf_reader("loaded_nbytes"),
    converts=True, kept_quantized=True,
    smaller="use a GGUF file of a smaller quantization type (e.g. Q3_K_M or Q2_K)",
    shards=False,   # a GGUF text encoder's split is not tested yet: it stays whole
    metadata=_gguf_metadata, reuse_headers=_gguf_reuse_headers)


# -- Core ML packages (coreml.py) ----------------------------------------------------------------------------------

def _coreml_open(path, header, request):
    return coreml.open_diffusers(path, request.wanted_targets(path), request.linear, request.convs)


def _coreml_loaded_nbytes(path, header, request):
    return coreml.loaded_nbytes(path, request.wanted_targets(path), request.linear, request.convs)


def _coreml_standins(path, header, request):
    request.wanted_targets(path)
    raise MlxdiffError(f"{path}: a Core ML package is loaded whole, not streamed block by block; free memory or give "
                       "the UNet as a safetensors file")


def _coreml_ranges(path):
    raise MlxdiffError(f"{path}: a Core ML package is loaded whole, not read by byte ranges")


def _coreml(name):
    def read(path):
            return getattr(coreml, name)(path)
    return read


COREML = WeightFormat(
    "coreml", ".mlpackage", shapes=_coreml("shapes"), nbytes=_coreml("nbytes"), open=_coreml_open,
    loaded_nbytes=_coreml_loaded_nbytes, standins=_coreml_standins, ranges=_coreml_ranges,   # read whole
    folder=True, only_as=("transformer file",),   # SD's UNet
    targets=True, converts=True, shards=False)


FORMATS = (FP8, SAFETENSORS, GGUF, COREML)   # a row with `claims` before the others of its suffix
FILE_SUFFIXES = tuple(dict.fromkeys(f.suffix for f in FORMATS if not f.folder))   # .safetensors, .gguf
DEFAULT_SUFFIX = ".safetensors"   # a file of any other suffix is read as safetensors: the gate refuses what is not


def format_of(path, header=None) -> WeightFormat:
    """The row that claims `path`: the row of its suffix; where rows share one (fp8, safetensors), the first whose
    `claims` takes the file's checked header (`header`: that header, when the caller has it; else read here).
    `header=False`: by the path alone, the row of its suffix without a `claims`: what every row of that suffix says
    alike, all but their readers (tests/test_formats_table.py checks that they do)."""
    suffix = Path(path).suffix
    rows = [f for f in FORMATS if f.suffix == suffix] or [f for f in FORMATS if f.suffix == DEFAULT_SUFFIX]
    if header is False:
        return next(f for f in rows if f.claims is None)
    if len(rows) > 1:
        header = rows[0].header(path) if header is None else header
        rows = [f for f in rows if f.claims is None or f.claims(header)]
    return rows[0]


def claimed(path) -> tuple:
    """(the row that reads `path`, the checked header it read to claim it, which its readers take: None for a row
    that reads none): the header is read once."""
    fmt = format_of(path, header=False)
    if fmt.header is None:
        return fmt, None
    header = fmt.header(path)
    return format_of(path, header), header


@contextmanager
def reuse_headers(cache: dict):
    """Within it, each format that parses headers of its own keeps them in `cache` (a streamed block re-reads its
    file at every use: loading/streaming.py); everywhere else every call parses the file again."""
    with ExitStack() as stack:
        for fmt in FORMATS:
            if fmt.reuse_headers is not None:
                stack.enter_context(fmt.reuse_headers(cache))
        yield
