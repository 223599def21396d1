"""SD 1.x / SDXL checkpoints written the way the original tools write them, from diffusers/transformers state dicts:
ldm / SGM names (what `v1-5-pruned-emaonly.safetensors` and `sd_xl_base_1.0.safetensors` hold) and
stable-diffusion.cpp's GGUF names (what its `convert` writes, with its choice of which tensors it quantizes).

The inverse maps here are written from the ldm layout (openaimodel.py's flat input/output blocks, the ldm VAE's
numbering, OpenCLIP's text tower), not from mlxdiff's tables; tests/test_sd_single_file.py proves them against
diffusers' own converters (single_file_utils.convert_ldm_*), which must give back the diffusers state dict exactly.

Also the UNet family's tiny diffusers twins (sd15_components, sd2_components, sdxl_components: every dimension
distinct), strong enough that the image sees the prompt, CFG, the sampler and SDXL's sizes (wake_norms_), and the
reference run every pipeline parity test compares with (reference: diffusers' final latents and image of one run).
"""

import copy
import re

import numpy as np

from helpers import ASSETS, FIXTURES

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


# -- the tiny diffusers twins of the UNet family (tests/test_sd_pipeline.py, test_coreml_pipeline.py, ...) ---------

def wake_norms_(model):
    """randomize_ leaves every GroupNorm / LayerNorm weight near 0 unless its name ends in "norm" (the resnets'
    norm1 / norm2, the transformer blocks' norm1-3, CLIP's layer_norm1 / 2, the VAE's): every branch behind such a
    norm then adds almost nothing, and diffusers' own image moved by 1 level when the prompt, CFG or the sampler
    changed (issue 47). Near 1, as in a trained model, each of them reaches the image (tests/parity.py checks it)."""
    import torch
    with torch.no_grad():
        for name, m in model.named_modules():
            if isinstance(m, (torch.nn.GroupNorm, torch.nn.LayerNorm)) and m.weight is not None \
                    and not name.endswith("norm"):
                m.weight.add_(1.0)
    return model


def twin_(model, seed, scale=0.15):
    from helpers import randomize_
    return wake_norms_(randomize_(model, seed=seed, scale=scale)).eval()


def clip_twin(with_projection, hidden, layers, heads, inter, projection=None, act="quick_gelu", seed=0):
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection
    import torch
    config = CLIPTextConfig(vocab_size=49408, hidden_size=hidden, intermediate_size=inter,
                            projection_dim=projection or hidden, num_hidden_layers=layers, num_attention_heads=heads,
                            max_position_embeddings=77, hidden_act=act, bos_token_id=49406, eos_token_id=49407,
                            pad_token_id=1)
    torch.manual_seed(seed)
    return (CLIPTextModelWithProjection if with_projection else CLIPTextModel)(config)


def clip_tokenizer(pad="<|endoftext|>"):
    from transformers import CLIPTokenizer
    vocab = FIXTURES / "clip" if (FIXTURES / "clip" / "vocab.json").exists() else ASSETS / "clip"
    return CLIPTokenizer(str(vocab / "vocab.json"), str(vocab / "merges.txt"), model_max_length=77, pad_token=pad)


def vae_twin(scaling, seed):
    from diffusers import AutoencoderKL
    import torch
    torch.manual_seed(seed)
    return AutoencoderKL(in_channels=3, out_channels=3, block_out_channels=(8, 12, 16), layers_per_block=1,
                         latent_channels=4, norm_num_groups=4, down_block_types=("DownEncoderBlock2D",) * 3,
                         up_block_types=("UpDecoderBlock2D",) * 3, scaling_factor=scaling, sample_size=64)


