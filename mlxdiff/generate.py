"""python -m mlxdiff.generate [--model M] [--prompt P | --prompts-file F] [--seed S ...] [--num-images N] [...]
    --output out.png

One image goes to --output. A job of several (every prompt of --prompts-file with every seed; --num-images N with
one seed S: seeds S..S+N-1) writes out-0.png, out-1.png, ... beside --output (the index zero-padded to the width of
the last one; prompt-major order), each with its own metadata, under one progress bar, and keeps what is loaded
between images (--keep auto).
"""

import time
from dataclasses import dataclass
from pathlib import Path

from .arguments import (MAX_IMAGES, check_controlnets, check_generate, check_images, check_number, check_outpaint,
                        check_text)
from .files import read_capped
from .cli import (ArgumentParser, check_png_name, check_writable, parse_control_mode, parse_layers, parse_loras,
                  parse_quantize, parse_text_encoders, main_exit, run, save_png)
from .errors import MlxdiffError

PROMPTS_FILE_BYTES = 16 << 20   # far more than MAX_IMAGES prompts of any encoder's length


def parse_args(argv=None):
    p = ArgumentParser(prog="python -m mlxdiff.generate", description=__doc__)
    p.add_argument("--model", help="pipeline folder, hub id (ORG/NAME: what the run reads is downloaded into the "
                                    "Hugging Face cache), or single file (default: the embedded default model under "
                                    "weights/)")
    p.add_argument("--revision", default=None, metavar="REV",
                   help="a hub id's branch, tag or commit hash (default: main)")
    p.add_argument("--no-download", action="store_true",
                   help="read a hub id from the local Hugging Face cache only (as HF_HUB_OFFLINE=1 does)")
    p.add_argument("--prompt", default=None)
    p.add_argument("--prompts-file", default=None, metavar="FILE",
                   help="UTF-8 text, one prompt a line (blank lines skipped); each prompt is drawn with each seed")
    p.add_argument("--negative-prompt", default=None)
    p.add_argument("--width", type=int, default=None, help="pixels, up to 4096 (default: the model's)")
    p.add_argument("--height", type=int, default=None, help="pixels, up to 4096 (default: the model's)")
    p.add_argument("--steps", type=int, default=None, help="1 to 1000 (default: the model's)")
    p.add_argument("--guidance", type=float, default=None, help="0 to 100 (default: the model's)")
    p.add_argument("--seed", type=int, nargs="+", default=[0], help="one or more seeds, 0 to 2^64-1 (default 0)")
    p.add_argument("--num-images", type=int, default=None, metavar="N",
                   help="N images from one --seed S: seeds S..S+N-1")
    p.add_argument("--keep", choices=("none", "auto", "all"), default=None,
                   help="components kept loaded between images (default: auto for several images, none for one)")
    p.add_argument("--transformer", help="a file that replaces the denoiser (the UNet of SD 1.x / SDXL; safetensors, GGUF, or a Core ML "
                   ".mlpackage for the UNet); without --model, "
                                          "FLUX.2 from files alone: with --text-encoder FILE and --vae FILE")
    p.add_argument("--lora", action="append", default=None, metavar="FILE[:SCALE]",
                   help="a LoRA (diffusers/PEFT, kohya/ComfyUI or original-named safetensors) at SCALE (default 1, "
                        "-100 to 100) for the transformer and, in SD3.5 files, its text encoders; repeat for several")
    p.add_argument("--vae", default=None, metavar="FILE",
                   help="a VAE file (FLUX.2: flux2-vae.safetensors / ae.safetensors; SD3.5: ldm names) that "
                        "replaces the model's")
    p.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="FLUX.2: a tokenizer folder that replaces the folder's (or the one read from the files)")
    p.add_argument("--text-encoder", action="append", default=None, metavar="FILE | NAME=FILE",
                   help="FLUX.2: one text encoder file (safetensors or GGUF) that replaces the folder's; SD3.5: "
                        "clip_l=FILE, clip_g=FILE, t5xxl=FILE (repeat the option)")
    p.add_argument("--skip-guidance-layers", default=None, help="SD3.5: comma-separated layer indices, e.g. 7,8,9")
    from .samplers import DISCRETE, FLOW, names_for  # heavy: the samplers import numpy (about 100 modules)
    p.add_argument("--scheduler", default=None, metavar="NAME",
                   help=f"the sampler (default: the one the model's scheduler config names): SD 1.x / SDXL "
                        f"{', '.join(names_for(DISCRETE))}; the flow-matching models {', '.join(names_for(FLOW))}")
    p.add_argument("--prediction-type", choices=("epsilon", "v_prediction"), default=None,
                   help="SD 2.x single files: what the UNet predicts (the file does not say)")
    p.add_argument("--mask", default=None, metavar="FILE",
                   help="inpainting: the mask of --image (white: repaint, black: keep), any size: resized to the "
                        "output size")
    p.add_argument("--mask-blur", type=int, default=None, metavar="N",
                   help="blur the mask first (Gaussian, radius N pixels: diffusers' mask_processor.blur)")
    p.add_argument("--outpaint", default=None, metavar="LEFT,TOP,RIGHT,BOTTOM",
                   help="outpainting: pixels added to each side of --image (filled with its edge pixels) and "
                        "repainted; the mask is white there (and --mask inside, if given)")
    p.add_argument("--controlnet", action="append", default=None, metavar="PATH[:SCALE]",
                   help="a ControlNet at SCALE (default 1): SD 1.x / SDXL (a diffusers ControlNetModel folder or an "
                        "original file), SD3.5 and FLUX.1 (diffusers folders; FLUX.1 also a ControlNet file alone: "
                        "InstantX's / Shakker-Labs' diffusion_pytorch_model.safetensors, XLabs' x-flux files); repeat "
                        "for several, each with its --control-image")
    p.add_argument("--control-image", action="append", default=None, metavar="FILE",
                   help="the control image of each --controlnet, in their order (used as it is: an edge map, a depth "
                        "map, a pose; resized to the output size; on SD 1.x / SDXL it sets the size when --width / --height "
                        "are left out)")
    p.add_argument("--control-mode", action="append", default=None, metavar="NAME_OR_INT",
                   help="the mode of each --controlnet's image, in their order, for a Union ControlNet (FLUX.1): "
                        "canny, tile, depth, blur, pose, gray, lq (0 to 6, as its model card numbers them) or a "
                        "number; none for a ControlNet that is no Union one, beside one that is")
    p.add_argument("--control-start", type=float, default=None, metavar="S",
                   help="the share of the steps after which the ControlNets start acting (0 to 1, default 0)")
    p.add_argument("--control-end", type=float, default=None, metavar="E",
                   help="the share of the steps after which they stop (0 to 1, default 1)")
    p.add_argument("--true-cfg-scale", type=float, default=None, metavar="S",
                   help="FLUX.1: true classifier-free guidance against --negative-prompt when above 1 (two forwards "
                        "a step; --guidance stays the embedded guidance)")
    p.add_argument("--clip-skip", type=int, default=None, metavar="N",
                   help="SD3.5, SD 1.x / SDXL: take the CLIP hidden state N layers earlier")
    p.add_argument("--quantize", default=None,
                   help="quantize while loading: bits for all (e.g. 4) or per component "
                        "(e.g. transformer=4,text_encoder_3=8); pN[:gG] palettized (e.g. unet=p6)")
    p.add_argument("--matmul", choices=("qmm", "dequantize"), default=None,
                   help="how quantized layers multiply (default per backend; see bench/RESULTS.md)")
    p.add_argument("--memory-limit", type=float, default=None, metavar="GB",
                   help="cap MLX memory; a component that cannot fit streams its blocks from its file")
    p.add_argument("--split", choices=("images", "guidance", "tensor"), default="images",
                   help="under mlx.launch: the images over the ranks (default), each image's two guidance "
                        "forwards over two ranks, or the transformer's blocks sharded over the ranks (FLUX.2, "
                        "SD3.5; each rank holds about 1/N of them); rank 0 writes")
    p.add_argument("--cache", default=None, metavar="first-block[:T] | taylorseer[:N[:K]]",
                   help="first-block: skip a step's transformer blocks after the first when its output changed less "
                        "than T since the last full step (diffusers' First Block Cache; T default 0.05, 0.1-0.2 skip "
                        "more at a visible cost). taylorseer: after 3 full forwards run one in N (default 5) and "
                        "predict the others from a Taylor series of order K (default 1) of the output (diffusers' "
                        "TaylorSeer, lite). SD3.5 and FLUX.2")
    p.add_argument("--report-memory", action="store_true", help="print the per-phase memory table")
    p.add_argument("--dtype", default=None, help="compute dtype: float32 (CPU default), bfloat16 (GPU default), "
                   "float16, float16-mixed (float16 with the transformer's residual streams in float32: for Macs "
                   "without bf16 arithmetic, M1/M2)")
    p.add_argument("--image", action="append", default=None, metavar="FILE",
                   help="FLUX.2: a reference image for editing (repeat for several, up to 10); with --strength the "
                        "init image of image-to-image. SD3.5: the init image of image-to-image (strength 0.6 unless "
                        "--strength)")
    p.add_argument("--strength", type=float, default=None, metavar="S",
                   help="image-to-image: the share of the steps run from the noised --image, above 0 and at most 1 "
                        "(1: from pure noise; SD3.5 default 0.6)")
    p.add_argument("--output", default="out.png", help="the PNG; several images: out-0.png, out-1.png, ...")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--preview", default=None, metavar="FILE",
                   help="write each denoising step's preview (the latents' RGB projection, at most 512 pixels a side) "
                        "to this PNG, replaced atomically")
    p.add_argument("--preview-vae", default=None, metavar="FILE",
                   help="--preview decoded by this tiny VAE (TAESD / TAESDXL / TAESD3 / TAEF1 / TAEF2 safetensors: "
                        "diffusers' AutoencoderTiny or madebyollin's *_decoder file) instead of the projection")
    return p.parse_args(argv)


