"""Tiny torch twins and test-side converters shared by several test modules (no test module imports another).

- FLUX.2 text encoders: the stand-in chat tokenizers (MISTRAL_TEMPLATE, QWEN3_TEMPLATE, build_tokenizer) and tiny
  randomized Mistral3 / Qwen3 models saved with save_pretrained (save_mistral3, save_qwen3);
- the FLUX.2 VAE twin (make_flux2_twin);
- diffusers -> original naming of the transformers (flux2_to_bfl, sd3_to_sai) and of the VAE (diffusers_to_ldm);
- a whole tiny FLUX.2 pipeline (build_pipeline), the sizes it is run at (H, W, SEQ / text_length, TAPS) and
  diffusers' run of it with its final latents (flux2_reference);
- smooth random input pictures for the image-input tests (picture).
"""

import re

from helpers import randomize_


# -- FLUX.2 text encoders ------------------------------------------------------------------------------------------

CORPUS = ["a red fox sitting in the snow at dawn, soft light", "a photo of a cat on a wooden table",
          "You are an AI that reasons about image descriptions.", "object relationships, attribution and actions",
          "a watercolor painting of a lighthouse by the sea", "the quick brown fox jumps over the lazy dog"]

MISTRAL_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if messages[0]['role'] == 'system' %}"
    "{%- if messages[0]['content'] is string %}{%- set system_message = messages[0]['content'] %}"
    "{%- else %}{%- set system_message = messages[0]['content'][0]['text'] %}{%- endif %}"
    "{%- set loop_messages = messages[1:] %}"
    "{%- else %}{%- set loop_messages = messages %}{%- endif %}"
    "{%- if system_message is defined %}{{- '[SYSTEM_PROMPT]' + system_message + '[/SYSTEM_PROMPT]' }}{%- endif %}"
    "{%- for message in loop_messages %}"
    "{%- if message['role'] == 'user' %}{{- '[INST]' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for block in message['content'] %}{%- if block['type'] == 'text' %}{{- block['text'] }}"
    "{%- endif %}{%- endfor %}{%- endif %}{{- '[/INST]' }}"
    "{%- elif message['role'] == 'assistant' %}{{- message['content'] + eos_token }}{%- endif %}"
    "{%- endfor %}")
from tools.train_klein_shapes.train import QWEN3_TEMPLATE  # noqa: E402  (the real Qwen3 chat template)


