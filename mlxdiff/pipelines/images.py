"""Images out: the postprocess step of diffusers' VaeImageProcessor (writing them is the CLI's: cli.save_png)."""

import numpy as np
from PIL import Image


def to_pil(images_nchw: np.ndarray) -> list:
    """[0, 1] float NCHW -> PIL images, rounding as diffusers' numpy_to_pil does."""
    arr = (np.transpose(images_nchw, (0, 2, 3, 1)) * 255).round().astype("uint8")
    return [Image.fromarray(a) for a in arr]