def read_prompts(path) -> list:
    """The prompts of a --prompts-file: UTF-8 (a BOM is dropped), one a line, blank lines skipped; read with a bound,
    so that /dev/zero is refused rather than read forever."""
    data = read_capped(path, PROMPTS_FILE_BYTES, f"--prompts-file {path}", "split it")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise MlxdiffError(f"--prompts-file {path}: not UTF-8 text (byte 0x{data[e.start]:02x} at offset "
                           f"{e.start})") from None
    prompts = [line.strip() for line in text.splitlines() if line.strip()]
    if not prompts:
        raise MlxdiffError(f"--prompts-file {path}: has no prompts; write one prompt a line")
    return prompts


def job_seeds(seeds, num_images) -> list:
    if num_images is not None:
        num_images = check_number("num_images", num_images)
        if len(seeds) == 1:
            check_number("seed", seeds[0])
            seeds = [seeds[0] + i for i in range(num_images)]
        elif num_images != len(seeds):
            raise MlxdiffError(f"--num-images {num_images} with {len(seeds)} seeds: give one seed (N images from "
                               "it) or N seeds")
    return [check_number("seed", s) for s in seeds]


def output_names(output, count) -> list:
    """out.png for one image; out-0.png ... out-{count-1}.png for several."""
    path = Path(output)
    if count == 1:
        return [path]
    width = len(str(count - 1))
    return [path.with_name(f"{path.stem}-{i:0{width}d}{path.suffix}") for i in range(count)]