def sd15_components(scheduler="PNDMScheduler"):
    import diffusers
    import torch
    from diffusers import UNet2DConditionModel
    torch.manual_seed(0)
    unet = UNet2DConditionModel(
        sample_size=12, in_channels=4, out_channels=4, block_out_channels=(16, 24), norm_num_groups=8,
        layers_per_block=1, down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=20, attention_head_dim=4)
    text_encoder = clip_twin(False, 20, 2, 4, 36, seed=1)
    vae = vae_twin(0.18215, 2)
    for i, m in enumerate((unet, text_encoder, vae)):
        twin_(m, seed=10 + i)
    sched = getattr(diffusers, scheduler).from_config(dict(  # SD 1.5's scheduler_config.json
        beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", steps_offset=1, skip_prk_steps=True,
        set_alpha_to_one=False, clip_sample=False))
    return dict(unet=unet, vae=vae, text_encoder=text_encoder, tokenizer=clip_tokenizer(), scheduler=sched,
                safety_checker=None, feature_extractor=None, requires_safety_checker=False)


def sd2_components():
    """SD 2.x's shape of the family: linear projections, 64-wide-head-like head counts per level, a v-prediction
    DDIM config (as stable-diffusion-2-1's scheduler_config.json)."""
    import diffusers
    import torch
    from diffusers import UNet2DConditionModel
    parts = sd15_components()
    torch.manual_seed(0)
    parts["unet"] = twin_(UNet2DConditionModel(
        sample_size=12, in_channels=4, out_channels=4, block_out_channels=(16, 32), norm_num_groups=8,
        layers_per_block=1, down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=20, attention_head_dim=(2, 4),
        use_linear_projection=True), seed=13)
    parts["scheduler"] = diffusers.DDIMScheduler.from_config(dict(
        beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", steps_offset=1, clip_sample=False,
        set_alpha_to_one=False, prediction_type="v_prediction"))
    return parts


def sdxl_components():
    import torch
    from diffusers import EulerDiscreteScheduler, UNet2DConditionModel
    torch.manual_seed(0)
    text_encoder = clip_twin(False, 16, 2, 2, 28, seed=1)
    text_encoder_2 = clip_twin(True, 24, 3, 3, 40, projection=12, act="gelu", seed=2)
    unet = UNet2DConditionModel(
        sample_size=12, in_channels=4, out_channels=4, block_out_channels=(16, 32), norm_num_groups=8,
        layers_per_block=(1, 2), down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), cross_attention_dim=40, attention_head_dim=(2, 4),
        transformer_layers_per_block=(1, 2), use_linear_projection=True, addition_embed_type="text_time",
        addition_time_embed_dim=8, projection_class_embeddings_input_dim=12 + 6 * 8)
    vae = vae_twin(0.13025, 3)
    for i, m in enumerate((unet, text_encoder, text_encoder_2, vae)):   # the UNet at 0.1: at 0.15 its DDIM img2img
        twin_(m, seed=20 + i, scale=0.1 if m is unet else 0.15)        # run amplified float32 rounding to 4e-5
    sched = EulerDiscreteScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", steps_offset=1,
                                   timestep_spacing="leading")
    return dict(unet=unet, vae=vae, text_encoder=text_encoder, text_encoder_2=text_encoder_2,
                tokenizer=clip_tokenizer(), tokenizer_2=clip_tokenizer("!"), scheduler=sched)


def with_scheduler(pipe, name):
    """A new diffusers pipeline (the same models) with the scheduler mlxdiff's sampler `name` stands for, over the
    pipeline's scheduler config; `pipe` itself is left as it is (a shared fixture)."""
    import diffusers
    from mlxdiff import ldm_schedulers
    cls, _, overrides = ldm_schedulers.SCHEDULERS[name]
    plms = {"skip_prk_steps": True} if name == "pndm" else {}     # what mlxdiff's pndm is over another config
    other = copy.copy(pipe)       # DiffusionPipeline.__setattr__ gives the copy its own config dict
    other.scheduler = getattr(diffusers, cls).from_config(pipe.scheduler.config, **overrides, **plms)
    return other


