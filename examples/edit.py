"""Editing with reference images (FLUX.2 dev and klein, as diffusers' Flux2Pipeline(image=...)): each reference is
VAE-encoded and rides beside the noise as extra tokens; the output size defaults to the first reference's.

    python examples/edit.py [MODEL]      (default: the embedded default model, weights/klein-shapes)

The embedded model was not trained on references, so it mostly redraws the prompt; a real FLUX.2 model edits.
"""

import sys

import mlxdiff
from mlxdiff import default_model


def main(model=None):
    pipe = mlxdiff.load(model or default_model.folder())
    first = pipe.generate("a large red circle on the left on a white background", seed=1, progress_bar=False)
    first.image.save("reference.png")
    # a PIL image, a file or a list of them (up to 10); the VAE encodes them in a "reference" phase and is freed
    result = pipe.generate("a large blue square on the right on a white background", image=["reference.png"],
                           seed=2, progress_bar=False)
    result.image.save("edited.png")
    print(result.summary())      # the "reference" phase's time and memory, and a note with the reference tokens
    print("images written to reference.png and edited.png")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
