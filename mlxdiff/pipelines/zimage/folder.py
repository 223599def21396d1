"""A Z-Image diffusers folder (ZImagePipeline) -> PipelineSources: the transformer, the AutoencoderKL VAE, the Qwen3
text encoder (Qwen3Model or Qwen3ForCausalLM) read up to hidden_states[-2] (tap num_hidden_layers - 1, no final norm)
and its chat tokenizer."""

from pathlib import Path

from ... import backend  # noqa: F401  (OpenBLAS preload before mlx)
import mlx.core as mx

from ...errors import MlxdiffError
from ...formats import check_weight_file, open_weights, tensor_shapes
from ...loading.sources import check_together, config_from_shapes, folder_component, read_json, \
    read_scheduler_config, text_encoder_spec, tokenizer_folder, transformer_from_file
from ...loading.spec import ComponentSpec, PipelineSources
from ...models import controlnet_zimage, text_llm, zimage
from ...tokenizers import load_chat_tokenizer
from .. import controls
from ..controls import controlnet_name, refuse

# the text encoder's classes: diffusers' ZImagePipeline takes a Qwen3Model (Tongyi-MAI's folders name it so, its
# weights without `model.`) or the causal LM around it; text_llm reads both namings
TEXT_ENCODER_CLASSES = (text_llm.ARCHITECTURES["qwen3"], "Qwen3Model")


def zimage_folder(root: Path, index, pipeline_class, components, transformer=None) -> PipelineSources:
    """A ZImagePipeline folder; a `transformer` file (diffusers or original names) replaces its denoiser."""
    where = root / "model_index.json"
    specs = {name: folder_component(root, name, components[name], name == "transformer" and transformer is not None)
             for name in ("transformer", "vae")}
    if transformer is not None:
        specs["transformer"] = transformer_from_file(transformer, zimage, specs["transformer"].config,
                                                     root / "transformer" / "config.json")
    config_path = root / "text_encoder" / "config.json"
    config = read_json(config_path, "the text encoder config", root)
    layers = config.get("num_hidden_layers")
    if not isinstance(layers, int) or layers < 1:
        raise MlxdiffError(f"{config_path}: num_hidden_layers is {layers!r}; expected a positive integer")
    specs["text_encoder"] = text_encoder_spec(root / "text_encoder", [layers - 1], root)   # hidden_states[-2]
    encoder = specs["text_encoder"].args
    if encoder.model_type != "qwen3" or components["text_encoder"] not in TEXT_ENCODER_CLASSES:
        raise MlxdiffError(f"{where}: component 'text_encoder' names class {components['text_encoder']!r} but "
                           f"{config_path} is a {text_llm.ARCHITECTURES[encoder.model_type]}")
    transformer = specs["transformer"].args
    width = encoder.text_config.get("hidden_size", config.get("hidden_size"))
    if width is not None and width != transformer.cap_feat_dim:
        raise MlxdiffError(f"{root / 'transformer' / 'config.json'}: cap_feat_dim is {transformer.cap_feat_dim} but "
                           f"the text encoder ({config_path}) gives {width} features; the components do not "
                           "belong together")
    check_together(root, specs, 1, transformer.all_patch_size[0])
    folder = tokenizer_folder(root, "tokenizer")
    tokenizer = load_chat_tokenizer(folder, encoder.model_type, config_path)
    vocab = encoder.text_config.get("vocab_size", config.get("vocab_size"))
    if vocab is not None and len(tokenizer) > vocab:
        raise MlxdiffError(f"{folder}: the tokenizer has {len(tokenizer)} tokens but the text encoder's embedding "
                           f"({config_path}) has {vocab} rows; give the model's own tokenizer folder")
    return PipelineSources("zimage", pipeline_class, specs, {"tokenizer": tokenizer}, read_scheduler_config(root))


# -- ControlNets (load(controlnets=)): ZImageControlNetModel folders and alibaba-pai's single files ------------------
CONTROLNET_CLASS = "ZImageControlNetModel"


def controlnet_file(path, name) -> ComponentSpec:
    """A Z-Image ControlNet single file (Z-Image-Turbo-Fun-Controlnet-Union*.safetensors, diffusers' names): its
    config read off the shapes (controlnet_zimage.file_config); another file refused in one line."""
    path = check_weight_file(path, "ControlNet file")
    shapes = tensor_shapes(path)
    if not controlnet_zimage.is_controlnet_file(shapes):
        raise MlxdiffError(f"ControlNet {path}: not a Z-Image ControlNet file (no {controlnet_zimage.EMBEDDER}); give "
                           f"alibaba-pai's Z-Image-Turbo-Fun-Controlnet-Union file or a diffusers {CONTROLNET_CLASS} "
                           "folder")

    def is_zero(key):     # one dim x dim tensor read: 2.0's untrained refiner projection or 2.1's trained one
        return not bool(mx.any(open_weights(path, names={key})[key] != 0).item())
    config = config_from_shapes(controlnet_zimage, lambda s: controlnet_zimage.file_config(s, is_zero),
                                shapes, path)
    return ComponentSpec(name, controlnet_zimage, config, [path])


def check_controlnet(where, net, specs) -> None:
    """A Z-Image ControlNet fits the transformer it steers: the same width and heads (its hints join the stream and
    it runs the transformer's refiners), patch sizes, control channels at least the latents', its places within
    the transformer's main and noise-refiner layers."""
    t = specs["transformer"].args
    other = "a ControlNet of another model or size (Z-Image-Turbo's are 3840 wide, 30 heads)"
    for what, theirs, ours in (("dim", net.dim, t.dim), ("n_heads", net.n_heads, t.n_heads),
                               ("all_patch_size", list(net.all_patch_size), list(t.all_patch_size)),
                               ("qk_norm", net.qk_norm, t.qk_norm)):
        if theirs != ours:
            refuse(where, what, theirs, ours, other)
    if net.control_in_dim < t.in_channels:
        refuse(where, "control_in_dim", net.control_in_dim, f"{t.in_channels} (in_channels)",
               "its control input must hold the control image's latents")
    for what, places, layers in (("control_layers_places", net.control_layers_places, t.n_layers),
                                 ("control_refiner_layers_places", net.control_refiner_layers_places or (),
                                  t.n_refiner_layers)):
        if places and max(places) >= layers:
            refuse(where, f"{what} reach", max(places), f"{layers - 1} (its last layer index)",
                   "its hints must land on the transformer's layers: " + other)


def read_controlnets(found, controlnets) -> None:
    """load(controlnets=[(path, scale)]): one ZImageControlNetModel (ZImageControlNetPipeline takes one), a diffusers
    folder or alibaba-pai's single file, checked against the transformer before any weight is read."""
    if len(controlnets) > 1:
        raise MlxdiffError(f"controlnets=: {len(controlnets)} ControlNets; diffusers' ZImageControlNetPipeline takes "
                           "one (a Union ControlNet covers canny, depth, pose, ...): give one")
    (path, scale), = controlnets
    name = controlnet_name(0)
    if Path(path).is_file() or Path(path).suffix == ".safetensors":
        spec = controlnet_file(path, name)
    else:
        spec = controls.controlnet_folder(path, name, CONTROLNET_CLASS, "a Z-Image")
    check_controlnet(path, spec.args, found.components)
    found.components[name] = spec
    found.options["controlnet_scales"] = [scale]
