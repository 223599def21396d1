"""Qwen-Image 2.1 LoRAs in kohya's names, against diffusers' QwenImage21Transformer2DModel with the same PEFT
adapter on it: `lora_unet_<ComfyUI name, dots as underscores>` as ComfyUI's model_lora_keys_unet maps them and kohya
trainers write them (lora_down / lora_up / .alpha; each block's SwiGLU gate and up fused into one `img_mlp_gate_up`,
the released checkpoint's layer, one lora_down and the gate's rows then the up's), the same with diffusers' split
gate_layer / proj, and ComfyUI's dotted `diffusion_model.` form of the fused gate_up, each equal to the PEFT file
diffusers writes; diffusers' own QwenImageLoraLoaderMixin.load_lora_weights reads the kohya names it maps (attention,
img_mlp.proj / out and the top-level layers; its converter mangles gate_layer, gate_up, txt_in and modulation.1) as
mlxdiff does; bad kohya files refused in one line."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import mlxdiff  # noqa: F401  (OpenBLAS preload before mlx)
import mlx.core as mx

import fixture_guard
import lora_helpers
import parity
from helpers import load_ours, max_rel_err, randomize_
from lora_helpers import adapter_state, assert_lora_parity, loaded_by_diffusers, ours_with, random_adapter
from mlxdiff import lora
from mlxdiff.errors import MlxdiffError
from mlxdiff.models import qwenimage, qwenimage21

# every dimension differs: 12 latent channels, 3 heads of 20 (width 60, SwiGLU 120), 24 text channels
CONFIG = dict(in_channels=12, out_channels=12, num_layers=2, attention_head_dim=20, num_attention_heads=3,
              context_in_dim=24, mlp_ratio=2, axes_dims_rope=(4, 8, 8))
TEXT_LEN, TARGET, COND = 7, (2, 4), (2, 2)
RANK, ALPHA, SCALE = 3, 1.5, 0.6     # alpha / rank = 0.5; 0.6: a scale applied twice (or squared) must show
# every linear layer of the model
TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "gate_layer", "img_mlp.proj", "img_mlp.out", "img_in", "modulation.1",
           "txt_in.in_layer", "txt_in.out_layer", "linear_1", "linear_2", "norm_out.linear", "proj_out"]
# the kohya names diffusers' _convert_non_diffusers_qwen_lora_to_diffusers maps to their layers
DIFFUSERS_READS = ["to_q", "to_k", "to_v", "to_out.0", "img_mlp.proj", "img_mlp.out", "img_in", "linear_1",
                   "linear_2", "norm_out.linear", "proj_out"]


@pytest.fixture(autouse=True)
def _shared_fixtures_unchanged(request):
    """The module's shared fixtures are left as built (fixture_guard)."""
    yield from fixture_guard.unchanged(request, ["lora_files"])


