"""ControlNets of the transformer families (SD3.5's SD3ControlNetModel, FLUX.1's FluxControlNetModel, Qwen-Image's
QwenImageControlNetModel): what their pipelines share, as diffusers' StableDiffusion3ControlNetPipeline,
FluxControlNetPipeline and QwenImageControlNetPipeline share it.

- load(controlnets=[(folder, scale), ...]): each a diffusers folder of the family's ControlNet class
  (`controlnet_folder`), a component named controlnet, controlnet_2, ... (loaded in the denoise phase, quantizable,
  counted like the others); load's scales kept on the sources' options.
- generate(control_images=[...], control_scales=, control_start=, control_end=): `take_controls` checks them (one
  image per ControlNet; generate's scales replace load's, never multiply them; start < end, shares of the schedule).
- The control image: RGB, resized (LANCZOS) to the output size, in [-1, 1] (VaeImageProcessor.preprocess), a sample
  of the VAE posterior (`control_noise`: its standard-normal noise per ControlNet, as diffusers' vae.encode(...)
  .latent_dist.sample() draws it; default: from the seed), (z - shift) x scaling, or the VAE's own scaling
  (`control_latents`).
- At schedule index i of n a ControlNet acts where diffusers' controlnet_keep is 1 (not i / n < start and not
  (i + 1) / n > end), with its scale; outside, its scale is 0 there, so it is not run here (`acting`).
- The `ControlNets` mixin: the ControlNets loaded once for the denoise phase and released when it ends (unpack),
  and in any case when the run does; the Result's note.
"""

from contextlib import ExitStack
from pathlib import Path

from .. import backend  # noqa: F401  (OpenBLAS preload before mlx)
import mlx.core as mx

from ..arguments import check_images, check_latents, check_number
from ..config_checks import show
from ..errors import MlxdiffError
from ..loading.sources import folder_component, read_json
from . import image_inputs

CONTROL_OPTIONS = ("control_images", "control_scales", "control_start", "control_end", "control_noise")


def controlnet_name(index: int) -> str:
    """The component name of the index-th ControlNet: controlnet, controlnet_2, ... (as text_encoder_2)."""
    return "controlnet" if index == 0 else f"controlnet_{index + 1}"


def controlnet_folder(path, name, class_name, title, from_file=None):
    """A diffusers ControlNet folder of `class_name` (config.json + diffusion_pytorch_model.safetensors) -> its
    ComponentSpec named `name`; a missing folder, a single file or another class's ControlNet refused in one line.
    `from_file(path)`: the family's reader of a ControlNet file (or a folder holding only its weights), config read
    off the shapes."""
    path = Path(path)
    if not path.exists():
        raise MlxdiffError(f"ControlNet {path}: no such folder; give a diffusers {class_name} folder (config.json + "
                           "diffusion_pytorch_model.safetensors)")
    weights = path / "diffusion_pytorch_model.safetensors"
    if from_file is not None and (not path.is_dir() or (not (path / "config.json").exists() and weights.is_file())):
        spec = from_file(path if not path.is_dir() else weights)
        spec.name = name
        return spec
    if not path.is_dir():
        raise MlxdiffError(f"ControlNet {path}: a single file; mlxdiff reads {title} ControlNets from diffusers "
                           f"{class_name} folders (config.json + diffusion_pytorch_model.safetensors)")
    config = read_json(path / "config.json", "the ControlNet config", path)
    cls = config.get("_class_name", class_name)
    if cls != class_name:
        raise MlxdiffError(f"ControlNet {path}: its config.json says {show(cls)}, not {title} ControlNet "
                           f"({class_name}); give a ControlNet made for this model")
    spec = folder_component(path.parent, path.name, class_name)
    spec.name = name
    return spec


def refuse(where, what, theirs, ours, why):
    raise MlxdiffError(f"ControlNet {where}: its {what} is {theirs} but the model's is {ours}; {why}")


def read_controlnets(found, controlnets, class_name, title, check, from_file=None) -> None:
    """load(controlnets=[(path, scale), ...]) for a transformer family: each folder (or, with `from_file(path,
    components)`, file) read (controlnet_folder), checked against the model (check(path, args, components)) and
    added as a component; load's scales kept."""
    for index, (path, _) in enumerate(controlnets):
        spec = controlnet_folder(path, controlnet_name(index), class_name, title,
                                 None if from_file is None else lambda p: from_file(p, found.components))
        check(path, spec.args, found.components)
        found.components[spec.name] = spec
    found.options["controlnet_scales"] = [scale for _, scale in controlnets]