def job_bar(total, enabled):
    """One progress bar over every denoise step of the job (the pipeline's own bars are off)."""
    if not enabled:
        return None
    from tqdm.auto import tqdm  # heavy: tqdm.auto (about 100 modules)
    return tqdm(total=total, desc="generate", unit="step")


@dataclass
class Job:
    """What the command asks for, checked before any model is read."""
    prompts: list | None
    seeds: list
    count: int
    outputs: list
    quantize: object
    layers: object
    text_encoder: object
    text_encoders: object
    loras: list
    image_names: list
    images: list
    controlnets: list | None = None     # --controlnet: [(path, scale)]
    control_images: list | None = None  # --control-image: PIL images, one per ControlNet
    control_modes: list | None = None   # --control-mode: a Union ControlNet's mode (int) or None, one per ControlNet


def checked_job(args) -> Job:
    """Everything that can be checked without the model, checked before anything is read."""
    prompts = [check_text("prompt", args.prompt, lists=False)] if args.prompt is not None else None
    if args.prompts_file is not None:
        if prompts is not None:
            raise MlxdiffError("--prompt and --prompts-file: give one of them")
        prompts = [check_text("prompt", p, lists=False) for p in read_prompts(args.prompts_file)]
    check_text("negative_prompt", args.negative_prompt, lists=False)
    check_generate(width=args.width, height=args.height, steps=args.steps, guidance=args.guidance)
    seeds = job_seeds(args.seed, args.num_images)
    count = len(prompts or [None]) * len(seeds)
    if count > MAX_IMAGES:
        raise MlxdiffError(f"{count} images (prompts x seeds): at most {MAX_IMAGES} in one command")
    outputs = [check_writable(o) for o in output_names(check_png_name(args.output), count)]
    if args.preview is not None:
        check_writable(check_png_name(args.preview))
    if args.preview_vae is not None and args.preview is None:
        raise MlxdiffError(f"--preview-vae {args.preview_vae}: decodes the --preview images; give --preview FILE too")
    text_encoder, text_encoders = parse_text_encoders(args.text_encoder,
                                                      text_encoder_takers() if args.text_encoder else None)
    image_names, images = check_images(args.image, args.strength)     # files read and checked before the model
    if args.mask is not None and not images:
        raise MlxdiffError(f"--mask {args.mask}: a mask says where to repaint an image; give --image FILE too, or "
                           "leave --mask out")
    if check_outpaint(args.outpaint) is not None and not images:
        raise MlxdiffError(f"--outpaint {args.outpaint}: pads an image; give --image FILE too, or leave --outpaint out")
    if check_number("mask_blur", args.mask_blur) is not None and args.mask is None and args.outpaint is None:
        raise MlxdiffError(f"--mask-blur {args.mask_blur}: blurs a mask; give --mask FILE or --outpaint too, or leave "
                           "--mask-blur out")
    check_number("memory_limit", args.memory_limit)
    from .pipelines.step_cache import parse as parse_step_cache  # heavy: the pipelines import MLX and every family (about 0.6 s): --help and argument errors stay fast
    parse_step_cache(args.cache)
    controlnets, control_images, control_modes = checked_controls(args)
    return Job(prompts, seeds, count, outputs, parse_quantize(args.quantize), parse_layers(args.skip_guidance_layers),
               text_encoder, text_encoders, parse_loras(args.lora), image_names, images, controlnets, control_images,
               control_modes)


