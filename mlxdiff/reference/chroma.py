"""diffusers' ChromaPipeline run two ways, for footprint comparisons (as mlxdiff.reference.flux1):

- as_is:      from_pretrained + pipe.to(device), everything resident at once;
- sequential: a pipeline with only T5 encodes the prompt (and the empty negative prompt), is deleted and its memory
              freed, then a pipeline with only the transformer and VAE denoises and decodes.
The text mask is handed over boolean (diffusers 0.42.1 makes it float, which its attention adds to the scores:
diffusers #11724); memory is what this comparison measures, and the mask's dtype does not change it.
With `transformer` (a GGUF or an original-named safetensors file) both modes load the denoiser with
ChromaTransformer2DModel.from_single_file(path, config=<folder>/transformer) and pass it in.
"""

import json
import sys
from pathlib import Path

from . import transformer_file
from .common import device as _device, loaded_two_ways, noise, phase


def run(model, mode="as_is", prompt="a photo of a fox in the snow", size=512, width=None, height=None, steps=2,
        guidance=5.0, seed=0, transformer=None):
    import torch  # optional: the reference extra
    from diffusers import ChromaPipeline, ChromaTransformer2DModel  # optional: the reference extra
    width, height = width or size, height or size
    device, dtype = _device(), torch.bfloat16
    vae = json.loads((Path(model) / "vae" / "config.json").read_text())
    factor, channels = 2 ** (len(vae["block_out_channels"]) - 1), vae["latent_channels"]
    h, w = height // factor, width // factor
    latents = ChromaPipeline._pack_latents(noise((1, channels, h, w), seed, dtype), 1, channels, h, w)

    def denoiser():
        if transformer is None:
            return {}
        return {"transformer": transformer_file.load(ChromaTransformer2DModel, transformer, model, dtype)}

    def encode(pipe):
        with torch.no_grad():
            pe, pm = pipe._get_t5_prompt_embeds(prompt, device=device)
            ne, nm = pipe._get_t5_prompt_embeds("", device=device)
        return dict(prompt_embeds=pe, prompt_attention_mask=pm > 0, negative_prompt_embeds=ne,
                    negative_prompt_attention_mask=nm > 0)

    pipe, cond = loaded_two_ways(ChromaPipeline, model, mode, device, dtype, encode, ("text_encoder", "tokenizer"),
                                 denoiser)
    with phase("denoise", device):
        with torch.no_grad():
            out = pipe(**cond, height=height, width=width, num_inference_steps=steps, guidance_scale=guidance,
                       latents=latents.to(device), output_type="latent").images
    with phase("decode", device):
        with torch.no_grad():
            z = pipe._unpack_latents(out, height, width, pipe.vae_scale_factor)
            z = z / pipe.vae.config.scaling_factor + pipe.vae.config.shift_factor
            image = pipe.vae.decode(z, return_dict=False)[0]
    return image


if __name__ == "__main__":
    run(**json.loads(sys.argv[1]))
