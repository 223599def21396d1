"""A denoiser given as one file (a GGUF, or a safetensors in the original naming), loaded by diffusers'
from_single_file with the folder's transformer config: the published recipe for GGUF checkpoints (FLUX.2-dev
Q4_K_M, say), computing in bfloat16. Says on stdout what it loaded (read by mlxdiff.footprint's tests)."""

from pathlib import Path


def load(cls, path, folder, dtype):
    import torch  # optional: the reference extra
    from diffusers import GGUFQuantizationConfig  # optional: the reference extra
    kwargs = {}
    gguf = Path(path).suffix.lower() == ".gguf"
    if gguf:
        kwargs["quantization_config"] = GGUFQuantizationConfig(compute_dtype=torch.bfloat16)
    model = cls.from_single_file(str(path), config=str(Path(folder) / "transformer"), torch_dtype=dtype, **kwargs)
    types = {}
    for p in model.parameters():
        name = getattr(getattr(p, "quant_type", None), "name", None) or str(p.dtype).replace("torch.", "")
        types[name] = types.get(name, 0) + 1
    print(f"mlxdiff.reference: transformer from {path} ({'GGUF' if gguf else 'single file'}; tensors by type: "
          + ", ".join(f"{k} {v}" for k, v in sorted(types.items())) + ")", flush=True)
    return model
