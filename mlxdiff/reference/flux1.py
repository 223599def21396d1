"""diffusers' FluxPipeline (FLUX.1 dev, schnell, Krea) run two ways, for footprint comparisons:

- as_is:      from_pretrained + pipe.to(device), everything resident at once (what most people run);
- sequential: the published low-memory recipe: a pipeline with only the text encoders encodes the prompt, is deleted
              and its memory freed, then a pipeline with only the transformer and VAE denoises and decodes.
With `transformer` (a GGUF file, or a safetensors file in BFL naming) both modes load the denoiser with
FluxTransformer2DModel.from_single_file(path, config=<folder>/transformer) and pass it in.
Each run prints phase markers (see mlxdiff.reference.common) for an outside sampler.
"""

import json
import sys
from pathlib import Path

from . import transformer_file
from .common import device as _device, loaded_two_ways, noise, phase


def run(model, mode="as_is", prompt="a photo of a fox in the snow", size=512, width=None, height=None, steps=2,
        guidance=None, seed=0, transformer=None):
    import torch  # optional: the reference extra
    from diffusers import FluxPipeline, FluxTransformer2DModel  # optional: the reference extra
    width, height = width or size, height or size
    config = json.loads((Path(model) / "transformer" / "config.json").read_text())
    distilled = bool(config.get("guidance_embeds"))
    guidance = (3.5 if distilled else 0.0) if guidance is None else guidance
    encode_kw = {"max_sequence_length": 512 if distilled else 256}
    device, dtype = _device(), torch.bfloat16
    vae = json.loads((Path(model) / "vae" / "config.json").read_text())
    factor, channels = 2 ** (len(vae["block_out_channels"]) - 1), vae["latent_channels"]
    h, w = height // factor, width // factor
    latents = FluxPipeline._pack_latents(noise((1, channels, h, w), seed, dtype), 1, channels, h, w)

    def denoiser():
        if transformer is None:
            return {}
        return {"transformer": transformer_file.load(FluxTransformer2DModel, transformer, model, dtype)}

    def encode(pipe):
        with torch.no_grad():
            pe, pp, _ = pipe.encode_prompt(prompt, None, device=device, **encode_kw)
        return pe, pp

    pipe, (pe, pp) = loaded_two_ways(FluxPipeline, model, mode, device, dtype, encode,
                                     ("text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2"), denoiser)
    with phase("denoise", device):
        with torch.no_grad():
            out = pipe(prompt_embeds=pe, pooled_prompt_embeds=pp, height=height, width=width,
                       num_inference_steps=steps, guidance_scale=guidance, latents=latents.to(device),
                       output_type="latent").images
    with phase("decode", device):
        with torch.no_grad():
            z = pipe._unpack_latents(out, height, width, pipe.vae_scale_factor)
            z = z / pipe.vae.config.scaling_factor + pipe.vae.config.shift_factor
            image = pipe.vae.decode(z, return_dict=False)[0]
    return image


if __name__ == "__main__":
    run(**json.loads(sys.argv[1]))