def text_encoder_takers() -> dict:
    """Who takes each --text-encoder form, for its refusals: load()'s text_encoder= (one FILE) and text_encoders=
    (NAME=FILE pairs) -> the titles of the families whose Family.keywords have it."""
    from .pipelines import FAMILIES  # heavy: the pipelines import MLX and every family (about 0.6 s)
    return {keyword: [f.title for f in FAMILIES if keyword in f.keywords]
            for keyword in ("text_encoder", "text_encoders")}


def control_mode_names() -> dict:
    """--control-mode's names -> mode numbers: the Union ControlNets' of the families that have them
    (Family.control_modes)."""
    from .pipelines import FAMILIES  # heavy: the pipelines import MLX and every family (about 0.6 s)
    return {name: number for f in FAMILIES for name, number in f.control_modes.items()}


def checked_controls(args):
    """--controlnet PATH[:SCALE] (a PATH whose name holds a colon is taken whole when it exists) and --control-image
    FILE, one per ControlNet, --control-start / --control-end, --control-mode (one per ControlNet when given; whether
    each takes a mode is the pipeline's check, once the ControlNets are read): checked before the model is read."""
    controlnets = None
    if args.controlnet:
        controlnets = []
        for value in args.controlnet:
            path, sep, tail = value.rpartition(":")
            if not sep or (Path(value).exists() and not Path(path).exists()):
                path, tail = value, "1"
            try:
                scale = float(tail)
            except ValueError:
                raise MlxdiffError(f"--controlnet {value!r}: SCALE {tail!r} is not a number; give PATH or "
                                   "PATH:SCALE, e.g. controlnet-canny:0.8") from None
            controlnets += check_controlnets([(path, scale)])
    _, control_images = check_images(args.control_image)
    for name in ("control_start", "control_end"):
        check_number("control_step", getattr(args, name))
    given = len(control_images)
    if controlnets is None and (given or args.control_start is not None or args.control_end is not None):
        raise MlxdiffError("--control-image / --control-start / --control-end: steer a ControlNet; give "
                           "--controlnet PATH too, or leave them out")
    if controlnets is not None and given != len(controlnets):
        raise MlxdiffError(f"--controlnet given {len(controlnets)} times but --control-image {given}: give one "
                           "control image per ControlNet, in their order")
    modes = None
    if args.control_mode is not None:
        if controlnets is None:
            raise MlxdiffError("--control-mode: the mode of a Union ControlNet's image; give --controlnet PATH and "
                               "--control-image FILE too, or leave it out")
        if len(args.control_mode) != len(controlnets):
            raise MlxdiffError(f"--controlnet given {len(controlnets)} times but --control-mode "
                               f"{len(args.control_mode)}: give one mode per ControlNet, in their order (none for "
                               "one that is no Union ControlNet)")
        names = control_mode_names()
        modes = [parse_control_mode(value, names) for value in args.control_mode]
    return controlnets, control_images or None, modes