def take_controls(run, names, load_scales, pipeline, inpaint=None) -> None:
    """check_inputs' part: one control image per ControlNet loaded (`names`), its scale (generate's replace load's),
    its [start, end] share of the schedule and its posterior noise -> run.state["controls"]. `pipeline`: diffusers'
    pipeline the run follows, for the messages; `inpaint`: its ControlNet inpainting pipeline, where the family has
    one (then image= with mask= is taken; take_mask first)."""
    o, n = run.options, len(names)
    if not n:
        given = [name for name in CONTROL_OPTIONS if o[name] is not None]
        if given:
            raise MlxdiffError(f"{given[0]}: this pipeline has no ControlNet; load one with "
                               "controlnets=[(path, scale)] (--controlnet PATH[:SCALE])")
        return
    if o["control_images"] is None:
        raise MlxdiffError(f"control_images: this pipeline has {n} ControlNet{'s' if n > 1 else ''}; give one "
                           "control image for each (control_images=[...], --control-image FILE)")
    if inpaint and run.images and image_inputs.inpainting(o):
        pass                      # the family's ControlNet inpainting (diffusers' `inpaint` pipeline)
    elif inpaint and run.images:
        raise MlxdiffError(f"control_images with image= and no mask: mlxdiff runs ControlNets text-to-image "
                           f"(diffusers' {pipeline}) or inpainting with mask= too ({inpaint}); give mask= or leave "
                           "image= out")
    elif run.images or image_inputs.inpainting(o):
        raise MlxdiffError(f"control_images with image=: mlxdiff runs ControlNets text-to-image (diffusers' "
                           f"{pipeline}); leave image= (and mask=) out")
    image_names, images = check_images(o["control_images"])
    if len(images) != n:
        raise MlxdiffError(f"control_images: {len(images)} control image{'s' if len(images) > 1 else ''} for {n} "
                           f"ControlNet{'s' if n > 1 else ''}; give one per ControlNet, in their order "
                           "(one --control-image per --controlnet)")

    def per_net(name, value, default, rule):
        values = list(value) if isinstance(value, (list, tuple)) else [value] * n
        if len(values) != n:
            raise MlxdiffError(f"{name}: {len(values)} values for {n} ControlNets; give one, or one per ControlNet")
        return [check_number(rule, d if v is None else v) for v, d in zip(values, default)]
    scales = per_net("control_scales", o["control_scales"], load_scales, "controlnet_scale")
    starts = per_net("control_start", o["control_start"], [0.0] * n, "control_step")
    ends = per_net("control_end", o["control_end"], [1.0] * n, "control_step")
    for start, end in zip(starts, ends):
        if start >= end:
            raise MlxdiffError(f"control_start {start:g} is not below control_end {end:g}; a ControlNet acts from "
                               "its start to its end share of the schedule")
    noise = o["control_noise"]
    if noise is not None:
        noise = list(noise) if isinstance(noise, (list, tuple)) else [noise]
        if len(noise) != n:
            raise MlxdiffError(f"control_noise: {len(noise)} arrays for {n} ControlNets; give one per ControlNet")
        noise = [check_latents(x) for x in noise]
    run.state["controls"] = dict(names=image_names, images=images, scales=scales, starts=starts, ends=ends,
                                 noise=noise)


def acting(controls, i, n) -> list:
    """(index, scale) of each ControlNet acting at schedule index i of n (diffusers' controlnet_keep)."""
    return [(k, scale) for k, (scale, start, end) in enumerate(zip(controls["scales"], controls["starts"],
                                                                 controls["ends"]))
            if scale != 0 and not (i / n < start or (i + 1) / n > end)]


