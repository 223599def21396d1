"""mlxdiff.load: what the user named -> a pipeline of the right family (holding specs, not weights)."""

from pathlib import Path

from ..errors import MlxdiffError
from ..loading import sources


def load(model, *, transformer=None, dtype=None, text_encoders=None, quantize=None, matmul=None):
    """`model`: a diffusers pipeline folder, a hub id in the local HF cache, or an original single file.
    `transformer`: optional file that replaces the denoiser. `dtype`: compute dtype (default: float32 on the CPU,
    bfloat16 on GPUs). `text_encoders`: for single files, {'clip_l': FILE, 'clip_g': FILE, 't5xxl': FILE}.
    `quantize`: bits for every component, or {component: bits}, applied while loading (see loading/quantize.py).
    `matmul`: "qmm" or "dequantize" for layers kept quantized (default per backend: backend.default_matmul_strategy).
    """
    pipe = _load(model, transformer=transformer, dtype=dtype, text_encoders=text_encoders)
    sources.apply_quantize(pipe.components, quantize)
    if matmul is not None:
        from ..loading.matmul import STRATEGIES
        if matmul not in STRATEGIES:
            raise MlxdiffError(f"matmul={matmul!r}: use one of {', '.join(STRATEGIES)}")
        for spec in pipe.components.values():
            if spec is not None:
                spec.matmul = matmul
    return pipe


def _load(model, *, transformer, dtype, text_encoders):
    from . import sd3
    path = sources.resolve_path(model)
    if transformer is not None and not Path(transformer).is_file():
        raise MlxdiffError(f"{transformer}: transformer file not found")
    if path.is_dir():
        pipeline_class, components = sources.read_pipeline_folder(path)
        family = sources.PIPELINE_FAMILIES[pipeline_class]
        if family == "sd3":
            return sd3.from_folder(path, components, dtype=dtype, transformer=transformer)
        from . import flux2
        return flux2.from_folder(path, pipeline_class, components, dtype=dtype, transformer=transformer)
    if path.suffix == ".safetensors":
        names = list(sources.tensor_shapes(path))
        if any(n.startswith("model.diffusion_model.joint_blocks.") for n in names):
            return sd3.from_single_file(path, dtype=dtype, transformer=transformer, text_encoders=text_encoders)
        raise MlxdiffError(f"{path}: not a full SD3.5 single file; for a FLUX.2 or GGUF transformer, load the "
                           "pipeline folder and pass the file as transformer=")
    raise MlxdiffError(f"{path}: expected a pipeline folder (with model_index.json) or a .safetensors file")
