"""diffusers' QwenImage21Pipeline run two ways, for footprint comparisons (as mlxdiff.reference.krea2):

- as_is:      from_pretrained + pipe.to(device), everything resident at once;
- sequential: a pipeline with only the Qwen3-VL encoder (and its processor) encodes the prompt (and, with guidance
              > 1, the negative prompt), is deleted and its memory freed, then a pipeline with only the transformer
              and VAE denoises and decodes.
"""

import json
import sys
from pathlib import Path

from .common import device as _device, loaded_two_ways, noise, phase


def run(model, mode="as_is", prompt="a photo of a fox in the snow", size=512, width=None, height=None, steps=2,
        guidance=1.0, negative_prompt=None, seed=0):
    import torch  # optional: the reference extra
    from diffusers import QwenImage21Pipeline  # optional: the reference extra
    width, height = width or size, height or size
    device, dtype = _device(), torch.bfloat16
    vae = json.loads((Path(model) / "vae" / "config.json").read_text())
    factor = 2 ** len(vae.get("temperal_downsample", [False, True, True, True]))
    channels = vae.get("z_dim", 64)
    h, w = height // factor, width // factor
    latents = noise((1, channels, h, w), seed, dtype).reshape(1, channels, h * w).transpose(1, 2)
    cfg = guidance > 1 and negative_prompt is not None

    def encode(pipe):
        with torch.no_grad():
            embeds, mask, _ = pipe.encode_prompt(prompt, device=device)
            cond = dict(prompt_embeds=embeds, prompt_embeds_mask=mask)
            if cfg:
                neg, neg_mask, _ = pipe.encode_prompt(negative_prompt, device=device)
                cond.update(negative_prompt_embeds=neg, negative_prompt_embeds_mask=neg_mask)
        return cond

    pipe, cond = loaded_two_ways(QwenImage21Pipeline, model, mode, device, dtype, encode, ("text_encoder",))
    with phase("denoise", device):
        with torch.no_grad():
            out = pipe(**cond, height=height, width=width, num_inference_steps=steps, true_cfg_scale=guidance,
                       latents=latents.to(device), output_type="latent").images
    with phase("decode", device):
        with torch.no_grad():
            z = pipe._unpack_latents(out, height, width, pipe.vae_scale_factor).to(pipe.vae.dtype)
            mean = torch.tensor(pipe.vae.config.latents_mean).view(1, -1, 1, 1, 1).to(z)
            std = torch.tensor(pipe.vae.config.latents_std).view(1, -1, 1, 1, 1).to(z)
            image = pipe.vae.decode(z * std + mean, return_dict=False)[0][:, :, 0]
    return image


if __name__ == "__main__":
    run(**json.loads(sys.argv[1]))