def build_tokenizer(folder, specials, template, padding_side, pad, bos=None, eos=None, add_bos=False):
    """A stand-in chat tokenizer saved in `folder`: byte-level BPE trained on CORPUS, the family's special tokens
    and a chat template in the family's format."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=300, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    if add_bos:  # like Mistral's tokenizer.json: add_special_tokens prepends <s>, so a doubled BOS would show
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A $B",
                                                           special_tokens=[(bos, tok.token_to_id(bos))])
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos, pad_token=pad,
                                              padding_side=padding_side, chat_template=template)
    hf.save_pretrained(folder)
    return folder


def save_mistral3(folder, text, vision, seed, scale=0.2, positions=128):
    import transformers
    config = transformers.Mistral3Config(text_config=dict(model_type="mistral", max_position_embeddings=positions,
                                                          **text),
                                         vision_config=dict(model_type="pixtral", **vision),
                                         tie_word_embeddings=False)   # as Mistral-Small: its own lm_head
    model = randomize_(transformers.Mistral3ForConditionalGeneration(config).eval(), seed, scale)
    model.save_pretrained(folder)
    return model


def save_qwen3(folder, text, seed, scale=0.2):
    import transformers
    config = transformers.Qwen3Config(max_position_embeddings=128, **text)
    model = randomize_(transformers.Qwen3ForCausalLM(config).eval(), seed, scale)
    model.save_pretrained(folder)
    return model


# -- VAE -----------------------------------------------------------------------------------------------------------

def make_flux2_twin(spec, seed):
    import torch
    from diffusers import AutoencoderKLFlux2
    spec = {k: v for k, v in spec.items() if k != "image"}
    n = len(spec["block_out_channels"])
    model = AutoencoderKLFlux2(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * n,
                               up_block_types=("UpDecoderBlock2D",) * n, **spec)
    randomize_(model, seed=seed)
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():  # the bn statistics are buffers, which randomize_ leaves alone
        model.bn.running_mean.copy_(torch.randn(model.bn.running_mean.shape, generator=g))
        model.bn.running_var.copy_(torch.rand(model.bn.running_var.shape, generator=g) * 2 + 0.1)
    return model.eval()


def diffusers_to_ldm(state_dict, num_blocks):
    """Test-side inverse naming (diffusers -> original ldm), checked in test_vae.py by diffusers' own converter."""
    out = {}
    for key, value in state_dict.items():
        k = key.replace("conv_norm_out", "norm_out").replace("conv_shortcut", "nin_shortcut")
        k = re.sub(r"encoder\.down_blocks\.(\d+)\.resnets\.", r"encoder.down.\1.block.", k)
        k = re.sub(r"encoder\.down_blocks\.(\d+)\.downsamplers\.0\.", r"encoder.down.\1.downsample.", k)
        m = re.match(r"decoder\.up_blocks\.(\d+)\.(resnets|upsamplers\.0)\.(.*)", k)
        if m:
            level = num_blocks - 1 - int(m.group(1))
            k = f"decoder.up.{level}." + ("block." if m.group(2) == "resnets" else "upsample.") + m.group(3)
        k = k.replace("mid_block.resnets.0.", "mid.block_1.").replace("mid_block.resnets.1.", "mid.block_2.")
        m = re.match(r"(encoder|decoder)\.mid_block\.attentions\.0\.(group_norm|to_q|to_k|to_v|to_out\.0)\.(.*)", k)
        if m:
            name = {"group_norm": "norm", "to_q": "q", "to_k": "k", "to_v": "v", "to_out.0": "proj_out"}[m.group(2)]
            k = f"{m.group(1)}.mid.attn_1.{name}.{m.group(3)}"
            if value.ndim == 2:  # ldm uses 1x1 convs
                value = value[:, :, None, None]
        out[k] = value.contiguous()
    return out


# -- original single-file naming of the transformers ---------------------------------------------------------------

def flux2_to_bfl(sd, cfg):
    """diffusers -> Black Forest Labs' original names: the test-side inverse of diffusers' converter (validated in
    test_flux2_transformer.py: diffusers' from_single_file must give back the exact state dict from what this
    writes)."""
    import torch

    def swap(t):  # diffusers (scale, shift) -> BFL (shift, scale)
        scale, shift = t.chunk(2, dim=0)
        return torch.cat([shift, scale])

    out = {"img_in.weight": sd["x_embedder.weight"], "txt_in.weight": sd["context_embedder.weight"],
           "time_in.in_layer.weight": sd["time_guidance_embed.timestep_embedder.linear_1.weight"],
           "time_in.out_layer.weight": sd["time_guidance_embed.timestep_embedder.linear_2.weight"],
           "final_layer.linear.weight": sd["proj_out.weight"],
           "final_layer.adaLN_modulation.1.weight": swap(sd["norm_out.linear.weight"])}
    if cfg["guidance_embeds"]:
        out["guidance_in.in_layer.weight"] = sd["time_guidance_embed.guidance_embedder.linear_1.weight"]
        out["guidance_in.out_layer.weight"] = sd["time_guidance_embed.guidance_embedder.linear_2.weight"]
    for m in ("double_stream_modulation_img", "double_stream_modulation_txt", "single_stream_modulation"):
        out[f"{m}.lin.weight"] = sd[f"{m}.linear.weight"]
    for i in range(cfg["num_layers"]):
        o, d = f"double_blocks.{i}.", f"transformer_blocks.{i}.attn."
        out[o + "img_attn.qkv.weight"] = torch.cat([sd[d + f"to_{c}.weight"] for c in "qkv"])
        out[o + "txt_attn.qkv.weight"] = torch.cat([sd[d + f"add_{c}_proj.weight"] for c in "qkv"])
        out[o + "img_attn.norm.query_norm.scale"] = sd[d + "norm_q.weight"]
        out[o + "img_attn.norm.key_norm.scale"] = sd[d + "norm_k.weight"]
        out[o + "txt_attn.norm.query_norm.scale"] = sd[d + "norm_added_q.weight"]
        out[o + "txt_attn.norm.key_norm.scale"] = sd[d + "norm_added_k.weight"]
        out[o + "img_attn.proj.weight"] = sd[d + "to_out.0.weight"]
        out[o + "txt_attn.proj.weight"] = sd[d + "to_add_out.weight"]
        for bfl, ours in (("img_mlp", "ff"), ("txt_mlp", "ff_context")):
            out[o + f"{bfl}.0.weight"] = sd[f"transformer_blocks.{i}.{ours}.linear_in.weight"]
            out[o + f"{bfl}.2.weight"] = sd[f"transformer_blocks.{i}.{ours}.linear_out.weight"]
    for i in range(cfg["num_single_layers"]):
        o, d = f"single_blocks.{i}.", f"single_transformer_blocks.{i}.attn."
        out[o + "linear1.weight"] = sd[d + "to_qkv_mlp_proj.weight"]
        out[o + "linear2.weight"] = sd[d + "to_out.weight"]
        out[o + "norm.query_norm.scale"] = sd[d + "norm_q.weight"]
        out[o + "norm.key_norm.scale"] = sd[d + "norm_k.weight"]
    return out


