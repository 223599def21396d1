"""Krea 2 LoRAs against diffusers' Krea2Transformer2DModel with the same PEFT adapter on it: a diffusers / PEFT file
as Krea2Pipeline.save_lora_weights writes it (`transformer.transformer_blocks.0.attn.to_q.lora_A`, its LoraConfig in
lora_adapter_metadata) and the same LoRA in krea-ai's original module names (`diffusion_model.blocks.0.attn.wq`,
the reference trainer's / ComfyUI's; no alpha, its scale folded into lora_B), both read by diffusers'
Krea2LoraLoaderMixin as that adapter; every block's
attention (q, k, v, out, the gate) and SwiGLU, the text fusion's, the time projection and img_in; a LoRA of another
architecture refused in one line."""

import copy
import re
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

import mlxdiff  # noqa: F401  (OpenBLAS preload before mlx)
import mlx.core as mx

import parity
from helpers import load_ours, max_rel_err
from mlxdiff import lora
from mlxdiff.errors import MlxdiffError
from mlxdiff.models import krea2
from krea2_helpers import CONFIG, make_inputs, make_torch_model, mlx_forward, text_mask, torch_forward
import fixture_guard

RANK, ALPHA = 3, 1.5           # scale alpha / rank = 0.5
TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "to_gate", "gate", "up", "down", "time_mod_proj", "img_in"]
BLOCKS = CONFIG["num_layers"] + CONFIG["num_layerwise_text_blocks"] + CONFIG["num_refiner_text_blocks"]
LAYERS = 8 * BLOCKS + 2
SCALE = 0.6       # not 1: a scale applied twice (or squared) must show
# diffusers module -> krea-ai's (the inverse of _convert_non_diffusers_krea2_lora_to_diffusers)
PARTS = {"attn.to_q": "attn.wq", "attn.to_k": "attn.wk", "attn.to_v": "attn.wv", "attn.to_out.0": "attn.wo",
         "attn.to_gate": "attn.gate", "ff.gate": "mlp.gate", "ff.up": "mlp.up", "ff.down": "mlp.down"}


@pytest.fixture(autouse=True)
def _shared_fixtures_unchanged(request):
    """The module's shared fixtures are left as built (fixture_guard)."""
    yield from fixture_guard.unchanged(request, ['lora_files', 'scaled_reference'])


def original_module(layer):
    """A diffusers module name -> diffusion_model.<krea-ai module>."""
    if m := re.fullmatch(r"transformer_blocks\.(\d+)\.(.+)", layer):
        name = f"blocks.{m.group(1)}.{PARTS[m.group(2)]}"
    elif m := re.fullmatch(r"text_fusion\.(\w+_blocks)\.(\d+)\.(.+)", layer):
        name = f"txtfusion.{m.group(1)}.{m.group(2)}.{PARTS[m.group(3)]}"
    else:
        name = {"time_mod_proj": "tproj.1", "img_in": "first"}[layer]
    return "diffusion_model." + name


@pytest.fixture(scope="module")
def lora_files(tmp_path_factory):
    from diffusers import Krea2Pipeline
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict
    root = tmp_path_factory.mktemp("krea2_lora")
    base = make_torch_model()
    base.save_pretrained(str(root / "transformer"))
    adapted = copy.deepcopy(base)
    config = LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=TARGETS, init_lora_weights=False)
    adapted.add_adapter(config)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in adapted.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    adapted.eval()
    state = {k: v.detach().clone().contiguous() for k, v in get_peft_model_state_dict(adapted).items()}
    assert len(state) == 2 * LAYERS
    files = {"peft": root / "krea2-peft-lora.safetensors", "original": root / "krea2-original-lora.safetensors"}
    Krea2Pipeline.save_lora_weights(str(root), transformer_lora_layers=state, weight_name=files["peft"].name,
                                    transformer_lora_adapter_metadata=config.to_dict())
    out = {}       # no alpha entries (diffusers' converter takes lora_A / lora_B only): alpha / rank folded into B
    for key, value in state.items():
        layer, role = key.rsplit(".", 2)[0], key.rsplit(".", 2)[1]
        out[f"{original_module(layer)}.{role}.weight"] = value * (ALPHA / RANK) if role == "lora_B" else value
    save_file(out, str(files["original"]))
    return base, adapted, root / "transformer", files