def control_latents(run, vae, index, shift, rows=1, sample=True, moments=image_inputs.encode_moments) -> mx.array:
    """Control image `index` at the output size -> its VAE latents (1 or `rows`, C, h, w) float32: RGB, resized,
    [-1, 1], a posterior sample (control_noise[index], else a stream of the seed), (z - shift) * scaling_factor
    (shift None: the VAE's own scale_latents, Qwen-Image's per-channel (z - latents_mean) / latents_std).
    `rows`: the ControlNet's batch, which diffusers encodes whole (SD3's CFG batch: the image twice, each row its own
    noise): control_noise may have one row or that many. `sample=False`: the posterior's mean instead (diffusers'
    retrieve_latents(..., sample_mode="argmax"), as ZImageControlNetPipeline encodes). `moments(vae, pixels)`: the
    VAE's (mean, logvar) in the run's compute dtype."""
    controls = run.state["controls"]
    pixels = image_inputs.to_array(image_inputs.resized(controls["images"][index].convert("RGB"), run.width,
                                                        run.height))
    mean, logvar = moments(vae, pixels)
    mean, logvar = mean.astype(mx.float32), logvar.astype(mx.float32)
    noise = None if controls["noise"] is None else controls["noise"][index]
    if not sample:
        noise = mx.zeros_like(mean)
    elif noise is None:    # the seed's streams: 0 the initial noise, 1 img2img's posterior; control images from 8 on
        noise = mx.random.normal(mean.shape, key=mx.random.split(mx.random.key(run.seed), 9 + index)[8 + index])
    elif tuple(noise.shape[1:]) != tuple(mean.shape[1:]) or noise.shape[0] not in (1, rows):
        expected = tuple(mean.shape) if rows == 1 else f"({' or '.join(map(str, sorted({1, rows})))}, " + \
            ", ".join(map(str, mean.shape[1:])) + ")"
        raise MlxdiffError(f"control_noise[{index}] has shape {tuple(noise.shape)}, expected {expected} (the VAE "
                           "latents of the control image at the output size, one row or one per ControlNet row)")
    else:
        noise = mx.array(noise.astype("float32"))
    z = mean + mx.exp(0.5 * logvar) * noise
    latents = (vae.scale_latents(z) if shift is None else (z - shift) * vae.args.scaling_factor).astype(mx.float32)
    mx.eval(latents)
    return latents


class ControlNets:
    """The ControlNet part of a transformer family's pipeline (mixed in before Pipeline): `self.controlnets` (the
    component names), `self.control_scales` (load's), the models loaded once for the denoise phase
    (`control_models`) and released by `release_controls` (the family's unpack), or when generate returns."""
    CONTROL_PIPELINE = "ControlNet pipeline"     # diffusers' pipeline the family's ControlNet runs follow
    CONTROL_INPAINT_PIPELINE = None              # its ControlNet inpainting pipeline, where the family runs one

    def __init__(self, sources, *args, **kwargs):
        super().__init__(sources, *args, **kwargs)
        self.controlnets = [name for name in self.components if name.startswith("controlnet")]
        self.control_scales = list(self.options.get("controlnet_scales", [1.0] * len(self.controlnets)))
        self._controls = None      # generate()'s ExitStack: the ControlNets loaded for its denoise phase

    def generate(self, *args, **kwargs):
        with ExitStack() as stack:
            self._controls = stack
            try:
                return super().generate(*args, **kwargs)
            finally:
                self._controls = None

    def take_controls(self, run):
        take_controls(run, self.controlnets, self.control_scales, self.CONTROL_PIPELINE,
                      self.CONTROL_INPAINT_PIPELINE)

    def reference_phase(self, run) -> bool:
        return "controls" in run.state or super().reference_phase(run)

    def control_models(self, run) -> list:
        """The ControlNets, loaded on the denoise phase's first call (self.use: budget, quantization, keep=)."""
        if "controlnet_models" not in run.state:
            stack = run.state["control_stack"] = self._controls.enter_context(ExitStack())
            run.state["controlnet_models"] = [stack.enter_context(self.use(self.components[name], run.result))
                                              for name in self.controlnets]
        return run.state["controlnet_models"]

    def release_controls(self, run):
        """unpack's part: the ControlNets leave with the denoise phase; the Result's note."""
        if "control_stack" in run.state:
            run.state["control_stack"].close()
        if "controls" in run.state and "control_noted" not in run.state:
            run.state["control_noted"] = True
            c = run.state["controls"]
            run.result.notes.append("ControlNet " + "; ".join(
                f"{self.components[name].source} on {image}: scale {scale:g}, from {start:g} to {end:g} of the steps"
                for name, image, scale, start, end in zip(self.controlnets, c["names"], c["scales"], c["starts"],
                                                          c["ends"])))

    def control_note(self, run, seconds) -> str:
        names = run.state["controls"]["names"]
        return (f"control image{'s' if len(names) > 1 else ''} {', '.join(names)} at {run.width}x{run.height}, "
                f"encoded in {seconds:.2f} s")