def sd3_to_sai(sd, num_layers):
    """diffusers -> Stability's original names (without `model.diffusion_model.`): the test-side inverse of
    diffusers' converter (validated in test_mmdit.py: diffusers' from_single_file must reproduce the exact state
    dict from what this writes)."""
    import torch

    def swap(t):  # diffusers (scale, shift) -> original (shift, scale)
        scale, shift = t.chunk(2, dim=0)
        return torch.cat([shift, scale])

    out = {"pos_embed": sd["pos_embed.pos_embed"], "x_embedder.proj.weight": sd["pos_embed.proj.weight"],
           "x_embedder.proj.bias": sd["pos_embed.proj.bias"]}
    for p in ("weight", "bias"):
        out[f"t_embedder.mlp.0.{p}"] = sd[f"time_text_embed.timestep_embedder.linear_1.{p}"]
        out[f"t_embedder.mlp.2.{p}"] = sd[f"time_text_embed.timestep_embedder.linear_2.{p}"]
        out[f"y_embedder.mlp.0.{p}"] = sd[f"time_text_embed.text_embedder.linear_1.{p}"]
        out[f"y_embedder.mlp.2.{p}"] = sd[f"time_text_embed.text_embedder.linear_2.{p}"]
        out[f"context_embedder.{p}"] = sd[f"context_embedder.{p}"]
        out[f"final_layer.linear.{p}"] = sd[f"proj_out.{p}"]
        out[f"final_layer.adaLN_modulation.1.{p}"] = swap(sd[f"norm_out.linear.{p}"])
        for i in range(num_layers):
            o, d = f"joint_blocks.{i}.", f"transformer_blocks.{i}."
            last = i == num_layers - 1
            out[o + f"x_block.attn.qkv.{p}"] = torch.cat([sd[d + f"attn.to_{c}.{p}"] for c in "qkv"])
            out[o + f"context_block.attn.qkv.{p}"] = torch.cat([sd[d + f"attn.add_{c}_proj.{p}"] for c in "qkv"])
            out[o + f"x_block.attn.proj.{p}"] = sd[d + f"attn.to_out.0.{p}"]
            out[o + f"x_block.adaLN_modulation.1.{p}"] = sd[d + f"norm1.linear.{p}"]
            ctx_mod = sd[d + f"norm1_context.linear.{p}"]
            out[o + f"context_block.adaLN_modulation.1.{p}"] = swap(ctx_mod) if last else ctx_mod
            out[o + f"x_block.mlp.fc1.{p}"] = sd[d + f"ff.net.0.proj.{p}"]
            out[o + f"x_block.mlp.fc2.{p}"] = sd[d + f"ff.net.2.{p}"]
            if not last:
                out[o + f"context_block.attn.proj.{p}"] = sd[d + f"attn.to_add_out.{p}"]
                out[o + f"context_block.mlp.fc1.{p}"] = sd[d + f"ff_context.net.0.proj.{p}"]
                out[o + f"context_block.mlp.fc2.{p}"] = sd[d + f"ff_context.net.2.{p}"]
            if d + f"attn2.to_q.{p}" in sd:
                out[o + f"x_block.attn2.qkv.{p}"] = torch.cat([sd[d + f"attn2.to_{c}.{p}"] for c in "qkv"])
                out[o + f"x_block.attn2.proj.{p}"] = sd[d + f"attn2.to_out.0.{p}"]
    for i in range(num_layers):
        o, d = f"joint_blocks.{i}.", f"transformer_blocks.{i}."
        for c in "qk":
            if d + f"attn.norm_{c}.weight" in sd:
                out[o + f"x_block.attn.ln_{c}.weight"] = sd[d + f"attn.norm_{c}.weight"]
                out[o + f"context_block.attn.ln_{c}.weight"] = sd[d + f"attn.norm_added_{c}.weight"]
            if d + f"attn2.norm_{c}.weight" in sd:
                out[o + f"x_block.attn2.ln_{c}.weight"] = sd[d + f"attn2.norm_{c}.weight"]
    return out


