"""The embedded default model: weights/klein-shapes, a 15 MB FLUX.2-klein-architecture pipeline trained here to
draw coloured shapes at 64x64 (tools/train_klein_shapes; weights/klein-shapes/README.md says how it was trained and how well it
draws). It is committed with the code, so `python -m mlxdiff.generate` draws something real offline, in seconds.
"""

from pathlib import Path

from . import switches
from .errors import MlxdiffError

ROOT = Path(__file__).resolve().parent.parent
FOLDER = ROOT / "weights" / "klein-shapes"
PROMPT = "a large red circle on the left and a large blue square on the right on a white background"
NOTICE = ("a 15 MB model trained here that draws 64x64 coloured shapes: circle, square, triangle or diamond; red, "
          "yellow, green, cyan, blue or magenta; left, right, top, bottom or centre; on white, black or gray")


def weights_dir() -> Path:
    """The local model store (convert writes here): MLXDIFF_WEIGHTS, else weights/ beside the package."""
    return Path(switches.read().get("MLXDIFF_WEIGHTS", ROOT / "weights"))


def folder() -> Path:
    """The default model's folder; a clear error where the checkout does not have it."""
    if not (FOLDER / "model_index.json").exists():
        raise MlxdiffError(f"{FOLDER}: the embedded default model is missing (it ships in the git checkout under "
                           "weights/klein-shapes); clone the repository or pass --model")
    return FOLDER
