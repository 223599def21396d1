"""SD 1.x / 2.x / SDXL original single files -> specs: the checkpoints as Stability and RunwayML released them
(`v1-5-pruned-emaonly.safetensors`, `sd_xl_base_1.0.safetensors`) and as Civitai fine-tunes ship them (ldm / SGM
names: `model.diffusion_model.*`, `first_stage_model.*`, `cond_stage_model.*` / `conditioner.embedders.N.*`), and
stable-diffusion.cpp's GGUF files of the same models (`sd convert`: its names, below; kept quantized through
formats/gguf.py like any GGUF denoiser). The family is told by the tensors; configs are read off the shapes; the
tokenizers are the bundled real CLIP vocabulary, and the scheduler config is the released model's.

Where each part is (prefix, naming), first match wins:

| component          | SD 1.x / SDXL checkpoint                         | stable-diffusion.cpp GGUF                    |
|--------------------|--------------------------------------------------|----------------------------------------------|
| unet               | model.diffusion_model. (ldm)                      | the same                                     |
| vae                | first_stage_model. (ldm)                          | the same                                     |
| text_encoder       | cond_stage_model.transformer. (SD 1.x),           | cond_stage_model.transformer. (transformers  |
|                    | conditioner.embedders.0.transformer. (SDXL):      | names; SD 2.x: with a fused in_proj)         |
|                    | transformers names; cond_stage_model.model.       |                                              |
|                    | (SD 2.x: OpenCLIP-H)                              |                                              |
| text_encoder_2     | conditioner.embedders.1.model. (OpenCLIP bigG)    | cond_stage_model.1.transformer. (fused       |
|                    |                                                   | in_proj, OpenCLIP's text_projection)         |

sd.cpp's convert quantizes every tensor but biases, `time_embed.` / `label_emb.`, embeddings and any tensor whose
row length is not a multiple of the type's block (ModelLoader::tensor_should_be_converted): so every conv kernel
(row length 3 or 1) stays F16/F32 and 4-D tensors are always plain; 1-D norm scales may be quantized (the reader
dequantizes quantized vectors).

SD 2.x: whether a model predicts epsilon (2.x-base, 512 px) or v (2.0-v / 2.1, 768 px) is nowhere in its tensors
(both have the same shapes). Guessing wrong draws noise, so an SD 2.x file needs `prediction_type=` (a `v_pred`
tensor, ComfyUI's mark of v-prediction models, also says v); SD 1.x and SDXL are epsilon unless it is there.
"""


from ...config_checks import show
from ...errors import MlxdiffError
from ...formats import check_weight_file, tensor_shapes
from ...formats.keymaps import remap, strip_prefix
from ...models import clip, unet, vae
from ...tokenizers import bundled_clip_tokenizer
from ...loading.sources import config_from_shapes, not_a_folder
from ...loading.spec import ComponentSpec, PipelineSources
from ...loading.vae_files import AUTOENCODER_KL, check_channels, read_vae_file
from ..family import identify
from .folder import check_unet_together

# the released models' scheduler/scheduler_config.json
SCHEDULERS = {
    # runwayml/stable-diffusion-v1-5
    "sd1": {"_class_name": "PNDMScheduler", "beta_start": 0.00085, "beta_end": 0.012, "beta_schedule": "scaled_linear",
            "num_train_timesteps": 1000, "set_alpha_to_one": False, "skip_prk_steps": True, "steps_offset": 1,
            "clip_sample": False},
    # stabilityai/stable-diffusion-2-1 (-base: the same with epsilon, which prediction_type sets)
    "sd2": {"_class_name": "DDIMScheduler", "beta_start": 0.00085, "beta_end": 0.012, "beta_schedule": "scaled_linear",
            "num_train_timesteps": 1000, "set_alpha_to_one": False, "skip_prk_steps": True, "steps_offset": 1,
            "clip_sample": False},
    # stabilityai/stable-diffusion-xl-base-1.0
    "sdxl": {"_class_name": "EulerDiscreteScheduler", "beta_start": 0.00085, "beta_end": 0.012,
             "beta_schedule": "scaled_linear", "num_train_timesteps": 1000, "steps_offset": 1,
             "timestep_spacing": "leading", "interpolation_type": "linear", "prediction_type": "epsilon",
             "use_karras_sigmas": False, "clip_sample": False, "sample_max_value": 1.0, "set_alpha_to_one": False,
             "skip_prk_steps": True},
}
PREDICTIONS = ("epsilon", "v_prediction")
PIPELINES = {"sd1": "StableDiffusionPipeline", "sd2": "StableDiffusionPipeline", "sdxl": "StableDiffusionXLPipeline"}
NAMES = {"sd1": "SD 1.x", "sd2": "SD 2.x", "sdxl": "SDXL"}

