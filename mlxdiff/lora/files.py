"""Reading a LoRA file (the path, the safetensors gate, the stored dtypes) and checking its values (finite, within
the compute dtype, and so is each layer's weight change)."""

import math
import stat
from pathlib import Path

import mlx.core as mx

from ..errors import MlxdiffError
from ..formats.safetensors import CHECK_BATCH_ELEMENTS, check_safetensors, load_safetensors


def _short(name, limit=100):
    return name if len(name) <= limit else name[:limit] + "..."


def _lora_path(path) -> Path:
    """`path` if it names a regular .safetensors file, else one line saying what it is."""
    path = Path(path)
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise MlxdiffError(f"{path}: LoRA file not found") from None
    except OSError as e:
        raise MlxdiffError(f"{path}: cannot read the LoRA file ({e.strerror or e})") from None
    if stat.S_ISDIR(mode):
        raise MlxdiffError(f"{path}: is a folder; expected a .safetensors LoRA file")
    if not stat.S_ISREG(mode):
        kind = ("a character device" if stat.S_ISCHR(mode) else "a block device" if stat.S_ISBLK(mode)
                else "a FIFO (named pipe)" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode)
                else "not a file")
        raise MlxdiffError(f"{path}: is {kind}, not a regular file; expected a .safetensors LoRA file")
    if path.suffix != ".safetensors":
        raise MlxdiffError(f"{path}: expected a .safetensors LoRA file (LoRAs are read from safetensors files only; "
                           f"this is {'a ' + path.suffix if path.suffix else 'a file without a suffix'})")
    return path


# what a LoRA file's tensors may be stored as: its factors in a float type every tool computes with (diffusers'
# kohya conversion cannot even scale float8 ones), its alphas also as integers
FACTOR_DTYPES = ("F32", "F16", "BF16")
ALPHA_DTYPES = (*FACTOR_DTYPES, "I8", "I16", "I32", "I64", "U8", "U16", "U32", "U64")


def _read(path):
    """(lazy {name: array}, header metadata, {name: stored dtype}) of a LoRA file, checked by the safetensors
    gate."""
    path = _lora_path(path)
    info, meta = check_safetensors(path, with_metadata=True)
    if not info:
        raise MlxdiffError(f"{path}: the LoRA file holds no tensors")
    return load_safetensors(path, info=info), meta, {k: dtype for k, (dtype, _) in info.items()}


def _magnitudes(named):
    """{key: max |value|} of each (key, array) (inf where it holds a NaN or an infinity), a batch of tensors per
    evaluation: every LoRA tensor is read whole, it is the file's own bytes."""
    out, batch, size = {}, [], 0

    def flush():
        if batch:
            values = mx.stack([m for _, m in batch]).tolist()
            out.update((k, v) for (k, _), v in zip(batch, values))
            batch.clear()
    for key, a in named:
        batch.append((key, mx.max(mx.where(mx.isfinite(a), mx.abs(a), mx.inf)).astype(mx.float32)))
        size += a.size
        if size >= CHECK_BATCH_ELEMENTS:
            flush()
            size = 0
    flush()
    return out


def _check_values(path, planned, dtype):
    """Every factor finite and within `dtype`, and |scale| x rank x max|A| x max|B| (a bound on each element of the
    layer's weight change) too: a LoRA that passes cannot make a layer's output NaN or infinite by itself."""
    arrays = {}
    for _, key_a, key_b, a, b, *_ in planned:   # B whole (a fused layer's parts are row ranges of it)
        arrays.setdefault(key_a, a)
        arrays.setdefault(key_b, b)
    mags = _magnitudes(arrays.items())
    for key, m in mags.items():
        if not math.isfinite(m):
            raise MlxdiffError(f"{path}: LoRA tensor {_short(key)!r} holds NaN or infinite values; the file is damaged "
                               "(or its training diverged): use another LoRA file")
    top = mx.finfo(dtype).max
    name = str(dtype).rsplit(".", 1)[-1]
    for key, m in mags.items():
        if m > top:
            raise MlxdiffError(f"{path}: LoRA tensor {_short(key)!r} has values beyond {name}'s range (|x| up to "
                               f"{m:.3g}); compute in float32 or bfloat16 (--dtype), or use another LoRA file")
    for target, key_a, key_b, a, _, _, s, *_ in planned:
        bound = abs(s) * a.shape[0] * mags[key_a] * mags[key_b]
        if not bound <= top:
            raise MlxdiffError(f"{path}: layer {target!r}: scale {s:.3g} x {_short(key_a)!r} x {_short(key_b)!r} can "
                               f"reach {bound:.3g}, beyond {name}'s range; the LoRA's alpha (or the scale) is far too "
                               "large")
