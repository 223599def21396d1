"""The bounds of every argument a user gives, in one table, checked up front by the CLI and the API alike.

`Pipeline.request()` (every generate call), `mlxdiff.load`, `memory.set_memory_limit` and the command-line tools
call these checks, so a mistake is the same MlxdiffError, with the same one-line message, wherever it was made:
`name=value: what is allowed`. None always means "the default"; zero is a value like any other (and mostly out of
range), never a default in disguise.
"""

import io
import math
import numbers
import os
import re
from dataclasses import dataclass

from .backend import physical_memory
from .config_checks import MAX_LAYERS
from .errors import MlxdiffError
from .files import read_capped

MAX_SIZE = 4096          # pixels a side: FLUX.2 goes up to 4 MP (2048x2048), 4096 leaves room for wide formats;
                         # SD3.5's position table stops at 3072 anyway
MAX_STEPS = 1000         # the flow-match schedulers' num_train_timesteps: more steps only repeat timesteps
MAX_GUIDANCE = 100.0     # CFG scales past ~20 already saturate; the cap keeps guidance * (v_cond - v_uncond) finite
MAX_SEED = 2 ** 64 - 1   # mx.random.key takes the whole uint64 range
MAX_IMAGES = 10000       # images in one command (prompts x seeds)
MAX_SEQUENCE = 512       # T5's and the FLUX.2 encoders' prompt length limit
MEMORY_FACTOR = 2        # a memory limit may exceed physical memory (swap), but not by more than this
MAX_REFERENCES = 10      # images one run takes (FLUX.2's reference images): diffusers' pipelines set no limit; BFL documents up to 4 for klein,
                         # 6 recommended for dev and 10 at most (its playground)
IMAGE_FILE_BYTES = 256 << 20   # an input image file read up front; far more than any 4096x4096 PNG

# quantize=: the bit widths and group sizes of MLX's affine quantization that mlxdiff offers
SUPPORTED_BITS = (3, 4, 5, 6, 8)
GROUP_SIZES = (32, 64, 128)
DEFAULT_GROUP_SIZE = 64
# quantize="p6" / "p6:g16": palettized (a k-means table per tensor, or per `g` output rows; formats/palettized.py)
PALETTE_BITS = (1, 2, 3, 4, 6, 8)
PALETTE_EXAMPLE = "p6 (a 64-entry table per tensor) or p6:g16 (one per 16 output rows)"

DEFAULT = "; leave it out for the model's default"

# name: (integer?, low, high, low is excluded?, what None means)
RULES = {
    "width": (True, 1, MAX_SIZE, False, DEFAULT),
    "height": (True, 1, MAX_SIZE, False, DEFAULT),
    "steps": (True, 1, MAX_STEPS, False, DEFAULT),
    "guidance": (False, 0.0, MAX_GUIDANCE, False, DEFAULT),
    "seed": (True, 0, MAX_SEED, False, ""),
    "num_images": (True, 1, MAX_IMAGES, False, ""),
    "max_sequence_length": (True, 1, MAX_SEQUENCE, False, DEFAULT),
    "clip_skip": (True, 0, 64, False, ""),
    "skip_layer_guidance_scale": (False, 0.0, MAX_GUIDANCE, False, ""),
    "true_cfg_scale": (False, 0.0, MAX_GUIDANCE, False, ""),
    "skip_layer_guidance_start": (False, 0.0, 1.0, False, ""),
    "skip_layer_guidance_stop": (False, 0.0, 1.0, False, ""),
    "memory_limit": (False, 0.0, None, True, ""),      # GB; high: MEMORY_FACTOR x physical memory (memory_cap_gb)
    "interval": (False, 0.0, 60.0, True, ""),          # footprint's sampling, seconds
    "lora_scale": (False, -100.0, 100.0, False, ""),   # times the LoRA file's alpha / rank; 0 turns it off
    "strength": (False, 0.0, 1.0, True, ""),           # img2img: the share of the schedule denoised
    "controlnet_scale": (False, 0.0, 100.0, False, ""),    # a ControlNet's residuals times this; 0 turns it off
    "control_step": (False, 0.0, 1.0, False, ""),      # control_start / control_end: shares of the schedule
    "denoising_start": (False, 0.0, 1.0, True, ""),    # SDXL inpainting: the share of the schedule already denoised
    "mask_blur": (True, 0, MAX_SIZE, False, ""),       # the mask's Gaussian blur radius (VaeImageProcessor.blur)
}