# the released VAE configs (vae/config.json); shapes give the rest (vae.config_from_ldm)
SD_VAE = {"in_channels": 3, "out_channels": 3, "down_block_types": ["DownEncoderBlock2D"] * 4,
          "up_block_types": ["UpDecoderBlock2D"] * 4, "block_out_channels": [128, 256, 512, 512],
          "layers_per_block": 2, "act_fn": "silu", "latent_channels": 4, "norm_num_groups": 32, "sample_size": 512,
          "scaling_factor": 0.18215, "shift_factor": None, "force_upcast": True, "use_quant_conv": True,
          "use_post_quant_conv": True, "mid_block_add_attention": True}
VAE_CONFIGS = {"sd1": SD_VAE, "sd2": {**SD_VAE, "sample_size": 768},
               "sdxl": {**SD_VAE, "sample_size": 1024, "scaling_factor": 0.13025}}

# component -> (prefixes tried in order, the encoder it is); "clip_l": openai CLIP-L in transformers names;
# "openclip": an OpenCLIP text tower (OpenCLIP names, or sd.cpp's with a fused in_proj)
ENCODERS = {
    "sd1": {"text_encoder": (("cond_stage_model.transformer.",), "clip_l")},
    "sd2": {"text_encoder": (("cond_stage_model.model.", "cond_stage_model.transformer."), "openclip_h")},
    "sdxl": {"text_encoder": (("conditioner.embedders.0.transformer.", "cond_stage_model.transformer."), "clip_l"),
             "text_encoder_2": (("conditioner.embedders.1.model.", "cond_stage_model.1.transformer."), "openclip_g")},
}
VAE_PREFIX = "first_stage_model."


def _family(path, shapes) -> str:
    """"sd1" | "sd2" | "sdxl" from the UNet's tensors; other families' files refused by what they hold."""
    names = list(shapes)
    if not any(n.startswith(unet.ORIGINAL_PREFIX + "input_blocks.") for n in names):
        other = identify(names, but="sd")
        if other is not None:
            raise MlxdiffError(f"{path}: {other}; it is not an SD 1.x / 2.x / XL checkpoint")
        shown = ", ".join(sorted(names)[:3]) or "no tensors"
        raise MlxdiffError(f"{path}: not an SD 1.x / 2.x / XL checkpoint (no model.diffusion_model.input_blocks.*); "
                           f"its tensors are {shown}")
    if any(n.startswith(unet.ORIGINAL_PREFIX + "label_emb.") for n in names):
        return "sdxl"
    probe = next((n for n in names if n.startswith(unet.ORIGINAL_PREFIX) and n.endswith(".proj_in.weight")), None)
    return "sd2" if probe is not None and len(shapes[probe].shape) == 2 else "sd1"


def _encoder(path, component, shapes, prefixes, kind, family) -> ComponentSpec:
    prefix = next((p for p in prefixes if any(n.startswith(p) for n in shapes)), None)
    if prefix is None:
        what = {"clip_l": "CLIP-L", "openclip_h": "OpenCLIP ViT-H", "openclip_g": "OpenCLIP bigG"}[kind]
        raise MlxdiffError(f"{path}: an {NAMES[family]} checkpoint without its {what} text encoder ("
                           f"{' or '.join(p + '*' for p in prefixes)}); use the full checkpoint, not a UNet-only "
                           "file")
    names = strip_prefix(shapes, prefix)
    if kind == "clip_l" or any(n.startswith("text_model.encoder.layers.0.self_attn.q_proj.") for n in names):
        config = {**config_from_shapes(clip, clip.config_from_weights, names, path), "hidden_act": "quick_gelu",
                  "architectures": ["CLIPTextModel"]}
        keymap = None
    else:
        config = config_from_shapes(clip, clip.config_from_openclip, names, path)
        if kind == "openclip_h":   # SD 2.x: the penultimate layer's output, final-normed (diffusers' 23 layers)
            layers = config["num_hidden_layers"] - 1
            if layers < 1:
                raise MlxdiffError(f"{path}: the SD 2.x text encoder ({prefix}*) has one layer; SD 2.x runs it "
                                   "without its last layer")
            config.update(num_hidden_layers=layers, architectures=["CLIPTextModel"])
            keymap = lambda w: clip.openclip_to_transformers(w, layers=layers, projection=False)   # noqa: E731
        else:
            if not any(n in names for n in ("text_projection", "text_model.text_projection")):
                raise MlxdiffError(f"{path}: the SDXL OpenCLIP bigG text encoder ({prefix}*) has no text_projection; "
                                   "the file is incomplete, re-download it")
            config["architectures"] = ["CLIPTextModelWithProjection"]
            keymap = clip.openclip_to_transformers
    clip.ModelArgs.from_dict(config, f"{path} (config read from its tensor shapes)")
    return ComponentSpec(component, clip, config, [path], prefix, keymap)


