"""Parity of mlxdiff.models.qwenimage21 with diffusers' QwenImage21Transformer2DModel: text-to-image (a batch of two
prompts, one right-padded, as QwenImage21Pipeline pads), a condition image inside the prompt (block-causal
attention), the prefix KV cache (extract, then cached at another step) against diffusers' QwenImage21KVCache,
causal_condition off; the mask, timestep, text and condition latents mattering; compiled and plain blocks; a file
in ComfyUI's names (fused gate_up) as diffusers' converter reads it; a PEFT LoRA against PEFT's adapter."""

import copy
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import mlxdiff  # noqa: F401  (OpenBLAS preload before mlx)
import mlx.core as mx

import parity
from helpers import load_ours, max_rel_err, randomize_
from mlxdiff import lora
from mlxdiff.errors import MlxdiffError
from mlxdiff.loading.sources import transformer_from_file
from mlxdiff.models import qwenimage21
from mlxdiff.policy import RunPolicy, installed

# every dimension differs: 20 latent channels, 3 heads of 22 (width 66, MLP 198), 28 text channels; RoPE axes
# unequal as (16, 56, 56)
CONFIG = dict(in_channels=20, out_channels=20, num_layers=2, attention_head_dim=22, num_attention_heads=3,
              context_in_dim=28, mlp_ratio=3, axes_dims_rope=(6, 8, 8))
TEXT_LEN, TARGET, COND = 9, (4, 6), (2, 4)


def make_torch_model(seed=3, **overrides):
    from diffusers import QwenImage21Transformer2DModel
    torch.manual_seed(seed)
    return randomize_(QwenImage21Transformer2DModel(**{**CONFIG, **overrides}), seed=seed).eval()


