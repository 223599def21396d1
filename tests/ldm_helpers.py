"""SD 1.x / SDXL checkpoints written the way the original tools write them, from diffusers/transformers state dicts:
ldm / SGM names (what `v1-5-pruned-emaonly.safetensors` and `sd_xl_base_1.0.safetensors` hold) and
stable-diffusion.cpp's GGUF names (what its `convert` writes, with its choice of which tensors it quantizes).

The inverse maps here are written from the ldm layout (openaimodel.py's flat input/output blocks, the ldm VAE's
numbering, OpenCLIP's text tower), not from mlxdiff's tables; tests/test_sd_single_file.py proves them against
diffusers' own converters (single_file_utils.convert_ldm_*), which must give back the diffusers state dict exactly.
"""

import re

import numpy as np

RESNET = {"norm1": "in_layers.0", "conv1": "in_layers.2", "time_emb_proj": "emb_layers.1", "norm2": "out_layers.0",
          "conv2": "out_layers.3", "conv_shortcut": "skip_connection"}
UNET_TOP = {"time_embedding.linear_1": "time_embed.0", "time_embedding.linear_2": "time_embed.2",
            "add_embedding.linear_1": "label_emb.0.0", "add_embedding.linear_2": "label_emb.0.2",
            "conv_in": "input_blocks.0.0", "conv_norm_out": "out.0", "conv_out": "out.2"}


def unet_to_ldm(state: dict, layers_per_block: int, up_attention: list) -> dict:
    """diffusers UNet2DConditionModel state dict -> ldm names (no prefix). `up_attention[b]`: whether up block b has
    attentions (the upsampler then sits at sub-index 2, after the SpatialTransformer, else at 1)."""
    per = layers_per_block + 1
    out = {}
    for key, value in state.items():
        module, leaf = key.rsplit(".", 1)
        if module in UNET_TOP:
            out[f"{UNET_TOP[module]}.{leaf}"] = value
            continue
        parts = module.split(".")
        if parts[0] == "mid_block":
            kind, i, rest = parts[1], int(parts[2]), parts[3:]
            block = {("resnets", 0): "middle_block.0", ("attentions", 0): "middle_block.1",
                     ("resnets", 1): "middle_block.2"}[(kind, i)]
        elif parts[0] in ("down_blocks", "up_blocks"):
            level, kind, i, rest = int(parts[1]), parts[2], int(parts[3]), parts[4:]
            if parts[0] == "down_blocks":
                n = 1 + level * per + (layers_per_block if kind == "downsamplers" else i)
                block = {"resnets": f"input_blocks.{n}.0", "attentions": f"input_blocks.{n}.1",
                         "downsamplers": f"input_blocks.{n}.0"}[kind]
                if kind == "downsamplers":
                    rest = ["op"]
            else:
                n = level * per + (layers_per_block if kind == "upsamplers" else i)
                block = {"resnets": f"output_blocks.{n}.0", "attentions": f"output_blocks.{n}.1",
                         "upsamplers": f"output_blocks.{n}.{2 if up_attention[level] else 1}"}[kind]
        else:
            raise KeyError(key)
        if kind == "resnets":
            rest = [RESNET[rest[0]]]
        out[".".join([block, *rest, leaf])] = value
    return out


def vae_to_ldm(state: dict, levels: int) -> dict:
    """diffusers AutoencoderKL state dict -> ldm VAE names (no prefix); the mid attention's Linears as 1x1 convs."""
    out = {}
    for key, value in state.items():
        k = key.replace("conv_norm_out", "norm_out").replace("conv_shortcut", "nin_shortcut")
        k = re.sub(r"encoder\.down_blocks\.(\d+)\.resnets\.", r"encoder.down.\1.block.", k)
        k = re.sub(r"encoder\.down_blocks\.(\d+)\.downsamplers\.0\.", r"encoder.down.\1.downsample.", k)
        k = re.sub(r"decoder\.up_blocks\.(\d+)\.resnets\.", lambda m: f"decoder.up.{levels - 1 - int(m[1])}.block.", k)
        k = re.sub(r"decoder\.up_blocks\.(\d+)\.upsamplers\.0\.",
                   lambda m: f"decoder.up.{levels - 1 - int(m[1])}.upsample.", k)
        k = re.sub(r"mid_block\.resnets\.(\d)\.", lambda m: f"mid.block_{int(m[1]) + 1}.", k)
        m = re.fullmatch(r"(encoder|decoder)\.mid_block\.attentions\.0\.(\w+)(?:\.0)?\.(weight|bias)", k)
        if m:
            part = {"group_norm": "norm", "to_q": "q", "to_k": "k", "to_v": "v", "to_out": "proj_out"}[m[2]]
            k = f"{m[1]}.mid.attn_1.{part}.{m[3]}"
            if m[2] != "group_norm" and m[3] == "weight":
                value = value[:, :, None, None]
        out[k] = value
    return out


OPENCLIP_LAYER = {"self_attn.out_proj": "attn.out_proj", "layer_norm1": "ln_1", "layer_norm2": "ln_2",
                  "mlp.fc1": "mlp.c_fc", "mlp.fc2": "mlp.c_proj"}


