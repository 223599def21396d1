"""diffusers' StableDiffusion3Pipeline run two ways, for footprint comparisons:

- as_is:      from_pretrained + pipe.to(device), everything resident at once (what most people run);
- sequential: the published low-memory recipe: a pipeline with only the text encoders encodes the prompt, is deleted
              (accelerate hooks removed), then a pipeline with only the transformer and VAE denoises and decodes.
Each prints phase markers (see mlxdiff.footprint) so that an outside sampler can attribute memory to phases.
"""

import gc
import sys
import time

import numpy as np


def mark(phase, event):
    print(f"MLXDIFF_PHASE {phase} {event} {time.time():.3f}", file=sys.stderr, flush=True)


def _device():
    import torch
    if torch.cuda.is_available():
        return "cuda"
    if torch.backends.mps.is_available():
        return "mps"
    return "cpu"


def _free(device):
    import torch
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    elif device == "mps":
        torch.mps.empty_cache()


def run(model, mode="as_is", prompt="a photo of a fox in the snow", size=512, steps=2, guidance=7.0, seed=0):
    import torch
    from diffusers import StableDiffusion3Pipeline
    device, dtype = _device(), torch.bfloat16
    latents = torch.from_numpy(np.random.default_rng(seed).standard_normal((1, 16, size // 8, size // 8))
                               .astype(np.float32)).to(dtype)
    if mode == "as_is":
        mark("load", "start")
        pipe = StableDiffusion3Pipeline.from_pretrained(model, torch_dtype=dtype).to(device)
        mark("load", "end")
        mark("encode", "start")
        with torch.no_grad():
            emb = pipe.encode_prompt(prompt, None, None, do_classifier_free_guidance=guidance > 1, device=device)
        mark("encode", "end")
    else:
        mark("encode", "start")
        enc = StableDiffusion3Pipeline.from_pretrained(model, transformer=None, vae=None, torch_dtype=dtype).to(device)
        with torch.no_grad():
            emb = enc.encode_prompt(prompt, None, None, do_classifier_free_guidance=guidance > 1, device=device)
        enc.remove_all_hooks()
        del enc
        _free(device)
        mark("encode", "end")
        mark("load", "start")
        pipe = StableDiffusion3Pipeline.from_pretrained(model, text_encoder=None, text_encoder_2=None,
                                                        text_encoder_3=None, tokenizer=None, tokenizer_2=None,
                                                        tokenizer_3=None, torch_dtype=dtype).to(device)
        mark("load", "end")
    pe, npe, pp, npp = emb
    mark("denoise", "start")
    with torch.no_grad():
        out = pipe(prompt_embeds=pe, negative_prompt_embeds=npe, pooled_prompt_embeds=pp,
                   negative_pooled_prompt_embeds=npp, height=size, width=size, num_inference_steps=steps,
                   guidance_scale=guidance, latents=latents.to(device), output_type="latent").images
    mark("denoise", "end")
    mark("decode", "start")
    with torch.no_grad():
        z = out / pipe.vae.config.scaling_factor + pipe.vae.config.shift_factor
        image = pipe.vae.decode(z, return_dict=False)[0]
    mark("decode", "end")
    return image


if __name__ == "__main__":
    import json
    run(**json.loads(sys.argv[1]))