# -- a whole FLUX.2 pipeline ---------------------------------------------------------------------------------------

H, W = 24, 40            # latent 12x20 (VAE factor 2) -> 6x10 patches
TAPS = (1, 3, 4)
SEQ = 48
# dev: diffusers' system message alone takes 118 of the stand-in tokenizer's tokens (right-truncated at the text
# length), so at SEQ every prompt gives the same tokens; DEV_SEQ leaves room for the test prompts after it
DEV_SEQ = 144


def text_length(kind):
    """The text length a FLUX.2 twin of `kind` is run at: past dev's system message, SEQ for klein (no system
    message)."""
    return DEV_SEQ if kind == "dev" else SEQ


def _transformer(joint, guidance, seed):
    from diffusers import Flux2Transformer2DModel
    model = Flux2Transformer2DModel(
        patch_size=1, in_channels=20, out_channels=None, num_layers=2, num_single_layers=2, attention_head_dim=16,
        num_attention_heads=3, joint_attention_dim=joint, timestep_guidance_channels=32, mlp_ratio=2.5,
        axes_dims_rope=(4, 4, 4, 4), rope_theta=2000, eps=1e-6, guidance_embeds=guidance)
    return randomize_(model, seed=seed, scale=0.15).eval()


def _scheduler():
    from diffusers import FlowMatchEulerDiscreteScheduler
    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True,
                                           base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
                                           max_image_seq_len=4096, time_shift_type="exponential")


def _vae(seed):
    return make_flux2_twin(dict(block_out_channels=(8, 12), layers_per_block=1, latent_channels=5,
                                norm_num_groups=4), seed)