def chosen_model(job: Job, args):
    """--model, or the embedded default (and its prompt when none is given) when neither a model nor a transformer
    file is (with --transformer: a family read from files alone)."""
    model = args.model
    if model is None and args.transformer is None:
        from . import default_model  # light CLI: keeps `import mlxdiff.generate`'s module set
        model = default_model.folder()
        print(f"mlxdiff: using the embedded default model {model}")
        print(f"mlxdiff: {default_model.NOTICE}")
        if job.prompts is None:
            job.prompts = [default_model.PROMPT]
            print(f"mlxdiff: prompt: {default_model.PROMPT}")
    job.prompts = job.prompts or ["a red circle on a blue background"]
    return model


def run_options(args, pipe, job: Job):
    """(generate()'s keywords, the strength the run uses, the steps): the family's own options given only when set
    (a family without one refuses it in one line), the image's size where the image sets it."""
    from .pipelines.family import check_options  # heavy: as mlxdiff.pipelines above
    width, height, steps, guidance = pipe.request(args.width, args.height, args.steps, args.guidance)
    options = dict(negative_prompt=args.negative_prompt, width=width, height=height, steps=steps, guidance=guidance)
    if job.layers is not None:
        options["skip_guidance_layers"] = job.layers
    if args.cache is not None:
        pipe.new_step_cache(args.cache)      # this family takes it: checked before anything is read
        options["cache"] = args.cache
    for name in ("scheduler", "clip_skip", "true_cfg_scale", "mask", "mask_blur", "outpaint"):
        value = check_outpaint(args.outpaint) if name == "outpaint" else getattr(args, name)
        if value is not None:
            if name not in pipe.OPTIONS:
                check_options(pipe.family, {name: value})
            options[name] = value
    strength = args.strength
    if job.images:
        pipe.check_images(job.image_names, job.images, strength)     # how this family takes them, before any load
        options.update(image=job.images, strength=strength)
        strength = pipe.default_strength(options) if strength is None else strength
        # references, an image to repaint (or pad), an init image that sizes: the image's size
        if strength is None or "mask" in options or "outpaint" in options or pipe.SIZE_OF_IMAGE:
            options.update(width=args.width, height=args.height)
    if job.control_images:      # the ControlNets' images (their size the output's when none is given)
        options.update(control_images=job.control_images, width=args.width, height=args.height,
                       **{name: getattr(args, name) for name in ("control_start", "control_end")
                          if getattr(args, name) is not None})
        if job.control_modes is not None:
            if "control_modes" not in pipe.OPTIONS:
                check_options(pipe.family, {"control_modes": job.control_modes})
            options["control_modes"] = job.control_modes
    return options, strength, steps