def make_inputs(seed=0, cond=False):
    """hidden_states (condition latents first), text states, the (B, L_vlm + target/4) slot mask and the padding
    mask (row 0 right-padded by 3)."""
    rng = np.random.default_rng(seed)
    n_t = TARGET[0] * TARGET[1]
    n_c = COND[0] * COND[1] if cond else 0
    slots = np.zeros(TEXT_LEN + (n_c // 4), bool)
    if cond:
        slots[3:3 + n_c // 4] = True         # the condition image sits inside the prompt
    n_vlm = slots.shape[0]
    img_mask = np.concatenate([slots, np.ones(n_t // 4, bool)])[None].repeat(2, 0)
    text_mask = np.ones((2, n_vlm), bool)
    text_mask[0, -3:] = False
    shapes = [[*([(1, *COND)] if cond else []), (1, *TARGET)]] * 2
    return dict(hidden_states=rng.standard_normal((2, n_c + n_t, CONFIG["in_channels"])).astype(np.float32),
                encoder_hidden_states=rng.standard_normal((2, n_vlm, CONFIG["context_in_dim"])).astype(np.float32),
                timestep=np.array([0.9731, 0.2125], np.float32), img_shapes=shapes, img_mask=img_mask,
                encoder_hidden_states_mask=text_mask)


def torch_forward(model, inputs, mask=True, **kwargs):
    t = {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in inputs.items()}
    if not mask:
        t["encoder_hidden_states_mask"] = None
    with torch.no_grad():
        out = model(**t, **kwargs, return_dict=False)[0]
    return out[:, -TARGET[0] * TARGET[1]:].numpy()


def mlx_forward(model, inputs, mask=True, **kwargs):
    m = {k: mx.array(v) if isinstance(v, np.ndarray) and k != "img_mask" else v for k, v in inputs.items()}
    if not mask:
        m["encoder_hidden_states_mask"] = None
    return np.array(model(**m, **kwargs).astype(mx.float32))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    model = make_torch_model()
    folder = tmp_path_factory.mktemp("qwenimage21")
    model.save_pretrained(str(folder))
    return model, load_ours(folder, qwenimage21)


@pytest.mark.parametrize("cond", [False, True], ids=["t2i", "condition_image"])
def test_parity(saved, cond):
    torch_model, ours = saved
    inputs = make_inputs(cond=cond)
    ref = torch_forward(torch_model, inputs)
    for mask in (True, False):
        out = mlx_forward(ours, inputs, mask)
        assert out.shape == (2, TARGET[0] * TARGET[1], CONFIG["in_channels"])
        err = max_rel_err(out, torch_forward(torch_model, inputs, mask))
        print(f"Qwen-Image 2.1 transformer, {'condition image' if cond else 't2i'}, mask {mask}: max_rel_err "
              f"{err:.2e}")
        assert err <= 1e-4
    # the mask, the timestep, the text (and the condition latents) each move the output, so the comparison sees them
    assert max_rel_err(torch_forward(torch_model, inputs, False), ref) > 1e-3
    moves = ["timestep", "encoder_hidden_states"] + (["hidden_states"] if cond else [])
    for key in moves:
        value = inputs[key].copy()
        if key == "hidden_states":     # only the condition image's latents: the target's stay
            value[:, :COND[0] * COND[1]] = value[::-1, :COND[0] * COND[1]]
        else:
            value = value[::-1].copy()
        moved = dict(inputs, **{key: value})
        assert max_rel_err(torch_forward(torch_model, moved), ref) > 1e-3, key
        assert max_rel_err(mlx_forward(ours, moved), torch_forward(torch_model, moved)) <= 1e-4, key


@pytest.mark.parametrize("cond", [False, True], ids=["t2i", "condition_image"])
def test_kv_cache(saved, cond):
    """Extract at one step, decode from the cache at another: diffusers' cached path and its uncached output."""
    from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21KVCache
    torch_model, ours = saved
    first, later = make_inputs(cond=cond), make_inputs(seed=1, cond=cond)
    later = dict(first, hidden_states=later["hidden_states"], timestep=np.array([0.5, 0.125], np.float32))
    if cond:      # the condition latents are the same at every step
        later["hidden_states"][:, :COND[0] * COND[1]] = first["hidden_states"][:, :COND[0] * COND[1]]
    torch_cache, cache = QwenImage21KVCache(CONFIG["num_layers"]), qwenimage21.PrefixCache()
    ref1 = torch_forward(torch_model, first, kv_cache=torch_cache, kv_cache_mode="extract")
    out1 = mlx_forward(ours, first, kv_cache=cache)
    assert cache.filled and max_rel_err(out1, ref1) <= 1e-4
    ref2 = torch_forward(torch_model, later, kv_cache=torch_cache, kv_cache_mode="cached")
    out2 = mlx_forward(ours, later, kv_cache=cache)
    err = max_rel_err(out2, ref2)
    print(f"Qwen-Image 2.1 transformer, cached step ({'condition image' if cond else 't2i'}): max_rel_err {err:.2e}")
    assert err <= 1e-4
    assert max_rel_err(out2, torch_forward(torch_model, later)) <= 1e-4       # the cache changes nothing
    assert max_rel_err(ref2, ref1) > 1e-3


def test_causal_condition_off(tmp_path):
    torch_model = make_torch_model(seed=4, causal_condition=False, num_layers=1)
    torch_model.save_pretrained(str(tmp_path))
    ours = load_ours(tmp_path, qwenimage21)
    inputs = make_inputs(cond=True)
    assert max_rel_err(mlx_forward(ours, inputs), torch_forward(torch_model, inputs)) <= 1e-4
    with pytest.raises(MlxdiffError, match="causal_condition"):
        mlx_forward(ours, inputs, kv_cache=qwenimage21.PrefixCache())


def test_compiled_and_plain_and_bad_inputs(saved):
    _, ours = saved
    inputs = make_inputs(cond=True)
    seen = []
    out = mlx_forward(ours, inputs, after_block=lambda h: seen.append(h.shape))
    assert seen == [(2, TARGET[0] * TARGET[1], CONFIG["num_attention_heads"] * CONFIG["attention_head_dim"])] * 2
    for policy in (RunPolicy(compile_blocks=True), RunPolicy(fuse=False)):
        with installed(policy):
            assert max_rel_err(mlx_forward(ours, inputs), out) <= 1e-5, policy
    with pytest.raises(MlxdiffError, match="img_mask"):
        mlx_forward(ours, dict(inputs, img_mask=inputs["img_mask"][:, :-1]))
    with pytest.raises(MlxdiffError, match="img_shapes"):
        mlx_forward(ours, dict(inputs, img_shapes=[[(1, *TARGET)]]))


def test_config_limits_and_quantize_rule():
    args = qwenimage21.ModelArgs.from_dict(CONFIG)
    assert args.width == 66
    with pytest.raises(MlxdiffError, match="axes_dims_rope"):
        qwenimage21.ModelArgs.from_dict(dict(CONFIG, axes_dims_rope=(6, 8, 10)))
    model = qwenimage21.Model(args)
    assert not model.quant_predicate("modulation.1", None) and not model.quant_predicate("txt_in.in_layer", None)
    assert model.quant_predicate("transformer_blocks.0.attn.to_q", None)


def test_comfyui_file(saved, tmp_path):
    """A file in ComfyUI's names (model.diffusion_model., the SwiGLU gate and up fused gate-first), as diffusers'
    convert_qwen_image21_transformer_checkpoint_to_diffusers reads it; its config off the shapes, the rest from the
    folder's."""
    from diffusers.loaders.single_file_utils import convert_qwen_image21_transformer_checkpoint_to_diffusers
    torch_model, _ = saved
    sd = torch_model.state_dict()
    original = {}
    for key, value in sd.items():
        if key.endswith("img_mlp.gate_layer.weight"):
            up = sd[key.replace("gate_layer", "proj")]
            original["model.diffusion_model." + key.replace("gate_layer", "gate_up")] = torch.cat([value, up])
        elif not key.endswith("img_mlp.proj.weight"):
            original["model.diffusion_model." + key] = value.contiguous()
    back = convert_qwen_image21_transformer_checkpoint_to_diffusers(dict(original))
    assert sorted(back) == sorted(sd) and all(torch.equal(back[k], sd[k]) for k in sd)    # what diffusers reads
    path = tmp_path / "qwen_image_2.1.safetensors"
    save_file(original, str(path))
    spec = transformer_from_file(path, qwenimage21, dict(torch_model.config), "config.json")
    assert spec.args == qwenimage21.ModelArgs.from_dict(dict(torch_model.config))
    ours = spec.build()
    inputs = make_inputs(cond=True)
    err = max_rel_err(mlx_forward(ours, inputs), torch_forward(torch_model, inputs))
    print(f"Qwen-Image 2.1 transformer, ComfyUI-named file: max_rel_err {err:.2e}")
    assert err <= 1e-4
    # without the folder's config: the shapes alone (RoPE axes split as Qwen-Image 2.1's (16, 56, 56) splits 128)
    alone = transformer_from_file(path, qwenimage21).config
    assert (alone["num_layers"], alone["mlp_ratio"], alone["axes_dims_rope"]) == (2, 3, [2, 10, 10])
    assert qwenimage21.is_original(original) and qwenimage21.is_original(sd)


LORA_RANK, LORA_ALPHA, LORA_SCALE = 3, 1.5, 0.6      # scale alpha / rank = 0.5; 0.6: a scale applied twice shows
LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "proj", "gate_layer", "img_mlp.out", "img_in", "modulation.1"]


def test_lora_matches_diffusers(tmp_path):
    """A diffusers / PEFT LoRA file (QwenImage21Pipeline.save_lora_weights) on every block's attention and SwiGLU,
    img_in and the shared modulation, at scale 0.6, against PEFT's adapter at that weight; removed again; a Qwen-Image
    LoRA refused in one line."""
    from diffusers import QwenImage21Pipeline
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict
    base = make_torch_model(seed=6)
    base.save_pretrained(str(tmp_path / "transformer"))
    adapted = copy.deepcopy(base)
    config = LoraConfig(r=LORA_RANK, lora_alpha=LORA_ALPHA, target_modules=LORA_TARGETS, init_lora_weights=False)
    adapted.add_adapter(config)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in adapted.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    state = {k: v.detach().clone().contiguous() for k, v in get_peft_model_state_dict(adapted).items()}
    assert len(state) == 2 * (7 * CONFIG["num_layers"] + 2)
    QwenImage21Pipeline.save_lora_weights(str(tmp_path), transformer_lora_layers=state, weight_name="lora.safetensors",
                                          transformer_lora_adapter_metadata=config.to_dict())
    adapted.set_adapters(["default"], weights=[LORA_SCALE])
    inputs = make_inputs(cond=True)
    ref = torch_forward(adapted.eval(), inputs)
    parity.assert_moves("the LoRA", ref, torch_forward(base, inputs))
    model = load_ours(tmp_path / "transformer", qwenimage21)
    spec = SimpleNamespace(name="transformer", arch=qwenimage21, args=model.args)
    lora.check(spec, tmp_path / "lora.safetensors")
    model = lora.apply_loras(model, qwenimage21, [(tmp_path / "lora.safetensors", LORA_SCALE)])
    err = max_rel_err(mlx_forward(model, inputs), ref)
    print(f"Qwen-Image 2.1 LoRA (PEFT) at {LORA_SCALE}: max_rel_err {err:.2e}")
    assert err <= parity.LATENT_TOL
    lora.remove_loras(model)
    assert max_rel_err(mlx_forward(model, inputs), torch_forward(base, inputs)) <= parity.LATENT_TOL
    other = tmp_path / "qwen.safetensors"
    save_file({"transformer.transformer_blocks.0.img_mod.1.lora_A.weight": torch.zeros(2, 66),
               "transformer.transformer_blocks.0.img_mod.1.lora_B.weight": torch.zeros(396, 2)}, str(other))
    with pytest.raises(MlxdiffError, match="a LoRA for Qwen-Image") as e:
        lora.check(spec, other)
    assert "\n" not in str(e.value)
