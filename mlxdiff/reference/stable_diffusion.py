"""diffusers' StableDiffusionPipeline (SD 1.x / 2.x) / StableDiffusionXLPipeline (picked by model_index.json's
_class_name) run two ways, for footprint comparisons:

- as_is:      from_pretrained + pipe.to(device), everything resident at once (what most people run);
- sequential: the published low-memory recipe, as mlxdiff.reference.sd3 runs it: a pipeline with only the text
              encoder(s) and tokenizer(s) encodes the prompt (encode_prompt), is deleted and its memory freed, then
              a pipeline with only the UNet and VAE denoises from the embeddings and decodes.

`dtype`: what diffusers loads and computes in, "bfloat16" (default, as the other families' references) or
"float32" (torch's bf16 matmuls crawl on an x86 CPU without AVX512-BF16 / AMX; there float32 is the runnable
choice, and its weights weigh twice bf16's). Guidance defaults to mlxdiff's (7.5 SD, 5.0 SDXL); CFG's negative is
the empty prompt (SDXL: zeros where the model forces them, as diffusers decides). The noise is seeded numpy in
diffusers' `latents` layout (scaled by the scheduler's init_noise_sigma inside the pipeline, as always).
Each run prints phase markers (see mlxdiff.reference.common) for an outside sampler, and on stdout what each
loaded pipeline holds per component (`mlxdiff.reference: holds unet float32 3438.2 MB, ...`: parameter and buffer
bytes by dtype; read by mlxdiff.footprint's tests and bench/sd15_cpu.sh).
"""

import json
import sys
from pathlib import Path

from .common import device as _device, free, noise, phase

CLASSES = ("StableDiffusionPipeline", "StableDiffusionXLPipeline")
DTYPES = ("bfloat16", "float32")


def pipeline_class(model) -> str:
    cls = json.loads((Path(model) / "model_index.json").read_text()).get("_class_name")
    if cls not in CLASSES:
        raise SystemExit(f"mlxdiff.reference.stable_diffusion: {model}: expected a StableDiffusionPipeline or "
                         f"StableDiffusionXLPipeline folder, model_index.json names {cls!r}")
    return cls


def held(pipe) -> str:
    """What a loaded pipeline holds per torch component: its parameters' and buffers' dtypes and bytes."""
    import torch  # optional: the reference extra
    parts = []
    for name, module in pipe.components.items():
        if not isinstance(module, torch.nn.Module):
            continue
        tensors = list(module.parameters()) + list(module.buffers())
        dtypes = sorted({str(t.dtype).replace("torch.", "") for t in tensors})
        size = sum(t.numel() * t.element_size() for t in tensors)
        parts.append(f"{name} {'/'.join(dtypes)} {size / 2 ** 20:.1f} MB")
    line = "mlxdiff.reference: holds " + ", ".join(parts)
    print(line, flush=True)
    return line


def run(model, mode="as_is", prompt="a photo of a fox in the snow", size=512, width=None, height=None, steps=2,
        guidance=None, seed=0, dtype="bfloat16"):
    import torch  # optional: the reference extra
    import diffusers  # optional: the reference extra
    cls = pipeline_class(model)
    xl = cls == "StableDiffusionXLPipeline"
    Pipeline = getattr(diffusers, cls)
    if dtype not in DTYPES:
        raise SystemExit(f"mlxdiff.reference.stable_diffusion: dtype {dtype!r}; expected one of {', '.join(DTYPES)}")
    width, height = width or size, height or size
    guidance = (5.0 if xl else 7.5) if guidance is None else guidance
    device, dtype = _device(), getattr(torch, dtype)
    # SD 1.x folders may name a safety checker; mlxdiff runs none, so neither does this side
    extra = {} if xl else {"safety_checker": None, "feature_extractor": None, "requires_safety_checker": False}
    encoders = {"text_encoder": None, "tokenizer": None}
    if xl:
        encoders.update(text_encoder_2=None, tokenizer_2=None)
    cfg = guidance > 1

    def encode(pipe):
        with torch.no_grad():
            if xl:   # (prompt, negative, pooled, negative pooled)
                return pipe.encode_prompt(prompt, device=device, num_images_per_prompt=1,
                                          do_classifier_free_guidance=cfg)
            return pipe.encode_prompt(prompt, device, 1, cfg)   # (prompt, negative)

    if mode == "as_is":
        with phase("load", device):
            pipe = Pipeline.from_pretrained(model, torch_dtype=dtype, **extra).to(device)
        held(pipe)
        with phase("encode", device):
            emb = encode(pipe)
    elif mode == "sequential":
        with phase("encode", device):
            enc = Pipeline.from_pretrained(model, unet=None, vae=None, torch_dtype=dtype, **extra).to(device)
            held(enc)
            emb = encode(enc)
            enc.remove_all_hooks()
            del enc
            free(device)
        with phase("load", device):
            pipe = Pipeline.from_pretrained(model, torch_dtype=dtype, **encoders, **extra).to(device)
        held(pipe)
    else:
        raise SystemExit(f"mlxdiff.reference.stable_diffusion: unknown mode {mode!r}; expected as_is or sequential")

    factor = pipe.vae_scale_factor
    latents = noise((1, pipe.unet.config.in_channels, height // factor, width // factor), seed, dtype)
    call = dict(prompt_embeds=emb[0], negative_prompt_embeds=emb[1], height=height, width=width,
                num_inference_steps=steps, guidance_scale=guidance, latents=latents.to(device), output_type="latent")
    if xl:
        call.update(pooled_prompt_embeds=emb[2], negative_pooled_prompt_embeds=emb[3])
    with phase("denoise", device):
        with torch.no_grad():
            z = pipe(**call).images
    with phase("decode", device):
        with torch.no_grad():
            image = pipe.vae.decode((z / pipe.vae.config.scaling_factor).to(pipe.vae.dtype), return_dict=False)[0]
    return image


if __name__ == "__main__":
    run(**json.loads(sys.argv[1]))