def ours_with(folder, path, scale=1.0):
    model = load_ours(folder, krea2)
    lora.check(SimpleNamespace(name="transformer", arch=krea2, args=model.args), path)
    return lora.apply_loras(model, krea2, [(path, scale)])


@pytest.fixture(scope="module")
def scaled_reference(lora_files):
    """diffusers' output with the adapter at SCALE (PEFT's set_adapters on a copy); the LoRA at scale 1 and no LoRA
    each move it (parity.assert_moves)."""
    base, adapted, _, _ = lora_files
    inputs, mask = make_inputs(), text_mask()
    scaled = copy.deepcopy(adapted)
    scaled.set_adapters(["default"], weights=[SCALE])
    ref = torch_forward(scaled, inputs, mask)
    parity.assert_moves("the LoRA's scale", ref, torch_forward(adapted, inputs, mask))
    parity.assert_moves("the LoRA", ref, torch_forward(base, inputs, mask))
    return ref


@pytest.mark.parametrize("naming", ["peft", "original"])
def test_lora_matches_diffusers(lora_files, scaled_reference, naming):
    base, adapted, folder, files = lora_files
    inputs, mask = make_inputs(), text_mask()
    model = ours_with(folder, files[naming], SCALE)
    wrapped = [n for n, m in model.named_modules() if isinstance(m, lora.LoRALinear)]
    assert len(wrapped) == LAYERS
    err = max_rel_err(mlx_forward(model, inputs, mask), scaled_reference)
    print(f"Krea 2 LoRA ({naming}) at {SCALE}: max_rel_err {err:.2e}")
    assert err <= parity.LATENT_TOL
    lora.remove_loras(model)
    assert max_rel_err(mlx_forward(model, inputs, mask), torch_forward(base, inputs, mask)) <= parity.LATENT_TOL


@pytest.mark.parametrize("naming", ["peft", "original"])
def test_the_reference_is_what_diffusers_loads(lora_files, naming):
    """diffusers' own Krea2LoraLoaderMixin.load_lora_weights reads both files as the adapter they were made from
    (its _convert_non_diffusers_krea2_lora_to_diffusers for the original names)."""
    from diffusers.loaders.lora_pipeline import Krea2LoraLoaderMixin
    base, adapted, _, files = lora_files

    class Pipeline(Krea2LoraLoaderMixin):     # what load_lora_weights needs of a pipeline: its transformer
        components = {}
        hf_device_map = None

        def __init__(self, transformer):
            self.transformer = transformer
    model = copy.deepcopy(base)
    Pipeline(model).load_lora_weights(str(files[naming]), adapter_name="x")
    inputs, mask = make_inputs(), text_mask()
    assert max_rel_err(torch_forward(model, inputs, mask), torch_forward(adapted, inputs, mask)) <= 1e-5


def test_another_architectures_lora_is_refused(lora_files, tmp_path):
    _, _, folder, _ = lora_files
    path = tmp_path / "qwen.safetensors"
    save_file({"transformer.transformer_blocks.0.img_mod.1.lora_A.weight": torch.zeros(2, 96),
               "transformer.transformer_blocks.0.img_mod.1.lora_B.weight": torch.zeros(576, 2)}, str(path))
    model = load_ours(folder, krea2)
    with pytest.raises(MlxdiffError, match="a LoRA for Qwen-Image") as e:
        lora.check(SimpleNamespace(name="transformer", arch=krea2, args=model.args), path)
    assert "\n" not in str(e.value)
