"""mlx-lm's model files, without the mlx_lm package's __init__.

`import mlx_lm.models.qwen3` runs mlx_lm/__init__.py first, which imports mlx-lm's command-line tools (convert,
generate) and through them transformers and torch: seconds and hundreds of MB in every run that reads an LLM text
encoder (bench/RESULTS.md, "The first image per process"). The model files need none of that: they import only mlx
and each other (relative imports inside mlx_lm/models/). So they are loaded here as the submodules of a private
package over mlx-lm's own models/ folder: mlx-lm's code, unchanged, and the real `mlx_lm` package (which an app may
import beside mlxdiff) untouched in sys.modules."""

import importlib
import importlib.util
import sys
from pathlib import Path

PACKAGE = __name__ + "._files"     # mlxdiff.models.mlx_lm_models._files.<model file>


def _package():
    if PACKAGE not in sys.modules:
        spec = importlib.util.find_spec("mlx_lm")     # finds the installed package; runs none of it
        if spec is None or not spec.submodule_search_locations:
            raise ImportError("mlx-lm is not installed: pip install mlx-lm")
        folder = Path(list(spec.submodule_search_locations)[0]) / "models"
        package = importlib.util.spec_from_file_location(PACKAGE, folder / "__init__.py",
                                                         submodule_search_locations=[str(folder)])
        module = importlib.util.module_from_spec(package)
        sys.modules[PACKAGE] = module
        package.loader.exec_module(module)
    return sys.modules[PACKAGE]


def model_file(name: str):
    """mlx_lm/models/<name>.py (llama, qwen2, qwen3, base, ...), loaded without mlx_lm/__init__.py."""
    _package()
    return importlib.import_module(f"{PACKAGE}.{name}")


llama, qwen2, qwen3, base = (model_file(name) for name in ("llama", "qwen2", "qwen3", "base"))