def _ldm_vae(path, names, prefix, defaults) -> ComponentSpec:
    check_channels(path, names, "an SD")   # RGB at both ends; the latents: check_unet_together
    config = config_from_shapes(vae, lambda w: vae.config_from_ldm(w, defaults=defaults), names, path)
    rules = vae.ldm_keymap(vae.ldm_num_blocks(names))
    return ComponentSpec("vae", vae, config, [path], prefix, lambda w: remap(w, rules))


def sd_single_file(path, vae_file=None, prediction_type=None) -> PipelineSources:
    """An SD 1.x / 2.x / XL checkpoint (.safetensors, or stable-diffusion.cpp's .gguf) -> PipelineSources.
    `vae_file` replaces the checkpoint's VAE; `prediction_type` ("epsilon" | "v_prediction") is required for SD 2.x,
    whose files do not say (module doc), and overrides the others' epsilon."""
    path = check_weight_file(not_a_folder(path, "model file"), "model file")
    if prediction_type is not None and prediction_type not in PREDICTIONS:
        raise MlxdiffError(f"prediction_type is {show(prediction_type)}; expected one of "
                           + ", ".join(map(repr, PREDICTIONS)))
    shapes = tensor_shapes(path)   # a truncated or malformed file is refused here, in one line
    family = _family(path, shapes)
    if prediction_type is None and "v_pred" in shapes:
        prediction_type = "v_prediction"
    if family == "sd2" and prediction_type is None:
        raise MlxdiffError(f"{path}: an SD 2.x checkpoint, whose tensors do not say whether it predicts epsilon "
                           "(2.x-base, 512 px) or v (2.0-v / 2.1, 768 px); pass prediction_type='v_prediction' or "
                           "'epsilon'")
    unet_names = strip_prefix(shapes, unet.ORIGINAL_PREFIX)
    unet_config = config_from_shapes(unet, unet.config_from_original, unet_names, path)
    if family == "sd2" and prediction_type == "epsilon":
        unet_config["sample_size"] = 64   # 2.x-base: 512 px
    specs = {"unet": ComponentSpec("unet", unet, unet_config, [path], unet.ORIGINAL_PREFIX,
                                   unet.original_to_diffusers)}
    for component, (prefixes, kind) in ENCODERS[family].items():
        specs[component] = _encoder(path, component, shapes, prefixes, kind, family)

    defaults = dict(VAE_CONFIGS[family])
    if family == "sd2" and prediction_type == "epsilon":
        defaults["sample_size"] = 512
    if any(n.startswith(VAE_PREFIX) for n in shapes):
        specs["vae"] = _ldm_vae(path, strip_prefix(shapes, VAE_PREFIX), VAE_PREFIX, defaults)
    elif vae_file is None:
        raise MlxdiffError(f"{path}: has no VAE (first_stage_model.*); pass a VAE file (vae_file=) or use the full "
                           "checkpoint")
    if vae_file is not None:
        specs["vae"] = read_vae_file(vae_file, AUTOENCODER_KL, specs["vae"].config if "vae" in specs else defaults,
                                     title="an SD")
    check_unet_together(vae_file or path, specs)   # latents, cross-attention width, SDXL's added embedding

    if family == "sdxl":
        tokenizers = {"tokenizer": bundled_clip_tokenizer("<|endoftext|>"), "tokenizer_2": bundled_clip_tokenizer("!")}
    else:
        tokenizers = {"tokenizer": bundled_clip_tokenizer("<|endoftext|>")}
    scheduler = dict(SCHEDULERS[family])
    if prediction_type is not None:
        scheduler["prediction_type"] = prediction_type
    return PipelineSources("sd", PIPELINES[family], specs, tokenizers, scheduler)
