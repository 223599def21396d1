"""Shared pieces of Krea 2's tests: a tiny Krea2Transformer2DModel config whose dimensions all differ, its inputs
(a batch of two prompts, one with padding in the middle as Krea2Pipeline lays it out), the forward of each side,
and diffusers' names mapped back to krea-ai's original ones (checked in test_krea2_transformer.py)."""

import json

import numpy as np
import torch

import mlxdiff  # noqa: F401  (OpenBLAS preload before mlx)
import mlx.core as mx

from helpers import randomize_
from twins import build_tokenizer

# every dimension differs (heads 4 of 24 / kv 2, width 96, MLP 136, time 44, text 36 in 3 heads of 12 / kv 1, text
# MLP 52, 3 tapped layers, 20 channels); RoPE axes unequal, as Krea 2's (32, 48, 48)
CONFIG = dict(in_channels=20, num_layers=2, attention_head_dim=24, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=136, timestep_embed_dim=44, text_hidden_dim=36, num_text_layers=3,
              text_num_attention_heads=3, text_num_key_value_heads=1, text_intermediate_size=52,
              num_layerwise_text_blocks=1, num_refiner_text_blocks=2, axes_dims_rope=(4, 10, 10), rope_theta=1000.0)
TEXT_LEN, GRID = 11, (3, 5)


def make_torch_model(seed=5):
    from diffusers import Krea2Transformer2DModel
    torch.manual_seed(seed)
    return randomize_(Krea2Transformer2DModel(**CONFIG), seed=seed).eval()


def text_mask():
    """Row 0: [prompt | PAD | suffix] (Krea2Pipeline's fixed-length layout); row 1: every token valid."""
    mask = np.ones((2, TEXT_LEN), bool)
    mask[0, 4:8] = False
    return mask


def position_ids(grid=GRID):
    from diffusers.pipelines.krea2.pipeline_krea2 import Krea2Pipeline
    return Krea2Pipeline.prepare_position_ids(TEXT_LEN, *grid, "cpu").numpy()


def make_inputs(seed=0, grid=GRID):
    rng = np.random.default_rng(seed)
    n_img = grid[0] * grid[1]
    return dict(hidden_states=rng.standard_normal((2, n_img, CONFIG["in_channels"])).astype(np.float32),
                encoder_hidden_states=rng.standard_normal((2, TEXT_LEN, CONFIG["num_text_layers"],
                                                           CONFIG["text_hidden_dim"])).astype(np.float32),
                timestep=np.array([0.9731, 0.2125], dtype=np.float32))      # the pipeline's t / 1000


def torch_forward(model, inputs, mask, ids=None):
    kwargs = {k: torch.from_numpy(v) for k, v in inputs.items()}
    with torch.no_grad():
        return model(**kwargs, position_ids=torch.from_numpy(position_ids() if ids is None else ids),
                     encoder_attention_mask=None if mask is None else torch.from_numpy(mask),
                     return_dict=False)[0].numpy()


def mlx_forward(model, inputs, mask, ids=None, **kwargs):
    out = model(**{k: mx.array(v) for k, v in inputs.items()}, position_ids=position_ids() if ids is None else ids,
                encoder_attention_mask=None if mask is None else mx.array(mask), **kwargs)
    return np.array(out.astype(mx.float32))


# diffusers -> krea-ai names: the inverse of convert_krea2_transformer_checkpoint_to_diffusers (checked below)
TO_ORIGINAL = [("img_in.", "first."), ("time_embed.linear_1.", "tmlp.0."), ("time_embed.linear_2.", "tmlp.2."),
               ("time_mod_proj.", "tproj.1."), ("txt_in.norm.weight", "txtmlp.0.scale"),
               ("txt_in.linear_1.", "txtmlp.1."), ("txt_in.linear_2.", "txtmlp.3."), ("text_fusion.", "txtfusion."),
               ("transformer_blocks.", "blocks."), ("final_layer.linear.", "last.linear."),
               ("final_layer.norm.weight", "last.norm.scale"), ("final_layer.scale_shift_table", "last.modulation.lin")]
IN_BLOCK = [(".attn.to_q.", ".attn.wq."), (".attn.to_k.", ".attn.wk."), (".attn.to_v.", ".attn.wv."),
            (".attn.to_out.0.", ".attn.wo."), (".attn.to_gate.", ".attn.gate."),
            (".attn.norm_q.weight", ".attn.qknorm.qnorm.scale"), (".attn.norm_k.weight", ".attn.qknorm.knorm.scale"),
            (".ff.", ".mlp."), (".norm1.weight", ".prenorm.scale"), (".norm2.weight", ".postnorm.scale"),
            (".scale_shift_table", ".mod.lin")]


