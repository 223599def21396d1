"""A Qwen-Image diffusers folder (QwenImagePipeline) -> PipelineSources: the transformer, the AutoencoderKLQwenImage
VAE, the Qwen2.5-VL text encoder's language model read up to hidden_states[-1] (every layer and the final norm; the
vision tower is never read) and its Qwen2 tokenizer. A QwenImageEditPipeline / QwenImageEditPlusPipeline folder
(Qwen-Image-Edit, -2509, -2511) adds the vision tower of the same text_encoder/ files (models/vision_qwen25vl.py, the
component "vision") and its processor/ folder: the image processor's preprocessor_config.json and the tokenizer the
Edit pipelines tokenize with (diffusers' self.processor), whose <|image_pad|> is the config's image_token_id.
load(controlnets=): QwenImageControlNetModel folders (read_controlnets), checked against the transformer."""

from pathlib import Path

from ...errors import MlxdiffError
from ...formats import check_weight_file, tensor_shapes
from ...loading.sources import (ComponentSpec, check_template_tokenizer, folder_component, not_a_folder, read_json,
                                read_scheduler_config, text_encoder_spec, tokenizer_folder, transformer_from_file)
from ...loading.spec import PipelineSources
from ...models import qwenimage, text_llm, vision_qwen25vl
from ...tokenizers import load_tokenizer
from .. import controls
from ..family import identify
from .pipeline import EDIT_PIPELINES

# the prompt template's control tokens: a tokenizer without them is not Qwen's
TEMPLATE_TOKENS = ("<|im_start|>", "<|im_end|>")
EDIT_TOKENS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>")     # the Edit templates' image placeholder


def transformer_file(path, base_config, base_where) -> ComponentSpec:
    """transformer=FILE: a Qwen-Image transformer file in diffusers' names, bare or under ComfyUI's prefix (safetensors,
    fp8 or GGUF), its config read off the shapes, the folder's axes_dims_rope and patch_size kept."""
    path = check_weight_file(not_a_folder(path, "transformer file"), "transformer file")
    names = list(tensor_shapes(path))
    if qwenimage.is_qwen_image_21(names):
        raise MlxdiffError(f"{path}: not a Qwen-Image transformer but Qwen-Image 2.1's (txt_in.text_norm, a SwiGLU "
                           "img_mlp: QwenImage21Transformer2DModel), which mlxdiff does not run")
    if not qwenimage.is_original(names):
        raise MlxdiffError(f"{path}: " + (identify(names, but="qwenimage") or
                                          "not a Qwen-Image transformer in diffusers' names (no txt_norm.weight and "
                                          "transformer_blocks.0.img_mod.*); give a QwenImageTransformer2DModel file"))
    return transformer_from_file(path, qwenimage, base_config, base_where)


def check_tokenizer(tokenizer, source, rows, encoder_where) -> None:
    """Qwen-Image's template tokens in the tokenizer, and no more tokens than the text encoder's embedding rows."""
    check_template_tokenizer(tokenizer, source, TEMPLATE_TOKENS,
                             "Qwen-Image's prompt template needs Qwen2.5-VL's tokenizer", rows, encoder_where)


def qwenimage_folder(root: Path, index, pipeline_class, components, transformer=None) -> PipelineSources:
    """A QwenImagePipeline folder; a `transformer` file (diffusers' or ComfyUI's names) replaces its denoiser."""
    where = root / "model_index.json"
    specs = {name: folder_component(root, name, components[name], name == "transformer" and transformer is not None)
             for name in ("transformer", "vae")}
    if transformer is not None:
        specs["transformer"] = transformer_file(transformer, specs["transformer"].config,
                                               root / "transformer" / "config.json")
    config_path = root / "text_encoder" / "config.json"
    config = read_json(config_path, "the text encoder config", root)
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config   # 5.x nests it
    layers = text.get("num_hidden_layers")
    if isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
        raise MlxdiffError(f"{config_path}: num_hidden_layers is {layers!r}; expected a positive integer")
    specs["text_encoder"] = text_encoder_spec(root / "text_encoder", [layers], root)   # hidden_states[-1]
    encoder = specs["text_encoder"].args
    if text_llm.ARCHITECTURES.get(encoder.model_type) != components["text_encoder"]:
        raise MlxdiffError(f"{where}: component 'text_encoder' names class {components['text_encoder']!r} but "
                           f"{config_path} is model_type {encoder.model_type!r}")
    targs, vargs = specs["transformer"].args, specs["vae"].args
    tconfig, vconfig = root / "transformer" / "config.json", root / "vae" / "config.json"
    width = encoder.text_config.get("hidden_size")
    if width != targs.joint_attention_dim:
        raise MlxdiffError(f"{tconfig}: joint_attention_dim is {targs.joint_attention_dim} but the text encoder "
                           f"({config_path}) gives {width} features; the components do not belong together")
    out = targs.out_channels or targs.in_channels
    if (targs.patch_size, targs.in_channels, out) != (2, 4 * vargs.z_dim, vargs.z_dim):
        raise MlxdiffError(f"{tconfig}: patch_size {targs.patch_size}, in_channels {targs.in_channels}, out_channels "
                           f"{out}; with {vconfig}'s z_dim {vargs.z_dim} the pipeline's 2x2 patches need 2, "
                           f"{4 * vargs.z_dim}, {vargs.z_dim}; the components do not belong together")
    options = {}
    if pipeline_class in EDIT_PIPELINES:
        folder, options = edit_parts(root, config, config_path, specs)
    else:
        folder = tokenizer_folder(root, "tokenizer")
    tokenizer = load_tokenizer(folder)
    check_tokenizer(tokenizer, folder, encoder.text_config.get("vocab_size"), config_path)
    if pipeline_class in EDIT_PIPELINES:
        check_edit_tokenizer(tokenizer, folder, options["image_token_id"], config_path)
    return PipelineSources("qwenimage", pipeline_class, specs, {"tokenizer": tokenizer}, read_scheduler_config(root),
                           options)


