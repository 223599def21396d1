"""float8 test material shared by several test modules (no test module imports another): a transformer file written
the way ComfyUI's fp8 files are (tests/test_fp8.py)."""

import json


PREFIX = "model.diffusion_model."
# what ComfyUI's fp8 files keep in bf16: the embedders, the shared modulations' neighbours and the final layer
KEEP = ("img_in.", "txt_in.", "time_in.", "guidance_in.", "final_layer.")


def _quantized_layers(bfl: dict) -> list:
    return [k[:-len(".weight")] for k, v in bfl.items()
            if k.endswith(".weight") and v.ndim == 2 and not k.startswith(KEEP)]


def comfy_file(bfl: dict, path, form: str):
    """Write `bfl` (BFL names, float32 torch tensors) the way ComfyUI's fp8 files are: the blocks' and modulations'
    linear weights float8_e4m3fn with a float32 scale each (amax / 448), everything else bf16, names under
    `model.diffusion_model.`. Returns ({name: float32 decoded weight}, the file's path)."""
    import torch
    from safetensors.torch import save_file
    tensors, decoded, layers = {}, {}, {}
    quantized = set(_quantized_layers(bfl))
    for name, value in bfl.items():
        layer = name[:-len(".weight")]
        if layer in quantized:
            scale = (value.abs().amax() / 448.0).float()
            codes = (value / scale).to(torch.float8_e4m3fn)
            tensors[PREFIX + name] = codes
            decoded[name] = codes.float() * scale
            if form == "scaled_fp8":
                tensors[PREFIX + layer + ".scale_weight"] = scale.reshape(())
                if "img_attn" in layer:
                    tensors[PREFIX + layer + ".scale_input"] = torch.ones((), dtype=torch.float32)
            else:
                conf = {"format": "float8_e4m3fn"}
                tensors[PREFIX + layer + ".weight_scale"] = scale.reshape(())
                tensors[PREFIX + layer + ".comfy_quant"] = torch.tensor(list(json.dumps(conf).encode()),
                                                                        dtype=torch.uint8)
                layers[PREFIX + layer] = conf
        else:
            tensors[PREFIX + name] = value.to(torch.bfloat16).contiguous()
            decoded[name] = tensors[PREFIX + name].float()
    metadata = None
    if form == "scaled_fp8":
        tensors[PREFIX + "scaled_fp8"] = torch.empty(0, dtype=torch.float8_e4m3fn)
    else:
        metadata = {"_quantization_metadata": json.dumps({"format_version": "1.0", "layers": layers})}
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata=metadata)
    return decoded, path
