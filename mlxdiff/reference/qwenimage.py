"""diffusers' QwenImagePipeline run two ways, for footprint comparisons (as mlxdiff.reference.zimage):

- as_is:      from_pretrained + pipe.to(device), everything resident at once;
- sequential: a pipeline with only the Qwen2.5-VL encoder encodes the prompt, is deleted and its memory freed, then a
              pipeline with only the transformer and VAE denoises and decodes.
No negative prompt, so no true CFG (one forward a step), as mlxdiff.generate runs without --negative-prompt; `guidance`
is taken and ignored (the model is not guidance-distilled).
"""

import json
import sys
from pathlib import Path

from .common import device as _device, loaded_two_ways, noise, phase


def run(model, mode="as_is", prompt="a photo of a fox in the snow", size=512, width=None, height=None, steps=2,
        guidance=None, seed=0):
    import torch  # optional: the reference extra
    from diffusers import QwenImagePipeline  # optional: the reference extra
    width, height = width or size, height or size
    device, dtype = _device(), torch.bfloat16
    vae = json.loads((Path(model) / "vae" / "config.json").read_text())
    factor, channels = 2 ** len(vae.get("temperal_downsample", [False, True, True])), vae.get("z_dim", 16)
    h, w = height // factor, width // factor
    latents = QwenImagePipeline._pack_latents(noise((1, channels, h, w), seed, dtype), 1, channels, h, w)

    def encode(pipe):
        with torch.no_grad():
            embeds, mask = pipe.encode_prompt(prompt, device=device)
        return dict(prompt_embeds=embeds, prompt_embeds_mask=mask)

    pipe, cond = loaded_two_ways(QwenImagePipeline, model, mode, device, dtype, encode, ("text_encoder", "tokenizer"))
    with phase("denoise", device):
        with torch.no_grad():
            out = pipe(**cond, height=height, width=width, num_inference_steps=steps, true_cfg_scale=1.0,
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
