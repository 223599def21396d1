"""diffusers' Krea2Pipeline run two ways, for footprint comparisons (as mlxdiff.reference.qwenimage):

- as_is:      from_pretrained + pipe.to(device), everything resident at once;
- sequential: a pipeline with only the Qwen3-VL encoder encodes the prompt (and, with guidance > 0, the empty
              negative prompt), is deleted and its memory freed, then a pipeline with only the transformer and VAE
              denoises and decodes.
"""

import json
import sys
from pathlib import Path

from .common import device as _device, loaded_two_ways, noise, phase


def run(model, mode="as_is", prompt="a photo of a fox in the snow", size=512, width=None, height=None, steps=2,
        guidance=4.5, seed=0):
    import torch  # optional: the reference extra
    from diffusers import Krea2Pipeline  # optional: the reference extra
    width, height = width or size, height or size
    device, dtype = _device(), torch.bfloat16
    vae = json.loads((Path(model) / "vae" / "config.json").read_text())
    index = json.loads((Path(model) / "model_index.json").read_text())
    factor, channels = 2 ** len(vae.get("temperal_downsample", [False, True, True])), vae.get("z_dim", 16)
    p = index.get("patch_size", 2)
    h, w = height // factor, width // factor
    latents = noise((1, channels, h, w), seed, dtype)
    latents = latents.view(1, channels, h // p, p, w // p, p).permute(0, 2, 4, 1, 3, 5).reshape(
        1, (h // p) * (w // p), channels * p * p)

    def encode(pipe):
        with torch.no_grad():
            embeds, mask = pipe.encode_prompt(prompt, device=device)
            cond = dict(prompt_embeds=embeds, prompt_embeds_mask=mask)
            if guidance > 0:
                neg, neg_mask = pipe.encode_prompt("", device=device)
                cond.update(negative_prompt_embeds=neg, negative_prompt_embeds_mask=neg_mask)
        return cond

    pipe, cond = loaded_two_ways(Krea2Pipeline, model, mode, device, dtype, encode, ("text_encoder", "tokenizer"))
    with phase("denoise", device):
        with torch.no_grad():
            out = pipe(**cond, height=height, width=width, num_inference_steps=steps, guidance_scale=guidance,
                       latents=latents.to(device), output_type="latent").images
    with phase("decode", device):
        with torch.no_grad():
            z = pipe._unpack_latents(out, height, width).to(pipe.vae.dtype)
            mean = torch.tensor(pipe.vae.config.latents_mean).view(1, -1, 1, 1, 1).to(z)
            std = torch.tensor(pipe.vae.config.latents_std).view(1, -1, 1, 1, 1).to(z)
            image = pipe.vae.decode(z * std + mean, return_dict=False)[0][:, :, 0]
    return image


if __name__ == "__main__":
    run(**json.loads(sys.argv[1]))
