"""Images out: the postprocess step of diffusers' VaeImageProcessor, and atomic PNG writing with metadata."""

import os
import tempfile
from pathlib import Path

import numpy as np

from ..errors import MlxdiffError


def to_pil(images_nchw: np.ndarray) -> list:
    """[0, 1] float NCHW -> PIL images, rounding as diffusers' numpy_to_pil does."""
    from PIL import Image
    arr = (np.transpose(images_nchw, (0, 2, 3, 1)) * 255).round().astype("uint8")
    return [Image.fromarray(a) for a in arr]


def check_writable(path) -> Path:
    """Fail before any work if the output cannot be written."""
    path = Path(path)
    parent = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise MlxdiffError(f"{path}: output path is a folder; give a file name such as {path / 'out.png'}")
    if not parent.is_dir():
        raise MlxdiffError(f"{path}: output folder {parent} does not exist; create it first")
    if not os.access(parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise MlxdiffError(f"{path}: output is not writable; choose another --output")
    return path


def save_png(image, path, parameters: dict) -> Path:
    """Write atomically (temp file + rename), so a failure never leaves a partial PNG."""
    from PIL.PngImagePlugin import PngInfo
    path = check_writable(path)
    info = PngInfo()
    info.add_text("parameters", "; ".join(f"{k}: {v}" for k, v in parameters.items()))
    for k, v in parameters.items():
        info.add_text(f"mlxdiff:{k}", str(v))
    fd, tmp = tempfile.mkstemp(prefix=".mlxdiff-", suffix=".png", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            image.save(f, format="PNG", pnginfo=info)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; an image should get the usual permissions
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path
