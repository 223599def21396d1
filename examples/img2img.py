"""Image-to-image: start from a noised init image instead of pure noise (SD3.5 as diffusers'
StableDiffusion3Img2ImgPipeline; FLUX.2 by mflux's --image-path recipe). `strength` is the share of the schedule
that is run: 1 starts from pure noise (text-to-image), small values stay close to the image.

    python examples/img2img.py [MODEL]      (default: the embedded default model, weights/klein-shapes)
"""

import sys

import mlxdiff
from mlxdiff import default_model


def main(model=None):
    pipe = mlxdiff.load(model or default_model.folder())
    init = pipe.generate("a large green triangle at the top on a white background", seed=1, progress_bar=False)
    init.image.save("init.png")
    for strength in (0.4, 0.8):
        result = pipe.generate("a large green triangle at the top on a black background", image="init.png",
                               strength=strength, seed=2, progress_bar=False)
        result.image.save(f"img2img-{strength}.png")
        print(f"strength {strength}: {result.notes[-1]}")
    print("images written to init.png, img2img-0.4.png and img2img-0.8.png")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
