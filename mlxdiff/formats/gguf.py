"""GGUF files read with their weights kept quantized, as MLX affine (scale * code + bias) triplets or as the file's
own blocks ("raw", decoded per layer), in the layout the run asks for (_forms).

The reader in pieces: gguf_header.py (check_gguf, the checked header, and metadata_value, its typed keys),
gguf_blocks.py (each GGUF type's blocks: decoders, affine forms, decode_rows), gguf_layers.py (RawLinear,
RawEmbedding), and here the loading: `load_gguf` (every tensor read from the validated ranges of the file),
`standins` (their forms from the header alone, for a streamed model), `loaded_nbytes` (their size once loaded).
Every public name of those pieces is importable from here too.

Tensor bytes are read through a numpy memmap of exactly the validated ranges (what GGUFReader does too, without its
per-metadata-element cost: 13 s and 0.9 GB RSS for a 786k-entry tokenizer), converted a slab of blocks of one
fixed size at a time, written in place (never a float copy of a whole tensor). Any type outside gguf_blocks.SUPPORTED
is refused with one error naming the tensor and its type, before anything is converted; a tensor whose 16-bit scales
would overflow keeps float32 ones. 1-D quantized tensors (biases, norm scales; rare) are returned dequantized, in
the scales' dtype.
"""

import math
import mmap
from collections import deque

from .. import backend
import mlx.core as mx
import numpy as np

from ..errors import MlxdiffError
from ..pacing import pace, settle
from .gguf_blocks import (AFFINE, FLOAT, LAYOUTS, PLAIN, PLAIN_NUMPY, RAW_BY_DEFAULT, REQUANTIZED,  # noqa: F401
                          SUPPORTED, convert_slab, decode_rows, pack_codes, scale_dtype)
from .gguf_header import (BLOCKS, GGML_TYPES, GGUFHeader, GGUFTensorInfo, check_gguf, metadata_value,  # noqa: F401
                          reuse_headers)
from .gguf_layers import RawEmbedding, RawLinear, use_raw_layers  # noqa: F401
from .quantized import QuantizedTensor, RawBlocks

CHUNK_WEIGHTS = 1 << 22             # weights converted per slab of blocks (on the CPU)
GPU_CHUNK_WEIGHTS = 1 << 25         # on a GPU, where each slab costs a round trip (FLUX.2-dev: 1000 slabs)


def chunk_weights() -> int:
    return CHUNK_WEIGHTS if mx.default_device() == mx.cpu else GPU_CHUNK_WEIGHTS


