"""diffusers' Flux2Pipeline (FLUX.2-dev) / Flux2KleinPipeline (klein; picked by model_index.json's _class_name)
run two ways, for footprint comparisons:

- as_is:      from_pretrained + pipe.to(device), everything resident at once (what most people run);
- sequential: the published low-memory recipe: a pipeline with only the text encoder and tokenizer encodes the
              prompt (encode_prompt), is deleted and its memory freed, then a pipeline with only the transformer and
              VAE denoises from prompt_embeds and decodes.
With `transformer` (a GGUF file, or a safetensors file in BFL naming) both modes load the denoiser with
Flux2Transformer2DModel.from_single_file(path, config=<folder>/transformer, GGUFQuantizationConfig(bfloat16)) and
pass it in (the published FLUX.2-dev GGUF recipe).

mlxdiff reads `text_encoder_out_layers` and `max_sequence_length` from model_index.json; diffusers ignores those
keys there and takes them per call, so they are passed to encode_prompt and to the pipeline call here.
Each run prints phase markers (see mlxdiff.reference.common) for an outside sampler.
"""

import json
import sys
from pathlib import Path

from . import transformer_file
from .common import device as _device, loaded_two_ways, noise, phase


def options(model) -> dict:
    """The folder's class and what mlxdiff reads from its model_index.json."""
    index = json.loads((Path(model) / "model_index.json").read_text())
    cls = index.get("_class_name")
    if cls not in ("Flux2Pipeline", "Flux2KleinPipeline"):
        raise SystemExit(f"mlxdiff.reference.flux2: {model}: expected a Flux2Pipeline or Flux2KleinPipeline "
                         f"folder, model_index.json names {cls!r}")
    klein = cls == "Flux2KleinPipeline"
    distilled = klein and bool(index.get("is_distilled", False))
    encode = {"max_sequence_length": index.get("max_sequence_length", 512)}
    if index.get("text_encoder_out_layers"):
        encode["text_encoder_out_layers"] = tuple(index["text_encoder_out_layers"])
    return {"class": cls, "klein": klein, "distilled": distilled, "encode": encode,
            "guidance": 1.0 if distilled else 4.0}


def run(model, mode="as_is", prompt="a photo of a fox in the snow", width=None, height=None, size=512, steps=2,
        guidance=None, seed=0, transformer=None):
    import torch  # optional: the reference extra
    import diffusers  # optional: the reference extra
    from diffusers import Flux2Transformer2DModel  # optional: the reference extra
    opts = options(model)
    Pipeline = getattr(diffusers, opts["class"])
    width, height = width or size, height or size
    guidance = opts["guidance"] if guidance is None else guidance
    cfg = opts["klein"] and not opts["distilled"] and guidance > 1   # klein base: true CFG with an empty negative
    device, dtype = _device(), torch.bfloat16

    def denoiser():
        if transformer is None:
            return {}
        return {"transformer": transformer_file.load(Flux2Transformer2DModel, transformer, model, dtype)}

    def encode(pipe):
        with torch.no_grad():
            pe, _ = pipe.encode_prompt(prompt, device=device, **opts["encode"])
            npe = pipe.encode_prompt("", device=device, **opts["encode"])[0] if cfg else None
        return pe, npe

    pipe, (pe, npe) = loaded_two_ways(Pipeline, model, mode, device, dtype, encode, ("text_encoder", "tokenizer"),
                                      denoiser)

    factor = pipe.vae_scale_factor * 2   # VAE factor x the 2x2 patchify
    latents = noise((1, pipe.transformer.config.in_channels, height // factor, width // factor), seed, dtype)
    call = dict(prompt_embeds=pe, height=height, width=width, num_inference_steps=steps, guidance_scale=guidance,
                latents=latents.to(device), output_type="latent", **opts["encode"])
    if opts["klein"]:
        call["negative_prompt_embeds"] = npe
    with phase("denoise", device):
        with torch.no_grad():
            packed = pipe(**call).images
    with phase("decode", device):
        with torch.no_grad():
            z = packed
            if z.ndim == 3:   # Flux2Pipeline returns packed tokens; klein has already unpacked and un-normalized
                ids = pipe._prepare_latent_ids(latents).to(device)
                z = pipe._unpack_latents_with_ids(z, ids)
                bn_mean = pipe.vae.bn.running_mean.view(1, -1, 1, 1).to(z.device, z.dtype)
                bn_std = torch.sqrt(pipe.vae.bn.running_var.view(1, -1, 1, 1) + pipe.vae.config.batch_norm_eps) \
                    .to(z.device, z.dtype)
                z = pipe._unpatchify_latents(z * bn_std + bn_mean)
            image = pipe.vae.decode(z.to(pipe.vae.dtype), return_dict=False)[0]
    return image


if __name__ == "__main__":
    run(**json.loads(sys.argv[1]))
