"""mlxdiff: Stable Diffusion 3.5, FLUX.2, SDXL and SD 1.x in MLX, with a footprint of the largest phase, not the sum."""

from . import backend  # noqa: F401  (must run before anything imports mlx.core)
from .arguments import check_load
from .errors import MlxdiffError

__version__ = "0.1.0"


def load(model=None, *, transformer=None, dtype=None, text_encoders=None, quantize=None, matmul=None, keep="none",
         text_encoder=None, vae=None, tokenizer=None, loras=None, memory_limit=None, group=None, prediction_type=None,
         split=None, download=True, revision=None, variant=None, controlnets=None, **unknown):
    """Resolve `model` (a diffusers folder, a single file or a hub id, fetched into the Hugging Face cache unless
    download=False, at `revision`, of weight `variant`; None for FLUX.2 from its transformer,
    text encoder and VAE files alone) into a pipeline that holds specs, not weights. See mlxdiff.pipelines.load for
    the details; the arguments are checked first (arguments.py)."""
    from .pipelines import load as _load  # heavy: the pipelines import MLX and every family (about 0.6 s); `import mlxdiff` stays light
    for name in unknown:
        raise MlxdiffError(f"{name}=: not an argument of mlxdiff.load")
    check_load(model, transformer, text_encoders, quantize, text_encoder, vae=vae, tokenizer=tokenizer, loras=loras)
    return _load(model, transformer=transformer, dtype=dtype, text_encoders=text_encoders, quantize=quantize,
                 matmul=matmul, keep=keep, text_encoder=text_encoder, vae=vae, tokenizer=tokenizer, loras=loras,
                 memory_limit=memory_limit, group=group, prediction_type=prediction_type,
                 download=download, revision=revision, variant=variant, controlnets=controlnets,
                 **({} if split is None else {"split": split}))


def __getattr__(name):
    """mlxdiff.Cancelled (what generate raises when on_step returns False or cancel() is called), imported on first
    use so that `import mlxdiff` stays light."""
    if name == "Cancelled":
        from .pipelines.base import Cancelled  # heavy: pipelines.base imports MLX; `import mlxdiff` stays light
        return Cancelled
    raise AttributeError(f"module 'mlxdiff' has no attribute {name!r}")


__all__ = ["load", "Cancelled", "MlxdiffError", "__version__"]