TEXT_ENCODER_NAMES = ("clip_l", "clip_g", "t5xxl")


@dataclass(frozen=True)
class QuantizeSetting:
    """One component's quantize-while-loading setting, checked (made by quantize_setting). `as_dict()` is the form
    a spec holds and a converted checkpoint's config.json saves: {"bits", "group_size"} for MLX's affine mode;
    {"mode": "palettize", "bits", "group_size"} for palettized weights, whose group size counts output rows per
    table (None: one table per tensor) where affine's counts input columns per scale."""
    bits: int
    group_size: int | None = DEFAULT_GROUP_SIZE
    mode: str = "affine"

    def as_dict(self) -> dict:
        if self.mode == "palettize":
            return {"mode": self.mode, "bits": self.bits, "group_size": self.group_size}
        return {"bits": self.bits, "group_size": self.group_size}

    @property
    def text(self) -> str:
        """The setting as --quantize takes it: 4, p6, p6:g16 (group sizes other than the default are API-only for
        affine)."""
        if self.mode == "palettize":
            return f"p{self.bits}" + (f":g{self.group_size}" if self.group_size else "")
        return str(self.bits)


def memory_cap_gb() -> float:
    return MEMORY_FACTOR * physical_memory() / 2 ** 30


def _fmt(x) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


def check_number(name, value):
    """`value` against RULES[name]; None passes (the default). Returns the value (ints as int)."""
    if value is None:
        return None
    integer, low, high, open_low, none = RULES[name]
    if name == "memory_limit":
        high = memory_cap_gb()
        problem = (f"{name}={shown(value)}: must be a positive, finite number of GB, at most {high:.1f} "
                   f"({MEMORY_FACTOR} x this machine's memory)")
    else:
        bounds = f"above {_fmt(low)} and at most" if open_low else f"from {_fmt(low)} to"
        problem = f"{name}={shown(value)}: must be {'an integer' if integer else 'a finite number'} {bounds} " \
                  f"{_fmt(high)}{none}"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise MlxdiffError(problem)
    if integer:
        if not isinstance(value, numbers.Integral):
            raise MlxdiffError(problem)
        value = int(value)
    else:
        value = float(value)
        if not math.isfinite(value):
            raise MlxdiffError(problem)
    if value < low or (open_low and value == low) or value > high:
        raise MlxdiffError(problem)
    return value


def check_text(name, value, lists=True):
    """A prompt: a str (or a non-empty list of str); text that came from bytes that are not UTF-8 (Python keeps them
    as lone surrogates in sys.argv) is refused, since no tokenizer can read it."""
    if value is None:
        return None
    items = value if lists and isinstance(value, (list, tuple)) else [value]
    if lists and isinstance(value, (list, tuple)) and not value:
        raise MlxdiffError(f"{name}=[]: give at least one prompt")
    for text in items:
        if not isinstance(text, str):
            raise MlxdiffError(f"{name}={shown(text)}: must be text (a str{' or a list of str' if lists else ''})")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            bad = text[e.start]
            byte = f"byte 0x{ord(bad) - 0xDC00:02x}" if 0xDC80 <= ord(bad) <= 0xDCFF else f"{bad!r}"
            raise MlxdiffError(f"{name}: not valid UTF-8 text ({byte} at character {e.start}); "
                               "give the prompt in UTF-8") from None
    return list(value) if isinstance(value, tuple) else value


def check_latents(latents):
    """Injected noise: a finite real array (its shape is checked against the size by phases.initial_latents)."""
    if latents is None:
        return None
    import numpy as np  # heavy: numpy (about 100 modules), kept out of `import mlxdiff.generate`
    try:
        array = np.asarray(latents)
    except Exception:  # an object numpy cannot read is a user mistake here
        array = None
    if array is None or not (np.issubdtype(array.dtype, np.floating) or np.issubdtype(array.dtype, np.integer)):
        raise MlxdiffError(f"latents: expected a numpy array of real numbers, got {type(latents).__name__}")
    if not np.isfinite(array).all():
        raise MlxdiffError(f"latents: {int((~np.isfinite(array)).sum())} of {array.size} values are NaN or "
                           "infinite; give finite noise")
    return array