def build_pipeline(kind, root):
    """A tiny FLUX.2 pipeline of `kind` ("dev": Mistral3 encoder and embedded guidance; "klein_base" /
    "klein_distilled": Qwen3 encoder) saved with save_pretrained under root / "pipeline"; returns (kind, that
    folder, the diffusers pipeline read back from it)."""
    from diffusers import Flux2KleinPipeline, Flux2Pipeline
    if kind == "dev":
        text = dict(hidden_size=48, intermediate_size=80, num_hidden_layers=6, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=20, vocab_size=333, rope_theta=1e6, sliding_window=None)
        vision = dict(hidden_size=32, intermediate_size=40, num_hidden_layers=1, num_attention_heads=2, head_dim=16,
                      image_size=28, patch_size=14)
        encoder = save_mistral3(root / "te_src", text, vision, seed=3, positions=2 * DEV_SEQ)
        tok_dir = build_tokenizer(root / "tok_src", ["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]",
                                                     "[/SYSTEM_PROMPT]", "<pad>", "[IMG]"], MISTRAL_TEMPLATE, "left",
                                  "<pad>", "<s>", "</s>", add_bos=True)
        cls, extra, joint = Flux2Pipeline, {}, 3 * 48
    else:
        text = dict(hidden_size=40, intermediate_size=72, num_hidden_layers=5, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=12, vocab_size=321, rope_theta=1e6)
        encoder = save_qwen3(root / "te_src", text, seed=5)
        tok_dir = build_tokenizer(root / "tok_src", ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>",
                                                     "</think>"], QWEN3_TEMPLATE, "right", "<|endoftext|>",
                                  eos="<|im_end|>")
        cls, extra, joint = Flux2KleinPipeline, {"is_distilled": kind == "klein_distilled"}, 3 * 40
    from transformers import AutoTokenizer
    pipe = cls(scheduler=_scheduler(), vae=_vae(7), text_encoder=encoder.float().eval(),
               tokenizer=AutoTokenizer.from_pretrained(str(tok_dir)),
               transformer=_transformer(joint, kind == "dev", 11), **extra)
    folder = root / "pipeline"
    pipe.save_pretrained(str(folder))
    return kind, folder, cls.from_pretrained(str(folder))


def flux2_reference(pipe, noise, **kwargs):
    """diffusers' run of a FLUX.2 pipeline from the injected noise (B, C, h, w): (its final latents in that layout,
    before the VAE's de-normalisation, as mlxdiff's Result.latents; its float image)."""
    import torch
    final = {}

    def keep_latents(_, i, t, tensors):   # the last packed latents [B, h*w, C] (the noise tokens only)
        final["latents"] = tensors["latents"].permute(0, 2, 1).reshape(noise.shape).numpy()
        return {}
    image = pipe(latents=torch.from_numpy(noise), output_type="np", callback_on_step_end=keep_latents,
                 **kwargs).images[0]
    return final["latents"], image


# -- input images --------------------------------------------------------------------------------------------------

def picture(width, height, seed):
    """A smooth random RGB picture (gradients plus noise), so that the VAE sees structure."""
    import numpy as np
    import PIL.Image
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:height, 0:width] / max(width, height)
    base = np.stack([np.sin(6 * xx + seed), np.cos(5 * yy - seed), np.sin(4 * (xx + yy))], axis=-1)
    pixels = 127.5 + 90 * base + rng.normal(0, 20, (height, width, 3))
    return PIL.Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))


