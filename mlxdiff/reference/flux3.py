"""diffusers' FLUX 3 modular pipelines (Flux3DistilledModularPipeline / Flux3ModularPipeline, picked by the folder's
modular_model_index.json) run two ways, for footprint comparisons:

- as_is:      every component loaded (load_components) and moved to the device at once, then the text encoder step,
              the denoise steps and the VAE decode in turn;
- sequential: the text encoder step alone (its Qwen3-VL and tokenizer loaded) encodes the prompt, is deleted and its
              memory freed, then the transformer and VAE alone denoise from prompt_embeds and decode.
The auto blocks are split into the text encoder step, the denoise steps and the decode (Flux3DecodeStep's bn
de-normalisation, unpatchify and vae.decode, done here), so that each phase has its markers. The prompt upsampler step
is popped (mlxdiff encodes the prompt as given; the blocks' default would load the Qwen3.5 upsampler and rewrite it).
The base model runs classifier-free guidance against "" (passed as the negative prompt: the standalone text encoder
step encodes one only when given), at `guidance` (the guider's 3.5 by default). As for mlxdiff, the index's
`text_encoder_out_layers` (a small model's taps) is passed per call.
Each run prints phase markers (see mlxdiff.reference.common) for an outside sampler.
"""

import json
import sys
from pathlib import Path

from .common import device as _device, free, noise, phase

CLASSES = {"Flux3DistilledModularPipeline": "Flux3DistilledAutoBlocks", "Flux3ModularPipeline": "Flux3AutoBlocks"}


def index_of(model) -> dict:
    for name in ("modular_model_index.json", "model_index.json"):
        if (Path(model) / name).is_file():
            return json.loads((Path(model) / name).read_text())
    raise SystemExit(f"mlxdiff.reference.flux3: {model}: no modular_model_index.json")


def split_blocks(cls):
    """(the text encoder step, the blocks from the VAE encoder through the denoise) of `cls`'s auto blocks, the
    prompt upsampler and the decode step popped."""
    import diffusers  # optional: the reference extra
    if cls not in CLASSES:
        raise SystemExit(f"mlxdiff.reference.flux3: expected one of {', '.join(CLASSES)}, the index names {cls!r}")
    blocks = getattr(diffusers, CLASSES[cls])()
    blocks.sub_blocks.pop("prompt_upsampler")
    blocks.sub_blocks.pop("decode")
    return blocks.sub_blocks.pop("text_encoder"), blocks


def loaded(blocks, model, device, dtype):
    pipe = blocks.init_pipeline(model)
    pipe.load_components(torch_dtype=dtype)
    return pipe.to(device)


def decode(vae, latents):
    """Flux3DecodeStep without its postprocessing: bn de-normalisation, unpatchify, vae.decode -> [-1, 1] pixels."""
    import torch  # optional: the reference extra
    from diffusers.modular_pipelines.flux3.decoders import Flux3DecodeStep  # optional: the reference extra
    mean = vae.bn.running_mean.view(1, -1, 1, 1).to(latents.device, latents.dtype)
    std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(latents.device,
                                                                                          latents.dtype)
    z = Flux3DecodeStep._unpatchify_latents(latents * std + mean)
    return vae.decode(z.to(vae.dtype), return_dict=False)[0]


def run(model, mode="as_is", prompt="a photo of a fox in the snow", width=None, height=None, size=512, steps=2,
        guidance=None, seed=0):
    import torch  # optional: the reference extra
    from diffusers.guiders import ClassifierFreeGuidance  # optional: the reference extra
    index = index_of(model)
    cls = index["_class_name"]
    distilled = cls == "Flux3DistilledModularPipeline"
    width, height = width or size, height or size
    device, dtype = _device(), torch.bfloat16
    text_step, denoise_blocks = split_blocks(cls)
    encode = {"text_encoder_out_layers": tuple(index["text_encoder_out_layers"])} \
        if index.get("text_encoder_out_layers") else {}
    if not distilled:
        encode["negative_prompt"] = ""

    def encoded(encoder):
        with torch.no_grad():
            out = encoder(prompt=prompt, output=["prompt_embeds", "negative_prompt_embeds"], **encode)
        return {k: v for k, v in out.items() if v is not None}

    if mode == "as_is":
        with phase("load", device):
            pipe, encoder = loaded(denoise_blocks, model, device, dtype), loaded(text_step, model, device, dtype)
        with phase("encode", device):
            text = encoded(encoder)
    elif mode == "sequential":
        with phase("encode", device):
            encoder = loaded(text_step, model, device, dtype)
            text = encoded(encoder)
            del encoder
            free(device)
        with phase("load", device):
            pipe = loaded(denoise_blocks, model, device, dtype)
    else:
        raise SystemExit(f"mlxdiff.reference.flux3: unknown mode {mode!r}; expected as_is or sequential")
    if not distilled and guidance is not None:
        pipe.update_components(guider=ClassifierFreeGuidance(guidance_scale=guidance))
    factor = pipe.vae_scale_factor * 2
    latents = noise((1, pipe.transformer.config.in_channels, height // factor, width // factor), seed, dtype)
    with phase("denoise", device):
        with torch.no_grad():
            z = pipe(**text, height=height, width=width, num_inference_steps=steps, latents=latents.to(device),
                     output="latents")
    with phase("decode", device):
        with torch.no_grad():
            image = decode(pipe.vae, z)
    return image


if __name__ == "__main__":
    run(**json.loads(sys.argv[1]))