def reference(pipe, scheduler=None, **kwargs):
    """diffusers' run of `pipe` (with mlxdiff's sampler `scheduler`, else its own): (the final latents as the
    pipeline hands them to the VAE, scaled as mlxdiff's Result.latents are; the float image in [0, 1])."""
    if scheduler is not None:
        pipe = with_scheduler(pipe, scheduler)
    final = {}

    def keep_latents(_, i, t, tensors):
        final["latents"] = tensors["latents"].detach().numpy().copy()
        return {}
    image = pipe(output_type="np", callback_on_step_end=keep_latents, **kwargs).images[0]
    return final["latents"], image


def showing_moves(what, run):
    """`run` (a parity.assert_inputs_matter reference), printing how far each run after the first moved diffusers'
    latents and image from the first, and which keywords it changed: `pytest -s` shows each check's margin."""
    from parity import levels, rel_diff
    first = {}

    def call(**kwargs):
        latents, image = run(**kwargs)
        if not first:
            first.update(kwargs=kwargs, latents=latents, image=image)
        else:
            changed = sorted(k for k in kwargs if kwargs[k] is not first["kwargs"].get(k))
            moved = rel_diff(latents, first["latents"])
            shift = levels(np.round(image * 255).astype(np.uint8), first["image"])
            print(f"{what}: {', '.join(changed)} changed: diffusers' latents moved {moved:.1e}, image {shift} levels")
        return latents, image
    return call


# -- the tiny UNets of tests/test_unet.py, and the LoRA tests' CLIP twins and inputs (tests/test_lora_unet.py) ---------

UNET_CONFIGS = {
    "sd15": dict(
        config=dict(sample_size=16, in_channels=4, out_channels=5, block_out_channels=(32, 48, 64),
                    norm_num_groups=8, layers_per_block=2,
                    down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
                    up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
                    cross_attention_dim=24, attention_head_dim=8, use_linear_projection=False),
        batch=2, size=(16, 24), seq=7, text=None),
    "sdxl": dict(
        config=dict(sample_size=16, in_channels=4, out_channels=4, block_out_channels=(32, 48),
                    norm_num_groups=8, layers_per_block=(1, 2),
                    down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
                    up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
                    cross_attention_dim=40, attention_head_dim=(2, 4), transformer_layers_per_block=(1, 2),
                    use_linear_projection=True, addition_embed_type="text_time", addition_time_embed_dim=8,
                    projection_class_embeddings_input_dim=20 + 6 * 8, flip_sin_to_cos=True, freq_shift=0),
        batch=2, size=(12, 20), seq=5, text=20),
}


# CLIP-L-like (SD 1.5's encoder, SDXL's first; no projection) and CLIP-G-like (SDXL's second, projected)
CLIPS = {
    "L": dict(vocab_size=97, hidden_size=40, intermediate_size=52, num_hidden_layers=2, num_attention_heads=5,
              max_position_embeddings=23, hidden_act="quick_gelu", layer_norm_eps=1e-5, bos_token_id=0,
              eos_token_id=2, pad_token_id=1),
    "G": dict(vocab_size=101, hidden_size=48, intermediate_size=60, projection_dim=44, num_hidden_layers=2,
              num_attention_heads=4, max_position_embeddings=19, hidden_act="gelu", layer_norm_eps=1e-5,
              bos_token_id=98, eos_token_id=95, pad_token_id=0),
}
# the UNets of tests/test_unet.py, and an SDXL-like one with as many layers on each level (what SGM's flat
# input_blocks / output_blocks numbering of kohya's SDXL files needs, as every released UNet has)
UNETS = {**UNET_CONFIGS,
         "sgm": {**UNET_CONFIGS["sdxl"], "config": {**UNET_CONFIGS["sdxl"]["config"], "layers_per_block": 2}}}


def unet_inputs(family):
    spec = UNETS[family]
    cfg, b, (h, w) = spec["config"], spec["batch"], spec["size"]
    rng = np.random.default_rng(5)
    x = {"sample": rng.standard_normal((b, cfg["in_channels"], h, w)).astype(np.float32),
         "timestep": np.array([981.0, 33.0], np.float32),
         "context": rng.standard_normal((b, spec["seq"], cfg["cross_attention_dim"])).astype(np.float32),
         "ids": {w: rng.integers(3, CLIPS[w]["vocab_size"] - 1, size=(2, 11)) for w in CLIPS}}
    if spec["text"]:
        x["added"] = {"text_embeds": rng.standard_normal((b, spec["text"])).astype(np.float32),
                      "time_ids": np.array([[1024, 768, 0, 16, 1024, 768], [512, 512, 8, 0, 640, 512]], np.float32)}
    return x