def check_outpaint(value) -> tuple | None:
    """outpaint=: the pixels added to the left, top, right and bottom, as (l, t, r, b) integers from 0 to MAX_SIZE
    (at least one above 0), or the command line's "L,T,R,B"."""
    if value is None:
        return None
    items = value.split(",") if isinstance(value, str) else value
    problem = (f"outpaint={shown(value)}: expected 4 integers from 0 to {MAX_SIZE}, the pixels added to the left, "
               "top, right and bottom (e.g. 0,0,256,0), at least one above 0")
    if not isinstance(items, (list, tuple)) or len(items) != 4:
        raise MlxdiffError(problem)
    out = []
    for item in items:
        if isinstance(item, str) and re.fullmatch(r"\s*\d+\s*", item):
            item = int(item)
        if isinstance(item, bool) or not isinstance(item, numbers.Integral) or not 0 <= item <= MAX_SIZE:
            raise MlxdiffError(problem)
        out.append(int(item))
    if not any(out):
        raise MlxdiffError(problem)
    return tuple(out)


MAX_TAPS = 16   # text_encoder_out_layers: as a folder's taps (config_checks' items=(1, 16))


def check_out_layers(value, num_layers=None):
    """text_encoder_out_layers=: 1 to MAX_TAPS hidden-state indices of the text encoder (0 = its embeddings, k =
    decoder layer k's output), up to `num_layers` (the encoder's, where known); None: the model's own. The FLUX
    pipelines check it under its own name when a run starts (the encoder's config check names only its taps)."""
    if value is None:
        return None
    items = list(value) if isinstance(value, (list, tuple)) else None
    top = MAX_LAYERS if num_layers is None else num_layers
    if (not items or len(items) > MAX_TAPS or any(isinstance(i, bool) or not isinstance(i, numbers.Integral)
                                                  or not 0 <= i <= top for i in items)):
        has = "" if num_layers is None else f"; the text encoder has {num_layers} decoder layers"
        raise MlxdiffError(f"text_encoder_out_layers={shown(value)}: expected a list of 1 to {MAX_TAPS} hidden-state "
                           f"indices from 0 to {top} (0 = the embeddings, k = decoder layer k's output){has}; leave "
                           "it out for the model's own")
    return [int(i) for i in items]


def check_layers(name, value, count):
    """Transformer block indices: distinct integers in [0, count)."""
    if value is None:
        return None
    items = list(value) if isinstance(value, (list, tuple)) else None
    if (not items or any(isinstance(i, bool) or not isinstance(i, numbers.Integral) or not 0 <= i < count
                         for i in items) or len(set(items)) != len(items)):
        raise MlxdiffError(f"{name}={shown(value)}: expected distinct layer indices from 0 to {count - 1}, "
                           "e.g. [7, 8, 9]")
    return [int(i) for i in items]


def _image_name(item, index) -> str:
    if _is_path(item):
        return str(item)
    return getattr(item, "filename", "") or f"#{index + 1} (a PIL image)"


def read_json_capped(path, limit, what, advice="give a smaller file", depth=None):
    """A user's JSON file through read_capped, parsed: a UTF-8 / syntax error, nesting deeper than Python's parser
    takes (or than `depth`, when given) and numbers past what Python reads are one line each."""
    import json  # light CLI: json (5 modules) is not in `import mlxdiff.generate`'s set
    data = read_capped(path, limit, what, advice)
    try:
        value = json.loads(data.decode("utf-8-sig"))
    except RecursionError:
        raise MlxdiffError(f"{what}: cannot read it (nested too deeply)") from None
    except (UnicodeDecodeError, ValueError) as e:
        raise MlxdiffError(f"{what}: not valid JSON ({(str(e).splitlines() or [''])[0][:200]})") from None
    if depth is not None and json_depth(value) > depth:
        raise MlxdiffError(f"{what}: nested more than {depth} levels deep; not the JSON expected here")
    return value


