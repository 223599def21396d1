"""The architecture registry, found by convention (as mlx-lm finds a model by its module's name): every module of
this package that meets protocol.Architecture (ModelArgs, Model and CLASS_NAMES: the diffusers / transformers class
names it reads) is an architecture; nothing lists them by hand, so a new architecture is its file alone.

ARCHITECTURES: class name -> module (loading/spec.py hands it on; what mlxdiff.convert saves a component as is its
module's first CLASS_NAMES entry). LORA_DENOISERS: the modules LoRAs apply to (protocol.LoRADenoiser) in rising
LORA_ORDER, the order their LORA_ARCHITECTURE_PATTERNS are tried in (the first row a layer name matches says which
architectures a LoRA fits) and lora's messages list them in. Both sit here, below lora/ and loading/, so that those
read the registry instead of keeping lists of their own.
"""

import importlib
import pkgutil
from pathlib import Path

from . import protocol

# this package's modules that are the registry's own machinery, never an architecture
_NOT_ARCHITECTURES = ("protocol", "registry")


def architecture_modules() -> tuple:
    """The modules of mlxdiff.models that meet protocol.Architecture, by module name (the others are layers and
    helpers the architectures share)."""
    names = sorted(info.name for info in pkgutil.iter_modules([str(Path(__file__).parent)])
                   if info.name not in _NOT_ARCHITECTURES)
    modules = [importlib.import_module(f"{__package__}.{name}") for name in names]
    for module in modules:
        # a module that declares CLASS_NAMES means to be an architecture: one lacking the rest is a mistake to name
        # at import, not a family that silently goes missing
        missing = [m for m in ("ModelArgs", "Model") if not hasattr(module, m)]
        if hasattr(module, "CLASS_NAMES") and missing:
            raise ImportError(f"{module.__name__} declares CLASS_NAMES but has no {' or '.join(missing)}: an "
                              "architecture module needs both (models/protocol.Architecture)")
    return tuple(module for module in modules if isinstance(module, protocol.Architecture))


MODULES = architecture_modules()
ARCHITECTURES = {name: module for module in MODULES for name in module.CLASS_NAMES}
LORA_DENOISERS = tuple(sorted((m for m in MODULES if isinstance(m, protocol.LoRADenoiser)),
                              key=lambda m: m.LORA_ORDER))