def png_metadata(args, pipe, job: Job, model, options, strength) -> dict:
    """What every PNG of the job records (the prompt, seed and size are added per image)."""
    given = {name: getattr(args, name) for name in ("scheduler", "cache", "true_cfg_scale", "mask", "mask_blur",
                                                    "outpaint")}
    base = {"negative_prompt": args.negative_prompt or "", "model": str(model or ""),
            "transformer": args.transformer or "", "text_encoder": " ".join(args.text_encoder or []),
            "vae": args.vae or "", "tokenizer": args.tokenizer or "",
            "steps": options["steps"], "guidance": options["guidance"], "dtype": pipe.dtype_name,
            **{k: v for k, v in given.items() if v not in (None, "")}, "generator": "mlxdiff"}
    if job.images:
        base.update(image=" ".join(job.image_names), **({} if strength is None else {"strength": strength}))
    if job.loras:
        from .lora import describe  # heavy: mlxdiff.lora imports numpy and the formats
        base["lora"] = describe(job.loras)
    if job.controlnets:
        base["controlnet"] = " ".join(f"{path}:{scale:g}" for path, scale in job.controlnets)
        base["control_image"] = " ".join(args.control_image)
        if args.control_mode:
            base["control_mode"] = " ".join(args.control_mode)
    return base


def rank_line(pipe, group, mine, count, shared, guidance_group) -> str:
    """What this rank of an mlx.launch job does."""
    images_here = ", ".join(str(k + 1) for k in mine) or "none"
    encoders = split_encoders(pipe)
    return (f"mlxdiff: rank {group.rank()} of {group.size()}: "
            + (f"images {images_here} of {count}" if shared is None else
               f"the {'unconditional' if group.rank() == 0 else 'conditional'} forward of every image"
               if guidance_group is not None else
               f"1/{group.size()} of the transformer's heads and feed-forward widths"
               + (f" (and of {', '.join(encoders)})" if encoders else "")
               + ", every image"))


def make_images(args, pipe, job: Job, options, base, mine, writes, group, calls, written) -> None:
    """This rank's images, one progress bar over all their steps; rank 0 (or the only process) writes them."""
    count = job.count
    plan = [(prompt, seed) for prompt in job.prompts for seed in job.seeds]
    bar = job_bar(len(mine) * calls, not args.no_progress)
    callback = None if bar is None else lambda i, t, x: bar.update(1)
    try:
        for k in mine:
            (prompt, seed), output = plan[k], job.outputs[k]
            if bar is not None and count > 1:
                bar.set_description(f"image {k + 1}/{count}")
            start = time.perf_counter()
            result = pipe.generate(prompt, seed=seed, callback=callback, progress_bar=False,
                                   on_step=None if args.preview is None else write_preview(args.preview), **options)
            if not writes:
                if args.report_memory:      # every rank's own table: a rank holds its share (issue 27)
                    print(f"rank {group.rank()}:\n{result.memory_report()}", flush=True)
                continue
            save_png(result.image, output, {"prompt": prompt, **base, "width": result.image.width,
                                            "height": result.image.height, "seed": seed})
            written.append(output)
            if count == 1:
                print(result.memory_report() if args.report_memory else result.summary())
            else:
                say = print if bar is None else bar.write      # a line above the bar, not through it
                say(f"mlxdiff: image {k + 1}/{count} (seed {seed}) in {time.perf_counter() - start:.1f} s: {output}")
                if args.report_memory:
                    say(result.memory_report())
    finally:
        if bar is not None:
            bar.close()
        pipe.release()