def json_depth(value) -> int:
    """How deeply lists and objects nest in a parsed JSON value (a scalar: 0), without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, (list, dict)):
            deepest = max(deepest, level)
            stack.extend((v, level + 1) for v in (item.values() if isinstance(item, dict) else item))
    return deepest


def shown(value, limit=80) -> str:
    """A value as an error message shows it: its repr on one line, cut short; an array (numpy, MLX, torch) as its
    type, shape and dtype (its repr spans lines)."""
    shape = getattr(value, "shape", None)
    if shape is not None and not isinstance(value, (str, bytes)):
        kind = type(value)
        dtype = getattr(value, "dtype", None)
        return (f"<{kind.__module__.split('.')[0]}.{kind.__name__} of shape {tuple(shape)}"
                + (f", {dtype}" if dtype is not None else "") + ">")
    try:
        text = repr(value)
    except Exception:   # a user's object whose repr fails
        text = f"<{type(value).__name__}>"
    text = " ".join(text.split()) if "\n" in text else text
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _read_image(item, index):
    """An image argument -> a loaded PIL image with pixels (a file: a regular file read with a bound, EXIF
    orientation applied, as diffusers' load_image does)."""
    import PIL.Image  # heavy: PIL, kept out of `import mlxdiff.generate` (image inputs only)
    import PIL.ImageOps  # heavy: as PIL.Image
    if isinstance(item, PIL.Image.Image):
        image, name = item, _image_name(item, index)
    elif not _is_path(item):
        advice = " (convert an array with PIL.Image.fromarray)" if hasattr(item, "shape") else ""
        raise MlxdiffError(f"image={shown(item)}: give a PIL image or an image file path, or a list of them{advice}")
    else:
        name = path = os.fspath(item)
        if not os.path.lexists(path):
            raise MlxdiffError(f"image {path}: no such file; give an existing image file (PNG, JPEG, WebP, ...)")
        data = read_capped(path, IMAGE_FILE_BYTES, f"image {path}", "give a smaller image")
        try:
            image = PIL.ImageOps.exif_transpose(PIL.Image.open(io.BytesIO(data)))
            image.load()
        except Exception as e:  # PIL raises many kinds (UnidentifiedImageError, OSError, DecompressionBombError, ...)
            reason = (str(e).splitlines()[0] if str(e) else type(e).__name__) \
                if not isinstance(e, PIL.UnidentifiedImageError) else "not a format PIL knows"
            raise MlxdiffError(f"image {path}: not an image mlxdiff can read ({reason}); give a PNG, JPEG or WebP "
                               "file") from None
        image.filename = path      # the name results and PNG metadata give it
    if image.width < 1 or image.height < 1:
        raise MlxdiffError(f"image {name}: has no pixels ({image.width}x{image.height}); give an image at least 1 "
                           "pixel a side")
    return image


def check_images(image, strength=None):
    """generate()'s `image` (a PIL image, a file path, or a list of them) and `strength`: -> (names, PIL images),
    ([], []) for none. Files must exist and be readable images, at most MAX_REFERENCES of them; how a family takes
    them (how many, what sizes) its pipeline checks (Pipeline.check_images)."""
    strength = check_number("strength", strength)
    if image is None:
        if strength is not None:
            raise MlxdiffError(f"strength={strength:g}: image-to-image needs an init image; give --image FILE "
                               "(image= in Python)")
        return [], []
    items = list(image) if isinstance(image, (list, tuple)) else [image]
    if not items:
        raise MlxdiffError("image=[]: give at least one image, or leave it out")
    if len(items) > MAX_REFERENCES:
        raise MlxdiffError(f"image: {len(items)} images; a run takes at most {MAX_REFERENCES} reference images "
                           "(img2img one); give fewer --image files")
    names = [_image_name(item, i) for i, item in enumerate(items)]
    images = [_read_image(item, i) for i, item in enumerate(items)]
    return names, images


def check_generate(**values) -> dict:
    """Every generate() argument that has a rule; the others pass unchanged."""
    out = dict(values)
    for name, value in values.items():
        if name in RULES:
            out[name] = check_number(name, value)
        elif name in ("prompt", "negative_prompt", "prompt_2", "prompt_3"):
            out[name] = check_text(name, value)
        elif name == "latents":
            out[name] = check_latents(value)
    return out


def quantize_setting(value, where="quantize") -> QuantizeSetting:
    """The one check of a quantize setting -> QuantizeSetting. `where` names the argument in the one-line error
    (quantize, quantize['transformer']). Affine: bits (an integer of SUPPORTED_BITS) or {"bits": B[,
    "group_size": G]} (G of GROUP_SIZES, default DEFAULT_GROUP_SIZE). Palettized: "pN" or "pN:gG" (N of
    PALETTE_BITS; G output rows per table, any positive integer, checked against each layer's rows when the layer is
    palettized), or {"mode": "palettize", "bits": N[, "group_size": G or None]}. A QuantizeSetting (made here
    already) is trusted."""
    if isinstance(value, QuantizeSetting):
        return value
    if isinstance(value, str):
        return _palette_setting(value, where)
    if isinstance(value, dict) and value.get("mode") == "palettize":
        return _palette_dict(value, where)
    setting = value if isinstance(value, dict) else {"bits": value}
    allowed = ", ".join(map(str, SUPPORTED_BITS))
    if set(setting) - {"bits", "group_size"} or "bits" not in setting or any(
            isinstance(v, bool) or not isinstance(v, numbers.Integral) for v in setting.values()):
        raise MlxdiffError(f"{where}={shown(value)}: expected bits as an integer ({allowed}), "
                           '{"bits": B, "group_size": G}, or a palettized ' + PALETTE_EXAMPLE)
    bits, group_size = int(setting["bits"]), int(setting.get("group_size", DEFAULT_GROUP_SIZE))
    if bits not in SUPPORTED_BITS:
        raise MlxdiffError(f"{where}={shown(value)}: {bits}-bit quantization is not supported; use one of "
                           f"{allowed}" + (f" (or palettized p{bits})" if bits in PALETTE_BITS else ""))
    if group_size not in GROUP_SIZES:
        raise MlxdiffError(f"{where}={shown(value)}: group size {group_size} is not supported; use one of "
                           + ", ".join(map(str, GROUP_SIZES)))
    return QuantizeSetting(bits, group_size)


def _palette_checked(value, where, bits, group_size) -> QuantizeSetting:
    if bits not in PALETTE_BITS:
        raise MlxdiffError(f"{where}={shown(value)}: {bits}-bit palettization is not supported; use "
                           + ", ".join(f"p{b}" for b in PALETTE_BITS))
    if group_size is not None and group_size < 1:
        raise MlxdiffError(f"{where}={shown(value)}: a table's group size counts output rows, at least 1; e.g. "
                           + PALETTE_EXAMPLE)
    return QuantizeSetting(bits, group_size, "palettize")


def _palette_setting(value: str, where) -> QuantizeSetting:
    """"p6" / "p6:g16" (bits, output rows per table)."""
    m = re.fullmatch(r"p(\d{1,2})(?::g(\d{1,6}))?", value)
    if m is None:
        raise MlxdiffError(f"{where}={shown(value)}: expected bits as an integer (" + ", ".join(
            map(str, SUPPORTED_BITS)) + ") or a palettized " + PALETTE_EXAMPLE)
    return _palette_checked(value, where, int(m.group(1)), None if m.group(2) is None else int(m.group(2)))


def _palette_dict(value: dict, where) -> QuantizeSetting:
    """{"mode": "palettize", "bits": N[, "group_size": G or None]} (what as_dict gives and config.json keeps)."""
    bits, group_size = value.get("bits"), value.get("group_size")
    def bad(v):
        return isinstance(v, bool) or not isinstance(v, numbers.Integral)
    if set(value) - {"mode", "bits", "group_size"} or bad(bits) or (group_size is not None and bad(group_size)):
        raise MlxdiffError(f"{where}={shown(value)}: expected {{\"mode\": \"palettize\", \"bits\": N, "
                           "\"group_size\": G} (G output rows per table, or None for one per tensor)")
    return _palette_checked(value, where, int(bits), None if group_size is None else int(group_size))


def quantize_word(text: str):
    """One --quantize value as the command line gives it: "4" -> 4, "p6" / "p6:g16" -> as is (checked by
    quantize_setting); anything else is a ValueError (the CLI's one line says what it expects)."""
    text = text.strip()
    return text if text.startswith("p") else int(text)


def check_quantize(quantize):
    """quantize=: a setting for every component, or {component: setting} (bits, {"bits", "group_size"}, "p6",
    "p6:g16": quantize_setting) -> a QuantizeSetting for every component, or {component: QuantizeSetting}; None
    stays None. Settings already checked pass as they are.
    The component names are checked against the pipeline by loading.quantize.plan, which trusts these settings."""
    if quantize is None:
        return None
    if not isinstance(quantize, dict):
        return quantize_setting(quantize)
    if not quantize:
        raise MlxdiffError("quantize={}: name at least one component, e.g. {'transformer': 4}")
    settings = {}
    for name, value in quantize.items():
        if not isinstance(name, str):
            raise MlxdiffError(f"quantize: component names are str, got {shown(name)}")
        settings[name] = quantize_setting(value, f"quantize[{shown(name)}]")
    return settings


def _is_path(value) -> bool:
    return isinstance(value, (str, os.PathLike)) and str(value) != ""


def check_loras(loras):
    """LoRAs as [(file, scale)]: each item a file (scale 1) or a (file, scale) pair, the scale by RULES["lora_scale"]
    (whether a file fits the transformer is mlxdiff/lora/apply.py's check)."""
    if loras is None:
        return None
    if isinstance(loras, (str, os.PathLike)) or not isinstance(loras, (list, tuple)):
        raise MlxdiffError(f"loras={shown(loras)}: expected a list of files or (file, scale) pairs, e.g. "
                           "[('style.safetensors', 0.8)]")
    out = []
    for item in loras:
        file, scale = (item, 1.0) if _is_path(item) else (tuple(item) if isinstance(item, (list, tuple)) and
                                                           len(item) == 2 else (None, None))
        if not _is_path(file):
            raise MlxdiffError(f"loras: {shown(item)} is not a file or a (file, scale) pair; e.g. "
                               "('style.safetensors', 0.8)")
        out.append((str(file), 1.0 if scale is None else check_number("lora_scale", scale)))
    return out


def check_controlnets(controlnets):
    """ControlNets as [(path, scale)]: each item a folder or file (scale 1) or a (path, scale) pair, the scale by
    RULES["controlnet_scale"] (whether one fits the model is its family's check, when the model is read)."""
    if controlnets is None:
        return None
    if isinstance(controlnets, (str, os.PathLike)) or not isinstance(controlnets, (list, tuple)) or not controlnets:
        raise MlxdiffError(f"controlnets={shown(controlnets)}: expected a list of ControlNet folders or files, or "
                           "(path, scale) pairs, e.g. [('controlnet-canny', 0.8)]")
    out = []
    for item in controlnets:
        path, scale = (item, 1.0) if _is_path(item) else (tuple(item) if isinstance(item, (list, tuple)) and
                                                           len(item) == 2 else (None, None))
        if not _is_path(path):
            raise MlxdiffError(f"controlnets: {shown(item)} is not a folder, a file or a (path, scale) pair; e.g. "
                               "('controlnet-canny', 0.8)")
        out.append((str(path), 1.0 if scale is None else check_number("controlnet_scale", scale)))
    return out


def check_load(model, transformer=None, text_encoders=None, quantize=None, text_encoder=None, vae=None,
               tokenizer=None, loras=None):
    """mlxdiff.load's arguments, before anything is read (which family takes which encoder argument is checked once
    the model is read: pipelines.detect). `model` None: a model from its files alone (its transformer's family reads
    them: Family.read_files_alone)."""
    if model is None and transformer is None:
        raise MlxdiffError("model=None: give a pipeline folder, a hub id (ORG/NAME, downloaded where missing) or a single "
                           "file; or, for a model from its files alone, transformer= (with text_encoder= and vae=)")
    if model is not None and not _is_path(model):
        raise MlxdiffError(f"model={shown(model)}: give a pipeline folder, a hub id (ORG/NAME, downloaded where missing) "
                           "or a single file, as a str or path")
    if vae is not None and not _is_path(vae):
        raise MlxdiffError(f"vae={shown(vae)}: give the VAE file that replaces the model's (e.g. "
                           "ae.safetensors), as a str or path")
    if tokenizer is not None and not _is_path(tokenizer):
        raise MlxdiffError(f"tokenizer={shown(tokenizer)}: give the tokenizer folder that replaces the "
                           "model's, as a str or path")
    if transformer is not None and not _is_path(transformer):
        raise MlxdiffError(f"transformer={shown(transformer)}: give the file that replaces the denoiser, as a str "
                           "or path")
    if text_encoder is not None and not _is_path(text_encoder):
        raise MlxdiffError(f"text_encoder={shown(text_encoder)}: give the text encoder file (safetensors or GGUF) "
                           "that replaces the model's, as a str or path")
    check_quantize(quantize)
    check_loras(loras)
    if text_encoders is not None:
        if not isinstance(text_encoders, dict) or set(text_encoders) - set(TEXT_ENCODER_NAMES) or not all(
                _is_path(v) for v in text_encoders.values()):
            raise MlxdiffError(f"text_encoders={shown(text_encoders)}: expected {{name: file}} with names from "
                               + ", ".join(TEXT_ENCODER_NAMES))
