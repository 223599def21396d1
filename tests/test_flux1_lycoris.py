"""LyCORIS's LoKr and DoRA on FLUX.1 (issue 39), in the form real FLUX.1 LyCORIS files have: kohya names of BFL's
original layers (`lora_unet_double_blocks_0_img_attn_qkv.lokr_w1`, `lora_unet_single_blocks_0_linear1.dora_scale`),
one factor pair per fused original layer (the double block's qkv, the single block's linear1: q, k, v and the MLP),
against PEFT with the same adapter merged, float32:

- the adapters are PEFT's own (LoKrConfig, LoraConfig(use_dora=True), seeded random factors and magnitudes) injected
  into a torch model of BFL's fused layers, built from the tiny diffusers FluxTransformer2DModel's weights (the
  parts' rows stacked as BFL's checkpoint holds them); PEFT's merge() of it, split back into the diffusers layers,
  is the reference twin; the adapter is saved with lora_helpers.to_lycoris (kohya / LyCORIS names, `.alpha`,
  `.dora_scale` as (out, 1));
- mlxdiff's transformer (tests/helpers.load_ours of the twin's folder) with the file through lora.check and
  lora.apply_loras: its output within 1e-4 (max relative error) of the merged twin's, on the plain base and on an
  affine-quantized (8-bit) one, whose reference holds the dequantized weights (test_lycoris.dequantized_twin).
"""

import copy
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import mlxdiff  # noqa: F401  (OpenBLAS preload before mlx)
from flux1_helpers import make_inputs, make_torch_model, mlx_forward, torch_forward
from helpers import load_ours, max_rel_err
from lora_helpers import dequantized_twin, quantized, save, to_lycoris
from mlxdiff import lora
from mlxdiff.models import flux1

ALPHA = 8

# BFL layer -> the diffusers layers whose rows it stacks, in order
FUSED = {
    "double_blocks.0.img_attn.qkv": ["transformer_blocks.0.attn.to_q", "transformer_blocks.0.attn.to_k",
                                     "transformer_blocks.0.attn.to_v"],
    "double_blocks.0.txt_attn.proj": ["transformer_blocks.0.attn.to_add_out"],
    "double_blocks.1.img_mlp.0": ["transformer_blocks.1.ff.net.0.proj"],
    "double_blocks.1.txt_attn.qkv": ["transformer_blocks.1.attn.add_q_proj", "transformer_blocks.1.attn.add_k_proj",
                                     "transformer_blocks.1.attn.add_v_proj"],
    "single_blocks.0.linear1": ["single_transformer_blocks.0.attn.to_q", "single_transformer_blocks.0.attn.to_k",
                                "single_transformer_blocks.0.attn.to_v", "single_transformer_blocks.0.proj_mlp"],
    "single_blocks.1.linear2": ["single_transformer_blocks.1.proj_out"],
}


@pytest.fixture(scope="module")
def twin(tmp_path_factory):
    model = make_torch_model("dev", seed=5)
    folder = tmp_path_factory.mktemp("flux1_lycoris") / "transformer"
    model.save_pretrained(str(folder))
    return model, folder


def bfl_model(model):
    """A torch module of BFL's fused layers (`double_blocks.0.img_attn.qkv`, ...) holding `model`'s weights."""
    root = torch.nn.Module()
    with torch.no_grad():
        for name, parts in FUSED.items():
            layers = [model.get_submodule(p) for p in parts]
            fused = torch.nn.Linear(layers[0].in_features, sum(m.out_features for m in layers),
                                    bias=layers[0].bias is not None)
            fused.weight.copy_(torch.cat([m.weight for m in layers]))
            if fused.bias is not None:
                fused.bias.copy_(torch.cat([m.bias for m in layers]))
            parent = root
            for piece in name.split(".")[:-1]:
                if not hasattr(parent, piece):
                    parent.add_module(piece, torch.nn.Module())
                parent = getattr(parent, piece)
            parent.add_module(name.rsplit(".", 1)[1], fused)
    return root