def flux1_to_bfl(sd, cfg):
    """diffusers FluxTransformer2DModel -> Black Forest Labs' original FLUX.1 names: the test-side inverse of
    diffusers' convert_flux_transformer_checkpoint_to_diffusers (validated in test_flux1_transformer.py against that
    converter, its hard-coded width set to the test's)."""
    import torch

    def swap(t):  # diffusers (scale, shift) -> BFL (shift, scale)
        scale, shift = t.chunk(2, dim=0)
        return torch.cat([shift, scale])

    out = {}
    def linear(bfl, ours):     # a layer the model lacks (Chroma's pruned modulations) is left out
        if ours + ".weight" in sd:
            out[bfl + ".weight"], out[bfl + ".bias"] = sd[ours + ".weight"], sd[ours + ".bias"]

    linear("img_in", "x_embedder")
    linear("txt_in", "context_embedder")
    linear("time_in.in_layer", "time_text_embed.timestep_embedder.linear_1")
    linear("time_in.out_layer", "time_text_embed.timestep_embedder.linear_2")
    linear("vector_in.in_layer", "time_text_embed.text_embedder.linear_1")
    linear("vector_in.out_layer", "time_text_embed.text_embedder.linear_2")
    if cfg["guidance_embeds"]:
        linear("guidance_in.in_layer", "time_text_embed.guidance_embedder.linear_1")
        linear("guidance_in.out_layer", "time_text_embed.guidance_embedder.linear_2")
    linear("final_layer.linear", "proj_out")
    if "norm_out.linear.weight" in sd:
        out["final_layer.adaLN_modulation.1.weight"] = swap(sd["norm_out.linear.weight"])
        out["final_layer.adaLN_modulation.1.bias"] = swap(sd["norm_out.linear.bias"])
    for i in range(cfg["num_layers"]):
        o, d = f"double_blocks.{i}.", f"transformer_blocks.{i}."
        linear(o + "img_mod.lin", d + "norm1.linear")
        linear(o + "txt_mod.lin", d + "norm1_context.linear")
        for kind in ("weight", "bias"):
            out[o + f"img_attn.qkv.{kind}"] = torch.cat([sd[d + f"attn.to_{c}.{kind}"] for c in "qkv"])
            out[o + f"txt_attn.qkv.{kind}"] = torch.cat([sd[d + f"attn.add_{c}_proj.{kind}"] for c in "qkv"])
        out[o + "img_attn.norm.query_norm.scale"] = sd[d + "attn.norm_q.weight"]
        out[o + "img_attn.norm.key_norm.scale"] = sd[d + "attn.norm_k.weight"]
        out[o + "txt_attn.norm.query_norm.scale"] = sd[d + "attn.norm_added_q.weight"]
        out[o + "txt_attn.norm.key_norm.scale"] = sd[d + "attn.norm_added_k.weight"]
        linear(o + "img_attn.proj", d + "attn.to_out.0")
        linear(o + "txt_attn.proj", d + "attn.to_add_out")
        for bfl, ours in (("img_mlp", "ff"), ("txt_mlp", "ff_context")):
            linear(o + f"{bfl}.0", d + f"{ours}.net.0.proj")
            linear(o + f"{bfl}.2", d + f"{ours}.net.2")
    for i in range(cfg["num_single_layers"]):
        o, d = f"single_blocks.{i}.", f"single_transformer_blocks.{i}."
        linear(o + "modulation.lin", d + "norm.linear")
        for kind in ("weight", "bias"):
            out[o + f"linear1.{kind}"] = torch.cat([sd[d + f"attn.to_{c}.{kind}"] for c in "qkv"]
                                                   + [sd[d + f"proj_mlp.{kind}"]])
        linear(o + "linear2", d + "proj_out")
        out[o + "norm.query_norm.scale"] = sd[d + "attn.norm_q.weight"]
        out[o + "norm.key_norm.scale"] = sd[d + "attn.norm_k.weight"]
    return out


def chroma_to_original(sd, cfg):
    """diffusers ChromaTransformer2DModel -> lodestones' original Chroma names: FLUX.1's BFL names of the blocks
    (flux1_to_bfl, which leaves out the pruned modulation layers) and the approximator's; the test-side inverse of
    diffusers' convert_chroma_transformer_checkpoint_to_diffusers (validated against it in test_chroma.py)."""
    out = flux1_to_bfl(sd, {**cfg, "guidance_embeds": False})
    g = "distilled_guidance_layer."
    for kind in ("weight", "bias"):
        for proj in ("in_proj", "out_proj"):
            out[f"{g}{proj}.{kind}"] = sd[f"{g}{proj}.{kind}"]
        for i in range(cfg["approximator_layers"]):
            out[f"{g}layers.{i}.in_layer.{kind}"] = sd[f"{g}layers.{i}.linear_1.{kind}"]
            out[f"{g}layers.{i}.out_layer.{kind}"] = sd[f"{g}layers.{i}.linear_2.{kind}"]
    for i in range(cfg["approximator_layers"]):
        out[f"{g}norms.{i}.scale"] = sd[f"{g}norms.{i}.weight"]
    return out
