"""mlxdiff: Stable Diffusion 3.5 and FLUX.2 in MLX, with a footprint of the largest phase, not the sum."""

from . import backend  # noqa: F401  (must run before anything imports mlx.core)
from .errors import MlxdiffError

__version__ = "0.1.0"


def load(model, *, transformer=None, dtype=None, quantize=None, matmul=None, keep="none", **kwargs):
    """Resolve `model` (a diffusers folder, a single file or a cached hub id) into a pipeline that holds specs,
    not weights. See mlxdiff.pipelines.load for the details."""
    from .pipelines import load as _load
    return _load(model, transformer=transformer, dtype=dtype, quantize=quantize, matmul=matmul, keep=keep, **kwargs)


__all__ = ["load", "MlxdiffError", "__version__"]