def peft_adapter(model, config, seed, scale=0.2):
    """(a copy of the diffusers `model` with PEFT's adapter of `config` on BFL's fused layers merged into its
    weights, the adapter in LyCORIS / kohya names): seeded random factors; DoRA's magnitudes PEFT's own (the fused
    weights' row norms) times noise."""
    from peft import inject_adapter_in_model
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils import get_peft_model_state_dict
    fused = inject_adapter_in_model(config, bfl_model(model))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in fused.named_parameters():
            if "magnitude" in name:
                p.mul_(1 + 0.3 * torch.randn(p.shape, generator=g))
            elif any(k in name for k in ("lora_", "lokr_")):
                p.copy_(torch.randn(p.shape, generator=g) * scale)
    state = get_peft_model_state_dict(fused)
    assert {k.split(".lo")[0] for k in state} == set(FUSED), sorted(state)
    merged = copy.deepcopy(model)
    with torch.no_grad():
        for m in fused.modules():
            if isinstance(m, BaseTunerLayer):
                m.merge()
        for name, parts in FUSED.items():
            layer = fused.get_submodule(name)
            weight = layer.get_base_layer().weight if hasattr(layer, "get_base_layer") else layer.weight
            start = 0
            for p in parts:
                target = merged.get_submodule(p)
                target.weight.copy_(weight[start:start + target.out_features])
                start += target.out_features
            assert start == weight.shape[0]
    return merged.eval(), to_lycoris(state, ALPHA)


def configs():
    from peft import LoKrConfig, LoraConfig
    targets = list(FUSED)
    return {
        # r=2: every w2 decomposed (scale alpha / r)
        "LoKr": LoKrConfig(r=2, alpha=ALPHA, target_modules=targets, init_weights=False),
        "DoRA": LoraConfig(r=4, lora_alpha=ALPHA, target_modules=targets, init_lora_weights=False, use_dora=True),
    }


EXPECTED = {"LoKr": ".lokr_w2_a", "DoRA": ".dora_scale"}


@pytest.mark.parametrize("form,base", [("LoKr", "plain"), ("DoRA", "plain"), ("LoKr", "affine 8-bit"),
                                       ("DoRA", "affine 8-bit")])
def test_flux1_lycoris_matches_peft_merged(twin, tmp_path, form, base):
    """A kohya-named LoKr / DoRA on FLUX.1's fused qkv / linear1 (and unfused proj, MLP, linear2) against PEFT's
    merge of it into the twin."""
    model, folder = twin
    ours = load_ours(folder, flux1)
    ref_base = model
    if base != "plain":
        ours = quantized(ours)
        ref_base = dequantized_twin(model, ours)
    merged, tensors = peft_adapter(ref_base, configs()[form], seed=11 + len(form) + len(base))
    assert any(k.endswith(EXPECTED[form]) for k in tensors), sorted(tensors)[:6]
    assert "lora_unet_double_blocks_0_img_attn_qkv.alpha" in tensors and \
        "lora_unet_single_blocks_0_linear1.alpha" in tensors, sorted(tensors)
    path = save(tmp_path / f"flux1_{form}.safetensors", tensors)
    x = make_inputs("dev")
    plain = torch_forward(ref_base, x)
    ref = torch_forward(merged, x)
    lora.check(SimpleNamespace(name="transformer", arch=flux1, args=ours.args), path)
    out = mlx_forward(lora.apply_loras(ours, flux1, [(path, 1.0)]), x)
    wrapped = {p for p, m in ours.named_modules() if isinstance(m, lora.LoRALinear)}
    assert wrapped == {p for parts in FUSED.values() for p in parts}, sorted(wrapped)
    err = max_rel_err(out, ref)
    moved = max_rel_err(ref, plain)
    print(f"FLUX.1 {form} on {base}: max_rel_err {err:.2e}, moved by the adapter {moved:.2e}")
    assert err <= 1e-4
    assert moved > 1e-2       # the adapter matters
    assert np.abs(mlx_forward(lora.remove_loras(ours), x) - plain).max() <= 1e-4 * np.abs(plain).max()
    if form == "DoRA":   # the magnitudes matter: the same file without its dora_scale is far from the reference
        bare = save(tmp_path / "bare.safetensors", {k: v for k, v in tensors.items() if "dora_scale" not in k})
        without = mlx_forward(lora.apply_loras(ours, flux1, [(bare, 1.0)]), x)
        assert max_rel_err(without, ref) > 100 * max(err, 1e-6)