# -- original single files (ldm / SGM names) of tiny SD 1.5 / SDXL twins (tests/test_sd_single_file.py) ----------------

CLIP_L = dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=1,
              max_position_embeddings=16, hidden_act="quick_gelu", eos_token_id=2, bos_token_id=0, pad_token_id=1)
BIG_G = dict(vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=2,
             max_position_embeddings=16, hidden_act="gelu", projection_dim=96, eos_token_id=2, bos_token_id=0,
             pad_token_id=1)
FAMILIES = {
    "sd15": dict(
        unet=dict(sample_size=16, in_channels=4, out_channels=4, block_out_channels=(32, 64, 96), layers_per_block=2,
                  down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
                  up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=64,
                  attention_head_dim=8, use_linear_projection=False, norm_num_groups=32),
        vae=dict(block_out_channels=(32, 64), layers_per_block=1, latent_channels=4, norm_num_groups=32,
                 down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2),
        clip_prefix="cond_stage_model.transformer.", big_g=False, qtype="Q8_0", size=(16, 24)),
    "sdxl": dict(
        unet=dict(sample_size=16, in_channels=4, out_channels=4, block_out_channels=(64, 128), layers_per_block=1,
                  down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
                  up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), cross_attention_dim=192,
                  transformer_layers_per_block=(1, 2), attention_head_dim=(1, 2), use_linear_projection=True,
                  addition_embed_type="text_time", addition_time_embed_dim=256,
                  projection_class_embeddings_input_dim=96 + 6 * 256, norm_num_groups=32),
        vae=dict(block_out_channels=(32, 32, 64), layers_per_block=2, latent_channels=4, norm_num_groups=32,
                 down_block_types=("DownEncoderBlock2D",) * 3, up_block_types=("UpDecoderBlock2D",) * 3),
        clip_prefix="conditioner.embedders.0.transformer.", big_g=True, qtype="Q4_0", size=(12, 20)),
}
BIG_G_PREFIX = "conditioner.embedders.1.model."


def _numpy(state):
    return {k: v.detach().float().numpy().copy() for k, v in state.items()}


def _state(model) -> dict:
    """A torch model's state dict in the names its checkpoints hold: transformers 5's CLIPTextModel leaves out the
    `text_model.` level that every CLIP-L checkpoint (and CLIPTextModelWithProjection) has."""
    state = {k: v for k, v in model.state_dict().items() if not k.endswith("position_ids")}
    if type(model).__name__ == "CLIPTextModel":
        state = {k if k.startswith("text_model.") else "text_model." + k: v for k, v in state.items()}
    return state


def _checkpoint(models, spec) -> dict:
    """The ldm / SGM-named checkpoint {name: float32 numpy} of the torch models."""
    cfg = spec["unet"]
    up_attention = [t == "CrossAttnUpBlock2D" for t in cfg["up_block_types"]]
    out = {"model.diffusion_model." + k: v
           for k, v in unet_to_ldm(_numpy(_state(models["unet"])), cfg["layers_per_block"], up_attention).items()}
    out.update({"first_stage_model." + k: v for k, v in
                vae_to_ldm(_numpy(_state(models["vae"])), len(spec["vae"]["block_out_channels"])).items()})
    out.update({spec["clip_prefix"] + k: v for k, v in _numpy(_state(models["text_encoder"])).items()})
    if spec["big_g"]:
        out.update({BIG_G_PREFIX + k: v for k, v in
                    clip_to_openclip(_numpy(_state(models["text_encoder_2"])), np.concatenate).items()})
    return {k: np.ascontiguousarray(v) for k, v in out.items()}   # safetensors.numpy writes the buffer as laid out