def make_inputs(seed=0):
    """A condition image inside the prompt and the target (text row 0 right-padded by 2)."""
    rng = np.random.default_rng(seed)
    n_t, n_c = TARGET[0] * TARGET[1], COND[0] * COND[1]
    slots = np.zeros(TEXT_LEN + n_c // 4, bool)
    slots[2:2 + n_c // 4] = True
    n_vlm = slots.shape[0]
    text_mask = np.ones((2, n_vlm), bool)
    text_mask[0, -2:] = False
    return dict(hidden_states=rng.standard_normal((2, n_c + n_t, CONFIG["in_channels"])).astype(np.float32),
                encoder_hidden_states=rng.standard_normal((2, n_vlm, CONFIG["context_in_dim"])).astype(np.float32),
                timestep=np.array([0.8125, 0.3], np.float32), img_shapes=[[(1, *COND), (1, *TARGET)]] * 2,
                img_mask=np.concatenate([slots, np.ones(n_t // 4, bool)])[None].repeat(2, 0),
                encoder_hidden_states_mask=text_mask)


def torch_forward(model, inputs):
    t = {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in inputs.items()}
    with torch.no_grad():
        out = model(**t, return_dict=False)[0]
    return out[:, -TARGET[0] * TARGET[1]:].numpy()


def mlx_forward(model, inputs):
    m = {k: mx.array(v) if isinstance(v, np.ndarray) and k != "img_mask" else v for k, v in inputs.items()}
    return np.array(model(**m).astype(mx.float32))


def kohya_tensors(state, fused=True, prefix="lora_unet_", sep="_", down="lora_down", up="lora_up"):
    """The PEFT state's LoRA in kohya's names (ComfyUI's layer names with dots as `sep`, alpha per layer); `fused`:
    each block's gate_layer and proj as ComfyUI's one gate_up (their shared lora_A, lora_B rows gate first)."""
    out = {}
    for key, a in state.items():
        if not key.endswith(".lora_A.weight"):
            continue
        layer = key[:-len(".lora_A.weight")]
        b = state[layer + ".lora_B.weight"]
        if fused and layer.endswith("img_mlp.proj"):
            continue
        if fused and layer.endswith("img_mlp.gate_layer"):
            proj = layer.replace("gate_layer", "proj")
            assert torch.equal(state[proj + ".lora_A.weight"], a)
            layer, b = layer.replace("gate_layer", "gate_up"), torch.cat([b, state[proj + ".lora_B.weight"]])
        name = prefix + (layer.replace(".", "_") if sep == "_" else layer)
        out[f"{name}.{down}.weight"], out[f"{name}.{up}.weight"] = a, b
        out[f"{name}.alpha"] = torch.tensor(ALPHA)
    return {k: v.clone().contiguous() for k, v in out.items()}


def adapter(base, targets, seed):
    """A random PEFT adapter on `targets` of a copy of `base`, each block's gate_layer and proj sharing one lora_A
    (so that the LoRA has ComfyUI's fused gate_up form)."""
    adapted, config = random_adapter(base, RANK, ALPHA, targets, seed=seed)
    with torch.no_grad():
        for name, m in adapted.named_modules():
            if name.endswith(".img_mlp.gate_layer") and "gate_layer" in targets:
                adapted.get_submodule(name.replace("gate_layer", "proj")).lora_A["default"].weight.copy_(
                    m.lora_A["default"].weight)
    return adapted.eval(), config


@pytest.fixture(scope="module")
def lora_files(tmp_path_factory):
    """The base (a diffusers folder), the base with a LoRA on every linear layer and its files in four namings, and
    the base with a LoRA on the layers diffusers' kohya converter reads with that LoRA's kohya file."""
    from diffusers import QwenImage21Pipeline, QwenImage21Transformer2DModel
    root = tmp_path_factory.mktemp("qi21_lora")
    torch.manual_seed(0)
    base = randomize_(QwenImage21Transformer2DModel(**CONFIG), seed=4).eval()
    base.save_pretrained(str(root / "transformer"))
    adapted, config = adapter(base, TARGETS, seed=7)
    state = adapter_state(adapted)
    files = {name: root / f"qi21-{name}.safetensors" for name in ("peft", "kohya", "kohya_split", "comfy_fused")}
    QwenImage21Pipeline.save_lora_weights(str(root), transformer_lora_layers=state, weight_name=files["peft"].name,
                                          transformer_lora_adapter_metadata=config.to_dict())
    kohya = kohya_tensors(state)
    assert "lora_unet_transformer_blocks_1_img_mlp_gate_up.lora_up.weight" in kohya
    assert "lora_unet_modulation_1.lora_down.weight" in kohya and "lora_unet_txt_in_in_layer.alpha" in kohya
    save_file(kohya, str(files["kohya"]))
    save_file(kohya_tensors(state, fused=False), str(files["kohya_split"]))
    save_file(kohya_tensors(state, prefix="diffusion_model.", sep="."), str(files["comfy_fused"]))
    readable, _ = adapter(base, DIFFUSERS_READS, seed=8)
    files["kohya_diffusers_reads"] = root / "qi21-kohya-diffusers-reads.safetensors"
    save_file(kohya_tensors(adapter_state(readable), fused=False), str(files["kohya_diffusers_reads"]))
    return base, adapted, readable, root / "transformer", files


@pytest.fixture(scope="module")
def scaled_reference(lora_files):
    base, adapted, *_ = lora_files
    inputs = make_inputs()
    return lora_helpers.scaled_reference(base, adapted, lambda m: torch_forward(m, inputs), SCALE)


@pytest.mark.parametrize("naming", ["peft", "kohya", "kohya_split", "comfy_fused"])
def test_lora_matches_diffusers(lora_files, scaled_reference, naming):
    """Every naming: the 15 layer kinds of both blocks and the top level (the fused gate_up reaching gate_layer and
    proj) at SCALE, within 1e-4 of PEFT's adapter at that weight; removed, the base's output again."""
    base, _, _, folder, files = lora_files
    inputs = make_inputs()
    layers = 7 * CONFIG["num_layers"] + 8      # per block q, k, v, out, gate, up, down; img_in .. proj_out
    assert_lora_parity(ours_with(folder, qwenimage21, files[naming], SCALE), lambda m: mlx_forward(m, inputs),
                       scaled_reference, torch_forward(base, inputs), layers,
                       f"Qwen-Image 2.1 LoRA ({naming}) at {SCALE}")


def test_kohya_names_diffusers_reads(lora_files):
    """diffusers' load_lora_weights reads the PEFT file, and the kohya file on the layers its converter maps, as the
    adapters they were made from; mlxdiff applies that kohya file as diffusers' loaded model computes it."""
    from diffusers.loaders.lora_pipeline import QwenImageLoraLoaderMixin
    base, adapted, readable, folder, files = lora_files
    inputs = make_inputs()
    assert max_rel_err(torch_forward(loaded_by_diffusers(QwenImageLoraLoaderMixin, base, files["peft"]), inputs),
                       torch_forward(adapted, inputs)) <= 1e-5
    theirs = torch_forward(loaded_by_diffusers(QwenImageLoraLoaderMixin, base, files["kohya_diffusers_reads"]),
                           inputs)
    assert max_rel_err(theirs, torch_forward(readable, inputs)) <= 1e-5
    parity.assert_moves("the kohya LoRA", theirs, torch_forward(base, inputs))
    ours = mlx_forward(ours_with(folder, qwenimage21, files["kohya_diffusers_reads"]), inputs)
    err = max_rel_err(ours, theirs)
    print(f"Qwen-Image 2.1 kohya LoRA against diffusers' load_lora_weights: max_rel_err {err:.2e}")
    assert err <= parity.LATENT_TOL


def refusal(arch, args, path):
    with pytest.raises(MlxdiffError) as e:
        lora.check(SimpleNamespace(name="transformer", arch=arch, args=args), path)
    message = str(e.value)
    assert "\n" not in message and str(path) in message, message
    return message


def test_bad_kohya_files_are_refused(lora_files, tmp_path):
    """A fused gate_up whose lora_up rows are not two equal halves, a block the model does not have, a Qwen-Image
    (2.0) kohya LoRA on Qwen-Image 2.1 and this kohya file on Qwen-Image: each one line."""
    *_, folder, files = lora_files
    args = load_ours(folder, qwenimage21).args
    width, hidden = 60, 120
    name = "lora_unet_transformer_blocks_0_img_mlp_gate_up"
    save_file({f"{name}.lora_down.weight": torch.zeros(RANK, width),
               f"{name}.lora_up.weight": torch.zeros(2 * hidden + 1, RANK)}, str(tmp_path / "odd.safetensors"))
    assert "cannot be split" in refusal(qwenimage21, args, tmp_path / "odd.safetensors")
    name = "lora_unet_transformer_blocks_5_attn_to_q"
    save_file({f"{name}.lora_down.weight": torch.zeros(RANK, width),
               f"{name}.lora_up.weight": torch.zeros(width, RANK)}, str(tmp_path / "deep.safetensors"))
    assert "has no layer" in refusal(qwenimage21, args, tmp_path / "deep.safetensors")
    name = "lora_unet_transformer_blocks_0_img_mod_1"
    save_file({f"{name}.lora_down.weight": torch.zeros(RANK, width),
               f"{name}.lora_up.weight": torch.zeros(6 * width, RANK)}, str(tmp_path / "qwen.safetensors"))
    message = refusal(qwenimage21, args, tmp_path / "qwen.safetensors")
    assert "a LoRA for Qwen-Image" in message and "Qwen-Image 2.1 transformer" in message, message
    qwen_args = qwenimage.ModelArgs.from_dict(dict(in_channels=16, out_channels=4, num_layers=1, attention_head_dim=20,
                                                   num_attention_heads=3, joint_attention_dim=24,
                                                   axes_dims_rope=(4, 8, 8)))
    assert "a LoRA for Qwen-Image 2.1" in refusal(qwenimage, qwen_args, files["kohya"])