def _slabs(blocks, block):
    """(slab size, [(first block, blocks written)]) for a tensor of `blocks` blocks of `block` weights.

    Every slab of a load has the same size (chunk_weights() weights; a tensor smaller than that, the next power of
    two of its blocks, zero-padded), and the last one ends at the tensor's end, overlapping the one before: so
    each slab's transient buffers come back from MLX's cache, sized alike, instead of returning to the device's
    memory pool at odd sizes between the weights kept, which fragmented it (bench/RESULTS.md, "The footprint the
    user sees": 3.2 GiB of FLUX.2-dev's CUDA pool held and unused)."""
    per = max(1, chunk_weights() // block)
    if blocks <= per:
        return 1 << (blocks - 1).bit_length(), [(0, blocks)]
    return per, [(min(first, blocks - per), per) for first in range(0, blocks, per)]


def _slab_array(data, first, count, size):
    """Blocks [first, first + count) of `data` ([blocks, block bytes]) as an MLX array of `size` blocks."""
    piece = data[first:first + count]
    if count < size:
        piece = np.concatenate([piece, np.zeros((size - count, piece.shape[1]), piece.dtype)])
    return mx.array(piece)


def _raw(path, info, data):
    """The tensor's blocks as they are in the file, checked to decode to finite weights (a slab at a time)."""
    block, block_bytes = BLOCKS[info.type_name]
    k = info.shape[-1]
    blocks = mx.array(np.ascontiguousarray(data).reshape(-1, k // block * block_bytes))
    mx.eval(blocks)
    flat = blocks.reshape(-1, block_bytes)
    _, slabs = _slabs(flat.shape[0], block)
    finite = []
    for first, count in slabs:   # views of the blocks (a tensor smaller than a slab: the whole of it)
        slab = flat[first:first + count]
        finite.append(pace(mx.all(mx.isfinite(FLOAT[info.type_name](slab[:, None, :])))))
    settle()
    if not all(f.item() for f in finite):   # one check per tensor, not a round trip per slab
        raise MlxdiffError(f"{path}: tensor {info.name!r} ({info.type_name}) has non-finite scales; the file is "
                           "corrupt, re-download it")
    return RawBlocks(blocks, info.type_name, tuple(info.shape), decode_rows)


def _quantized(path, info, data, sdtype):
    """Convert one quantized tensor a slab of blocks at a time (_slabs), each written in place into the tensor's
    outputs, allocated once (no chunks to concatenate). Returns a QuantizedTensor (2-D for a 1-D tensor: one
    row)."""
    type_name = info.type_name
    block, block_bytes = BLOCKS[type_name]
    bits, group = (AFFINE.get(type_name) or REQUANTIZED[type_name])[1:]
    flat = data.reshape(-1, block_bytes)
    blocks = flat.shape[0]
    words = block * bits // 32
    n = blocks * block
    w_out = mx.zeros((blocks * words,), mx.uint32)
    s_out, b_out = mx.zeros((n // group,), sdtype), mx.zeros((n // group,), sdtype)
    size, slabs = _slabs(blocks, block)
    checks = deque()
    for first, count in slabs:
        # each slab written in place (its outputs' only reference is the one here, so MLX donates the buffer) and
        # scheduled, the next one read from the file while the device converts this one; its checks read once
        # the tensor is done: a round trip per tensor, not per slab
        w, s, b = convert_slab(_slab_array(flat, first, count, size), type_name)
        n_groups = count * block // group
        finite = mx.all(mx.isfinite(s[:n_groups]) & mx.isfinite(b[:n_groups]))
        s16, b16 = s[:n_groups].astype(sdtype), b[:n_groups].astype(sdtype)
        fits = mx.all(mx.isfinite(s16) & mx.isfinite(b16))
        g = first * block // group
        if count < size:   # one zero-padded slab: the outputs are copies (a view would keep the padding)
            w_out, s_out, b_out = (mx.contiguous(a) for a in (w[:count * words], s16, b16))
        else:
            w_out[first * words:(first + count) * words] = w
            s_out[g:g + n_groups] = s16
            b_out[g:g + n_groups] = b16
        mx.async_eval(w_out, s_out, b_out, finite, fits)
        checks.append((finite, fits))
        if len(checks) > 1:
            mx.eval(checks[-2])   # at most two slabs in flight: their transient buffers, not the tensor's
    if not all(finite.item() for finite, _ in checks):
        raise MlxdiffError(f"{path}: tensor {info.name!r} ({type_name}) has non-finite scales; the file is "
                           "corrupt, re-download it")
    if not all(fits.item() for _, fits in checks):   # float16 overflow (|d| * 128 > 65504): float32 scales
        del w_out, s_out, b_out
        return _quantized(path, info, data, mx.float32)
    k = info.shape[-1]
    lead = info.shape[:-1] if len(info.shape) > 1 else (1,)
    arrays = (w_out.reshape(*lead, k * bits // 32), s_out.reshape(*lead, k // group), b_out.reshape(*lead, k // group))
    return QuantizedTensor(*arrays, bits, group, type_name)


def _forms(layout, compute_dtype):
    """(scale dtype, the GGUF types kept as raw blocks) for a layout (None: "auto"; the run policy passes
    MLXDIFF_GGUF_LAYOUT as the spec's layout)."""
    layout = layout or "auto"
    if layout not in LAYOUTS:
        raise MlxdiffError(f"GGUF layout {layout!r}: use one of {', '.join(LAYOUTS)}")
    sdtype = scale_dtype(backend.compute_dtype(compute_dtype))
    if layout == "auto":   # float32 scales (float32 compute, the CPU default) would cost 1.5 bits per weight
        layout = "raw" if sdtype == mx.float32 else "auto"
    raw_types = () if layout == "affine" else (tuple(AFFINE) + tuple(REQUANTIZED) if layout == "raw"
                                               else RAW_BY_DEFAULT)
    return sdtype, raw_types


def loaded_nbytes(path, compute_dtype=None, layout=None, names=None) -> int:
    """Bytes the tensors of a GGUF file take once `load_gguf` has read them with `layout`, from the header alone:
    plain tensors and raw blocks as stored, affine triplets as packed codes plus 16- or 32-bit scales and biases,
    quantized vectors dequantized to the scale dtype."""
    sdtype, raw_types = _forms(layout, compute_dtype)
    total = 0
    for info in check_gguf(path).tensors:
        if names is not None and info.name not in names:
            continue
        n = math.prod(info.shape)
        if info.type_name in PLAIN or (info.type_name in raw_types and len(info.shape) >= 2):
            total += info.nbytes
        elif info.type_name in SUPPORTED:
            if len(info.shape) == 1:
                total += n * sdtype.size
            else:
                bits, group = (AFFINE.get(info.type_name) or REQUANTIZED[info.type_name])[1:]
                total += n * bits // 8 + 2 * (n // group) * sdtype.size
    return total


def load_gguf(path, compute_dtype=None, layout=None, names=None) -> dict:
    """Check `path` (check_gguf), then read every tensor: {GGUF name: mx.array | QuantizedTensor}.

    Shapes are in PyTorch order. F32/F16/BF16 stay as stored; quantized types become QuantizedTensor (see the
    module docstring for each type's form); any other type is an MlxdiffError naming the tensor. Scales and biases
    are float32 for float32 compute (the default on the CPU), else float16/bfloat16 like the compute dtype.
    Each tensor is converted and evaluated before the next: the peak is what is loaded so far plus the tensor being
    converted and two slabs' transient buffers (_slabs).
    """
    header = check_gguf(path)
    unsupported = [t for t in header.tensors if t.type_name not in SUPPORTED and (names is None or t.name in names)]
    if unsupported:
        t = unsupported[0]
        more = f" (and {len(unsupported) - 1} more tensors)" if len(unsupported) > 1 else ""
        raise MlxdiffError(f"{path}: tensor {t.name!r} has GGUF type {t.type_name}{more}, which mlxdiff does not "
                           f"support; supported types: {', '.join(SUPPORTED)}. Use a file quantized with one of them")
    sdtype, raw_types = _forms(layout, compute_dtype)
    mapped = None
    try:
        if header.tensors:
            with open(path, "rb") as f:
                mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        filemap = None if mapped is None else np.frombuffer(mapped, dtype=np.uint8)
    except (OSError, ValueError) as e:
        raise MlxdiffError(f"{path}: cannot map the file ({e})") from None
    if filemap is not None and filemap.size != header.file_size:
        raise MlxdiffError(f"{path}: the file changed size while being read; try again once it is complete")
    out = {}
    for info in header.tensors:
        if names is not None and info.name not in names:   # a streamed block's tensors only (loading/streaming.py)
            continue
        if out:      # the previous tensor is converted (copied into MLX): its file pages leave this process's RSS
            _drop_pages(mapped, previous.offset, previous.nbytes)
        previous = info
        data = filemap[info.offset:info.offset + info.nbytes]   # validated by check_gguf: inside the file
        if info.type_name in PLAIN:
            arr = mx.array(data.view(PLAIN_NUMPY[info.type_name]).reshape(info.shape))
            out[info.name] = mx.view(arr, mx.bfloat16) if info.type_name == "BF16" else arr
            mx.eval(out[info.name])
            continue
        if info.type_name in raw_types and len(info.shape) >= 2:
            out[info.name] = _raw(path, info, data)
            continue
        qt = _quantized(path, info, data, sdtype)
        if len(info.shape) == 1:   # no MLX layer takes a quantized vector: dequantize it (it is small)
            qt = qt.dequantize().astype(qt.scales.dtype).reshape(info.shape)
            mx.eval(qt)
        out[info.name] = qt
    if out:
        _drop_pages(mapped, previous.offset, previous.nbytes)
    return out


def standins(path, compute_dtype=None, layout=None, names=None) -> dict:
    """What load_gguf would return, from the header alone and nothing read: each tensor (of `names`) as lazy zeros of
    the form it loads in (plain, raw blocks, affine triplets with the scale dtype, a quantized vector dequantized),
    never evaluated. A model whose blocks are streamed (loading/streaming.py) is built around these, so its layers
    get their quantized or raw forms; the streamed blocks' real weights are read (load_gguf with `names`) per use."""
    header = check_gguf(path)
    sdtype, raw_types = _forms(layout, compute_dtype)
    out = {}
    for info in header.tensors:
        if names is not None and info.name not in names:
            continue
        shape = tuple(info.shape)
        if info.type_name in PLAIN:
            out[info.name] = mx.zeros(shape, {"F32": mx.float32, "F16": mx.float16, "BF16": mx.bfloat16}[info.type_name])
            continue
        if info.type_name not in SUPPORTED:
            raise MlxdiffError(f"{path}: tensor {info.name!r} has GGUF type {info.type_name}, which mlxdiff does not "
                               f"support; supported types: {', '.join(SUPPORTED)}")
        block, block_bytes = BLOCKS[info.type_name]
        k = shape[-1]
        if info.type_name in raw_types and len(shape) >= 2:
            rows = math.prod(shape[:-1])
            out[info.name] = RawBlocks(mx.zeros((rows, k // block * block_bytes), mx.uint8), info.type_name, shape,
                                       decode_rows)
            continue
        if len(shape) == 1:
            out[info.name] = mx.zeros(shape, sdtype)
            continue
        bits, group = (AFFINE.get(info.type_name) or REQUANTIZED[info.type_name])[1:]
        lead = shape[:-1]
        out[info.name] = QuantizedTensor(mx.zeros((*lead, k * bits // 32), mx.uint32), mx.zeros((*lead, k // group),
                                         sdtype), mx.zeros((*lead, k // group), sdtype), bits, group, info.type_name)
    return out


def _drop_pages(mapped, offset, nbytes):
    """Tell the kernel this process is done with a byte range of the mapped file (MADV_DONTNEED): read through a
    mapping, a file's pages count in the process's RSS until it is unmapped, so a whole GGUF would otherwise sit
    there, as file-backed pages, beside the weights converted from it. The page cache keeps them; a page shared with
    the next tensor is read again from there."""
    if not hasattr(mmap, "MADV_DONTNEED"):
        return
    page = mmap.PAGESIZE
    start = offset // page * page
    try:
        mapped.madvise(mmap.MADV_DONTNEED, start, offset + nbytes - start)
    except (OSError, ValueError):   # an advice the platform does not take: the pages simply stay until unmapped
        pass
