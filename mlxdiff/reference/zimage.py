"""diffusers' ZImagePipeline run two ways, for footprint comparisons (as mlxdiff.reference.chroma):

- as_is:      from_pretrained + pipe.to(device), everything resident at once;
- sequential: a pipeline with only the Qwen3 encoder encodes the prompt (and the empty negative prompt), is deleted
              and its memory freed, then a pipeline with only the transformer and VAE denoises and decodes.
"""

import json
import sys
from pathlib import Path

from .common import device as _device, loaded_two_ways, noise, phase


def run(model, mode="as_is", prompt="a photo of a fox in the snow", size=512, width=None, height=None, steps=2,
        guidance=5.0, seed=0):
    import torch  # optional: the reference extra
    from diffusers import ZImagePipeline  # optional: the reference extra
    width, height = width or size, height or size
    device, dtype = _device(), torch.bfloat16
    vae = json.loads((Path(model) / "vae" / "config.json").read_text())
    factor, channels = 2 ** (len(vae["block_out_channels"]) - 1), vae["latent_channels"]
    latents = noise((1, channels, height // factor, width // factor), seed, dtype)

    def encode(pipe):
        with torch.no_grad():
            pe, ne = pipe.encode_prompt(prompt, device=device, do_classifier_free_guidance=guidance > 0)
        return dict(prompt_embeds=pe, negative_prompt_embeds=ne if guidance > 0 else None)

    pipe, cond = loaded_two_ways(ZImagePipeline, model, mode, device, dtype, encode, ("text_encoder", "tokenizer"))
    with phase("denoise", device):
        with torch.no_grad():
            out = pipe(**cond, height=height, width=width, num_inference_steps=steps, guidance_scale=guidance,
                       latents=latents.to(device), output_type="latent").images
    with phase("decode", device):
        with torch.no_grad():
            z = out.to(pipe.vae.dtype) / pipe.vae.config.scaling_factor + pipe.vae.config.shift_factor
            image = pipe.vae.decode(z, return_dict=False)[0]
    return image


if __name__ == "__main__":
    run(**json.loads(sys.argv[1]))