def to_original(state_dict, prefix="model.diffusion_model.") -> dict:
    out = {}
    for key, value in state_dict.items():
        new = key
        for old, orig in TO_ORIGINAL:
            if new.startswith(old):
                new = orig + new[len(old):]
                break
        if new.startswith(("blocks.", "txtfusion.")):
            for old, orig in IN_BLOCK:
                new = new.replace(old, orig)
        if new.startswith("blocks.") and new.endswith(".mod.lin"):
            value = value.reshape(-1)         # the original stores a block's six rows flat
        out[prefix + new] = value.contiguous()
    return out


# -- the tiny Krea2Pipeline of tests/test_krea2_pipeline.py and tests/test_krea2_files.py -----------------------

H, W = 32, 48      # multiples of 4 (the VAE) x 2 (the patches): latents 8 x 12, 4 x 6 tokens
Z = 5              # VAE latent channels: the transformer takes 4 x 5 = 20
# the stand-in tokenizer spends 116 tokens on the template's prefix (Qwen's real one 34): the fixed length must hold
# it and the prompt
SEQ = 120
TAPS = (1, 2, 3)   # hidden states 1 and 2 and the last (final-normed) one
TEXT = dict(vocab_size=301, hidden_size=40, intermediate_size=72, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=10, max_position_embeddings=512, rms_norm_eps=1e-6,
            rope_parameters=dict(rope_type="default", rope_theta=5e5, mrope_section=[2, 2, 1], mrope_interleaved=True))
VISION = dict(depth=1, hidden_size=16, intermediate_size=24, num_heads=2, out_hidden_size=40, patch_size=4,
              spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16, deepstack_visual_indexes=[0])
TRANSFORMER = dict(in_channels=4 * Z, num_layers=2, attention_head_dim=24, num_attention_heads=4,
                   num_key_value_heads=2, intermediate_size=136, timestep_embed_dim=44,
                   text_hidden_dim=TEXT["hidden_size"], num_text_layers=len(TAPS), text_num_attention_heads=5,
                   text_num_key_value_heads=1, text_intermediate_size=52, num_layerwise_text_blocks=1,
                   num_refiner_text_blocks=1, axes_dims_rope=(4, 10, 10))
# the Krea2Pipeline docstring's scheduler settings
SCHEDULER = dict(num_train_timesteps=1000, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                 base_image_seq_len=256, max_image_seq_len=6400, time_shift_type="exponential")


def save_pipeline(root, transformer_config=TRANSFORMER):
    """A tiny Krea2Pipeline: Qwen3-VL 40 wide (3 layers, heads of 10, a 1-block vision tower never read), a
    transformer 96 wide (4 heads of 24, 2 key/value heads, RoPE axes 4, 10, 10; 2 blocks; a text fusion over 3
    taps) over 5 latent channels, a 3-level Qwen-Image VAE (factor 4) with its own latents_mean / latents_std;
    written by save_pretrained under `root` (`transformer_config` in place of TRANSFORMER: more blocks to stream).
    Returns (the folder, the diffusers pipeline)."""
    import transformers
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, Krea2Pipeline, \
        Krea2Transformer2DModel
    from transformers import AutoTokenizer
    config = transformers.Qwen3VLConfig(text_config=TEXT, vision_config=VISION, tie_word_embeddings=False)
    encoder = randomize_(transformers.Qwen3VLModel(config).eval(), 5, 0.2)
    tok_dir = build_tokenizer(root / "tok_src", ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], None, "right",
                              "<|endoftext|>", eos="<|im_end|>")
    torch.manual_seed(0)
    transformer = randomize_(Krea2Transformer2DModel(**transformer_config), seed=10, scale=0.15).eval()
    vae = randomize_(AutoencoderKLQwenImage(base_dim=6, z_dim=Z, dim_mult=[1, 2, 3], num_res_blocks=1, attn_scales=[],
                                            temperal_downsample=[False, True],
                                            latents_mean=[0.3, -0.2, 0.1, 0.5, -0.4],
                                            latents_std=[1.5, 0.7, 2.1, 1.1, 0.9]), seed=11, scale=0.15)
    with torch.no_grad():      # RMS gammas around 1 (randomize_ centres only *norm.weight on 1)
        for name, p in vae.named_parameters():
            if name.endswith("gamma"):
                p.add_(1.0)
    pipe = Krea2Pipeline(scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER), vae=vae.eval(),
                         text_encoder=encoder.float().eval(), tokenizer=AutoTokenizer.from_pretrained(str(tok_dir)),
                         transformer=transformer, text_encoder_select_layers=TAPS)
    folder = root / "pipeline"
    pipe.save_pretrained(str(folder))
    index = json.loads((folder / "model_index.json").read_text())
    assert index["text_encoder_select_layers"] == list(TAPS) and index["is_distilled"] is False
    return folder, pipe