def clip_to_openclip(state: dict, concat) -> dict:
    """transformers CLIPTextModelWithProjection state dict -> OpenCLIP text-tower names (no prefix): q, k, v fused
    into in_proj, text_projection stored transposed (used as x @ P). `concat` joins arrays along axis 0."""
    out, fused = {}, {}
    for key, value in state.items():
        if key == "text_model.embeddings.position_ids":
            continue
        if key == "text_model.embeddings.token_embedding.weight":
            out["token_embedding.weight"] = value
        elif key == "text_model.embeddings.position_embedding.weight":
            out["positional_embedding"] = value
        elif key.startswith("text_model.final_layer_norm."):
            out["ln_final." + key.rsplit(".", 1)[1]] = value
        elif key == "text_projection.weight":
            out["text_projection"] = value.T
        else:
            m = re.fullmatch(r"text_model\.encoder\.layers\.(\d+)\.(.+)\.(weight|bias)", key)
            layer, module, leaf = m[1], m[2], m[3]
            if module in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"):
                fused.setdefault((layer, leaf), {})[module[10]] = value
                continue
            out[f"transformer.resblocks.{layer}.{OPENCLIP_LAYER[module]}.{leaf}"] = value
    for (layer, leaf), qkv in fused.items():
        out[f"transformer.resblocks.{layer}.attn.in_proj_{leaf}"] = concat([qkv["q"], qkv["k"], qkv["v"]])
    return out


# stable-diffusion.cpp's convert_tensor_name for the OpenCLIP text tower (name_conversion.cpp:
# convert_open_clip_to_hf_clip_name; the prefix conditioner.embedders.1. becomes cond_stage_model.1.)
SDCPP_OPENCLIP = {"ln_final.weight": "transformer.text_model.final_layer_norm.weight",
                  "ln_final.bias": "transformer.text_model.final_layer_norm.bias",
                  "positional_embedding": "transformer.text_model.embeddings.position_embedding.weight",
                  "token_embedding.weight": "transformer.text_model.embeddings.token_embedding.weight",
                  "text_projection": "transformer.text_model.text_projection"}
SDCPP_RESBLOCK = {"attn.in_proj_weight": "self_attn.in_proj.weight", "attn.in_proj_bias": "self_attn.in_proj.bias",
                  "attn.out_proj.weight": "self_attn.out_proj.weight", "attn.out_proj.bias": "self_attn.out_proj.bias",
                  "ln_1.weight": "layer_norm1.weight", "ln_1.bias": "layer_norm1.bias",
                  "ln_2.weight": "layer_norm2.weight", "ln_2.bias": "layer_norm2.bias",
                  "mlp.c_fc.weight": "mlp.fc1.weight", "mlp.c_fc.bias": "mlp.fc1.bias",
                  "mlp.c_proj.weight": "mlp.fc2.weight", "mlp.c_proj.bias": "mlp.fc2.bias"}


def sdcpp_name(name: str) -> str:
    """An SD 1.x / SDXL checkpoint name -> the name stable-diffusion.cpp's convert writes (UNet and VAE names stay)."""
    if name.startswith("conditioner.embedders.0."):
        return "cond_stage_model." + name[len("conditioner.embedders.0."):]
    if name.startswith("conditioner.embedders.1.model."):
        rest = name[len("conditioner.embedders.1.model."):]
        if rest in SDCPP_OPENCLIP:
            return "cond_stage_model.1." + SDCPP_OPENCLIP[rest]
        m = re.fullmatch(r"transformer\.resblocks\.(\d+)\.(.+)", rest)
        return f"cond_stage_model.1.transformer.text_model.encoder.layers.{m[1]}.{SDCPP_RESBLOCK[m[2]]}"
    return name


def sdcpp_quantizes(name: str, shape, block=32) -> bool:
    """ModelLoader::tensor_should_be_converted (stable-diffusion.cpp), for a UNet-family checkpoint."""
    if shape[-1] % block:      # ne[0], the row length: every conv kernel (3 or 1 wide) stays as stored
        return False
    if name.endswith(".bias") or "time_embed." in name or "label_emb." in name or "embedding" in name:
        return False
    return True


def write_sdcpp_gguf(path, checkpoint: dict, qtype) -> dict:
    """checkpoint {ldm name: float32 numpy} -> a GGUF as stable-diffusion.cpp's `convert --type <qtype>` writes it:
    its names, the tensors it quantizes in `qtype`, 4-D kernels F16 (as a fp16 checkpoint stores them), the rest
    F32. Returns {ldm name: float32 numpy as the file decodes it (gguf-py's dequantize)}."""
    from gguf import GGMLQuantizationType as T, GGUFWriter
    from gguf import quants as gq
    w = GGUFWriter(str(path), "stable-diffusion")   # sd.cpp reads no architecture key; names say what a tensor is
    decoded = {}
    for name, value in checkpoint.items():
        value = np.ascontiguousarray(value, dtype=np.float32)
        gname = sdcpp_name(name)
        if sdcpp_quantizes(gname, value.shape):
            blocks = gq.quantize(value, qtype)
            w.add_tensor(gname, blocks, raw_dtype=qtype)
            decoded[name] = gq.dequantize(blocks, qtype).reshape(value.shape).astype(np.float32)
        elif value.ndim == 4:
            w.add_tensor(gname, value.astype(np.float16), raw_dtype=T.F16)
            decoded[name] = value.astype(np.float16).astype(np.float32)
        else:
            w.add_tensor(gname, value)
            decoded[name] = value
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return decoded
