"""Every MLXDIFF_* environment switch, in one table, read in one place (`read`).

The switches are for measurements and set-ups, not for everyday use: each one fixes a choice that the run policy
(mlxdiff/policy.py) otherwise makes from the budget. They are read when a pipeline is made (`mlxdiff.load`) or a
command starts, never at import, except the two that must act before MLX is loaded (`EARLY`). A bad value is one
`MlxdiffError` line then.

This module imports nothing of mlxdiff's and not MLX, so that backend.py can read the early ones before MLX loads.
"""

import os

# name: (what it fixes, the values it takes)
SWITCHES = {
    "MLXDIFF_IN_FLIGHT": ("paced pieces of work queued at once (policy.RunPolicy.in_flight)", "1 to 64"),
    "MLXDIFF_COMPILE_BLOCKS": ("whole transformer blocks compiled or not (RunPolicy.compile_blocks)", "0 or 1"),
    "MLXDIFF_FUSE": ("the blocks' elementwise chains compiled (models/fused.py) or plain MLX ops", "0 or 1"),
    "MLXDIFF_CUDA_KERNELS": ("mlxdiff's custom CUDA kernels (models/fused.norm_rope) or the MLX-ops path", "0 or 1"),
    "MLXDIFF_CONV_BAND": ("a VAE convolution's largest working buffer before row bands", "bytes, 0: never band"),
    "MLXDIFF_CACHE_LIMIT": ("MLX's buffer cache in a phase (policy.RunPolicy.cache_limit)", "bytes, 0: MLX's own"),
    "MLXDIFF_GGUF_LAYOUT": ("how GGUF tensors are kept (formats/gguf.py)", "auto, raw or affine"),
    "MLXDIFF_MATMUL": ("how quantized layers multiply (loading/matmul.py)", "qmm or dequantize"),
    "MLXDIFF_DEVICE": ("MLX (and the PyTorch references) on the CPU of a machine with a GPU", "cpu or gpu"),
    "MLXDIFF_PHASE_MARKERS": ("phase marker lines on stderr for mlxdiff.footprint", "1 (or unset)"),
    "MLXDIFF_NO_OPENBLAS": ("mlx-cpu's own BLAS instead of Debian's OpenBLAS (bench/cpu_backend.py)", "1 (or unset)"),
    "MLXDIFF_WEIGHTS": ("the local model store (default: weights/ beside the package)", "a folder"),
}
EARLY = ("MLXDIFF_NO_OPENBLAS", "MLXDIFF_DEVICE")   # act at import: before MLX loads, and MLX's default device


def read(environ=None) -> dict:
    """{name: value} of the switches that are set (empty values count as unset)."""
    environ = os.environ if environ is None else environ
    return {name: environ[name] for name in SWITCHES if environ.get(name)}