def write_preview(path):
    """--preview's on_step: each step's preview written over the last one (atomically: a viewer never reads half)."""
    def on_step(step):
        save_png(step.preview, path, {"step": f"{step.index + 1} of {step.total}", "generator": "mlxdiff"})
    return on_step


def closing_line(job: Job, group, writes, guidance_group, written) -> str:
    if group is None:
        outputs = job.outputs
        return (f"image written to {outputs[0].resolve()}" if job.count == 1 else
                f"{job.count} images written to {outputs[0].resolve()} ... {outputs[-1].name}")
    if writes:
        return f"rank {group.rank()}: {len(written)} of the {job.count} images written"
    return (f"rank {group.rank()}: computed its guidance forwards; rank 0 wrote the images" if guidance_group is not None
            else f"rank {group.rank()}: computed its share of the transformer; rank 0 wrote the images")


def generate(args, written) -> int:
    job = checked_job(args)
    from .distributed import check_same_job, job_group, share  # heavy: numpy
    model = chosen_model(job, args)
    t0 = time.perf_counter()
    group = job_group()       # started by mlx.launch (mlxdiff/distributed.py)
    if group is not None:
        check_same_job(group, repr(sorted(vars(args).items())))
    guidance_group = group if args.split == "guidance" else None
    tensor_group = group if args.split == "tensor" else None      # every rank makes every image, together
    shared = guidance_group or tensor_group
    from .pipelines import load as load_pipeline  # heavy: MLX and every family (about 0.6 s); mlxdiff.load with split=
    pipe = load_pipeline(model, group=shared, split=args.split if shared else None, transformer=args.transformer,
                         dtype=args.dtype, quantize=job.quantize, text_encoder=job.text_encoder,
                         text_encoders=job.text_encoders, vae=args.vae, tokenizer=args.tokenizer, matmul=args.matmul,
                         loras=job.loras, prediction_type=args.prediction_type, controlnets=job.controlnets,
                         download=not args.no_download, revision=args.revision,
                         keep=args.keep or ("auto" if job.count > 1 else "none"), memory_limit=args.memory_limit)
    options, strength, steps = run_options(args, pipe, job)
    if args.preview_vae is not None:
        pipe.set_preview_vae(args.preview_vae)
    base = png_metadata(args, pipe, job, model, options, strength)
    mine = share(job.count, None if shared else group)    # data-parallel: this rank's share of the images
    writes = shared is None or group.rank() == 0          # guidance- or tensor-parallel: rank 0 writes
    if group is not None:
        print(rank_line(pipe, group, mine, job.count, shared, guidance_group))
    calls = pipe.steps_run(steps, strength if job.images else None,
                           **({"scheduler": args.scheduler} if args.scheduler else {}))
    make_images(args, pipe, job, options, base, mine, writes, group, calls, written)
    what = closing_line(job, group, writes, guidance_group, written)
    print(f"mlxdiff: total {time.perf_counter() - t0:.1f} s; {what}")
    return 0


def split_encoders(pipe) -> list:
    """The text encoders a tensor-parallel pipeline splits over its ranks too (loading/tensor_parallel.shardable)."""
    from .loading.tensor_parallel import TensorParallelSpec  # heavy: MLX and the models (about 0.6 s)
    return [name for name, spec in pipe.components.items()
            if name.startswith("text_encoder") and isinstance(spec, TensorParallelSpec)]


def main(argv=None) -> int:
    args = parse_args(argv)
    written = []
    return run(lambda: generate(args, written), lambda: "interrupted; " + (
        f"{len(written)} image{'s' if len(written) > 1 else ''} written" if written else "no image written"))


if __name__ == "__main__":
    main_exit(main)
