"""diffusers' StableDiffusion3Pipeline run two ways, for footprint comparisons:

- as_is:      from_pretrained + pipe.to(device), everything resident at once (what most people run);
- sequential: the published low-memory recipe: a pipeline with only the text encoders encodes the prompt, is deleted
              (accelerate hooks removed), then a pipeline with only the transformer and VAE denoises and decodes.
With `transformer` (a GGUF file, or a safetensors file in Stability's naming) both modes load the denoiser with
SD3Transformer2DModel.from_single_file(path, config=<folder>/transformer) (GGUF: GGUFQuantizationConfig, bfloat16)
and pass it in.
Each prints phase markers (see mlxdiff.reference.common) so that an outside sampler can attribute memory to phases.
"""

import sys

from . import transformer_file
from .common import device as _device, free as _free, mark, noise, phase  # noqa: F401  (mark: kept importable)


def run(model, mode="as_is", prompt="a photo of a fox in the snow", size=512, width=None, height=None, steps=2,
        guidance=7.0, seed=0, transformer=None):
    import torch  # optional: the reference extra
    from diffusers import SD3Transformer2DModel, StableDiffusion3Pipeline  # optional: the reference extra
    width, height = width or size, height or size
    guidance = 7.0 if guidance is None else guidance
    device, dtype = _device(), torch.bfloat16
    latents = noise((1, 16, height // 8, width // 8), seed, dtype)

    def denoiser():
        if transformer is None:
            return {}
        return {"transformer": transformer_file.load(SD3Transformer2DModel, transformer, model, dtype)}

    def encode(pipe):
        with torch.no_grad():
            return pipe.encode_prompt(prompt, None, None, do_classifier_free_guidance=guidance > 1, device=device)

    if mode == "as_is":
        with phase("load", device):
            pipe = StableDiffusion3Pipeline.from_pretrained(model, torch_dtype=dtype, **denoiser()).to(device)
        with phase("encode", device):
            emb = encode(pipe)
    elif mode == "sequential":
        with phase("encode", device):
            enc = StableDiffusion3Pipeline.from_pretrained(model, transformer=None, vae=None,
                                                           torch_dtype=dtype).to(device)
            emb = encode(enc)
            enc.remove_all_hooks()
            del enc
            _free(device)
        with phase("load", device):
            pipe = StableDiffusion3Pipeline.from_pretrained(model, text_encoder=None, text_encoder_2=None,
                                                            text_encoder_3=None, tokenizer=None, tokenizer_2=None,
                                                            tokenizer_3=None, torch_dtype=dtype,
                                                            **denoiser()).to(device)
    else:
        raise SystemExit(f"mlxdiff.reference.sd3: unknown mode {mode!r}; expected as_is or sequential")
    pe, npe, pp, npp = emb
    with phase("denoise", device):
        with torch.no_grad():
            out = pipe(prompt_embeds=pe, negative_prompt_embeds=npe, pooled_prompt_embeds=pp,
                       negative_pooled_prompt_embeds=npp, height=height, width=width, num_inference_steps=steps,
                       guidance_scale=guidance, latents=latents.to(device), output_type="latent").images
    with phase("decode", device):
        with torch.no_grad():
            z = out / pipe.vae.config.scaling_factor + pipe.vae.config.shift_factor
            image = pipe.vae.decode(z, return_dict=False)[0]
    return image


if __name__ == "__main__":
    import json
    run(**json.loads(sys.argv[1]))