def edit_parts(root, config, config_path, specs) -> tuple:
    """An Edit folder's vision tower (specs["vision"], over the text encoder's files) and processor/: (the folder
    to tokenize with, the pipeline's options: the processor config and the image token's id)."""
    vision = config.get("vision_config")
    if not isinstance(vision, dict):
        raise MlxdiffError(f"{config_path}: no vision_config; Qwen-Image-Edit's text encoder is the whole Qwen2.5-VL "
                           "(Qwen2_5_VLForConditionalGeneration with its vision tower)")
    args = vision_qwen25vl.ModelArgs.from_dict(vision, f"{config_path} vision_config")
    width = specs["text_encoder"].args.text_config.get("hidden_size")
    if args.out_hidden_size != width:
        raise MlxdiffError(f"{config_path}: vision_config.out_hidden_size is {args.out_hidden_size} but the language "
                           f"model's hidden_size is {width}; the vision tower does not belong to this encoder")
    files = specs["text_encoder"].files
    specs["vision"] = ComponentSpec("vision", vision_qwen25vl, dict(vision), list(files))
    token_id = config.get("image_token_id", config.get("text_config", {}).get("image_token_id", 151655))
    if isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0:
        raise MlxdiffError(f"{config_path}: image_token_id is {token_id!r}; expected a token id")
    folder = tokenizer_folder(root, "processor")
    where = folder / "preprocessor_config.json"
    processor = vision_qwen25vl.processor_config(read_json(where, "the image processor config", root), where)
    vision_qwen25vl.check_processor(processor, args, where, config_path)
    return folder, {"processor": processor, "image_token_id": token_id}


def check_edit_tokenizer(tokenizer, source, token_id, encoder_where) -> None:
    """The Edit templates' vision tokens in the processor's tokenizer, its <|image_pad|> the encoder's image token."""
    vocab = tokenizer.get_vocab()
    missing = [t for t in EDIT_TOKENS if t not in vocab]
    if missing:
        raise MlxdiffError(f"{source}: the tokenizer has no {' / '.join(missing)}; Qwen-Image-Edit's prompt template "
                           "needs Qwen2.5-VL's tokenizer (its processor/ folder)")
    if vocab["<|image_pad|>"] != token_id:
        raise MlxdiffError(f"{source}: <|image_pad|> is token {vocab['<|image_pad|>']} but the text encoder's "
                           f"image_token_id ({encoder_where}) is {token_id}; give the model's own processor folder")


# -- ControlNets (load(controlnets=)): diffusers' QwenImageControlNetModel folders -------------------------------------
CONTROLNET_CLASS = "QwenImageControlNetModel"


def check_controlnet(where, net, specs) -> None:
    """A Qwen-Image ControlNet fits the transformer it steers, before any weight is read: the same packed latents
    as its input (an Inpainting ControlNet's extra condition channels: the mask's patch), the same width (its
    residuals join the image stream) and prompt width; several ControlNets (their residuals summed block by block) of
    one depth, an Inpainting one alone."""
    t = specs["transformer"].args
    other = "a ControlNet of another family or size (Qwen-Image's take 64 packed channels, 3072 wide)"
    for what, theirs, ours in (("in_channels", net.in_channels, t.in_channels),
                               ("width (num_attention_heads * attention_head_dim)", net.width, t.width),
                               ("joint_attention_dim", net.joint_attention_dim, t.joint_attention_dim),
                               ("patch_size", net.patch_size, t.patch_size)):
        if theirs != ours:
            controls.refuse(where, what, theirs, ours, other)
    extra, patch = net.extra_condition_channels, net.patch_size ** 2
    if extra not in (0, patch):
        controls.refuse(where, "extra_condition_channels", extra, f"{patch} (the mask's one channel in "
                        f"{net.patch_size} x {net.patch_size} patches) or 0", "an Inpainting ControlNet's control "
                        "tokens are the masked image's latents and the mask")
    first = specs.get("controlnet")
    if first is not None and (extra or first.args.extra_condition_channels):
        raise MlxdiffError(f"ControlNet {where}: an Inpainting ControlNet (extra_condition_channels) runs alone, as "
                           "diffusers' QwenImageControlNetInpaintPipeline runs one; give it as the only ControlNet")
    if first is not None and first.args.num_layers != net.num_layers:
        controls.refuse(where, "num_layers", net.num_layers, f"{first.args.num_layers} (the first ControlNet's)",
                        "several ControlNets' residuals are summed block by block: give ControlNets of one depth")


def read_controlnets(found, controlnets) -> None:
    """load(controlnets=[(path, scale), ...]) for a Qwen-Image text-to-image model (QwenImageControlNetPipeline;
    pipelines/controls.py)."""
    if found.pipeline_class in EDIT_PIPELINES:
        raise MlxdiffError(f"controlnets=: this is a {found.pipeline_class} model; diffusers' "
                           "QwenImageControlNetPipeline steers Qwen-Image (QwenImagePipeline): give that as the model")
    controls.read_controlnets(found, controlnets, CONTROLNET_CLASS, "a Qwen-Image", check_controlnet)
