"""LyCORIS's LoHa, LoKr and DoRA (mlxdiff/lora/) on a tiny FLUX.2 transformer, against PEFT with the same adapter
merged into the diffusers twin, float32:

- the adapters are PEFT's own (LoHaConfig, LoKrConfig, LoraConfig(use_dora=True) injected into the diffusers
  Flux2Transformer2DModel, seeded random factors and magnitudes), saved in the names LyCORIS / kohya write
  (`lora_unet_<module>.hada_w1_a`, `.lokr_w1`, `.lora_down.weight` + `.dora_scale`, `.alpha`: lora_helpers.to_lycoris);
- the transformer's output within 1e-4 (max relative error) of the twin with PEFT's adapter merged (merge()), on the
  plain base, on an affine-quantized (8-bit, mlx.nn.quantize) base and on a GGUF one (Q8_0 blocks in RawLinear
  layers, as a GGUF file loads), whose reference is the twin holding the quantized layers' dequantized weights;
- LoHa / LoKr on the tiny SD 1.5 UNet's convolutions and linear layers, against PEFT's merge the same way;
- bad input in one line: a LoKr whose kron product does not fit its layer, LoKr / LoHa factors that are no pair, a
  dora_scale of the wrong shape (per row and per column), a LoHa with one Tucker core of two, a lokr_t1 (a form
  LyCORIS names but never writes). The Tucker forms and per-column / convolution DoRA: tests/test_lycoris_tucker.py.
"""

import copy
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import mlx.core as mx
import mlx.nn as nn
from helpers import load_ours, max_rel_err, randomize_
from ldm_helpers import UNETS, unet_inputs
from lora_helpers import dequantized_twin, quantized, save, to_lycoris
from mlxdiff import lora
from mlxdiff.errors import MlxdiffError
from mlxdiff.models import flux2

# every in-width a multiple of 32 (the quantized base's group size)
CFG = dict(patch_size=1, in_channels=32, out_channels=None, num_layers=1, num_single_layers=1,
           attention_head_dim=16, num_attention_heads=4, joint_attention_dim=32, timestep_guidance_channels=32,
           mlp_ratio=3.0, axes_dims_rope=(4, 4, 4, 4), rope_theta=2000, eps=1e-6, guidance_embeds=True)
TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "to_add_out", "ff.linear_in", "ff.linear_out",
           "ff_context.linear_out", "to_qkv_mlp_proj", "single_transformer_blocks.0.attn.to_out"]
ALPHA = 8


@pytest.fixture(scope="module")
def twin(tmp_path_factory):
    from diffusers import Flux2Transformer2DModel
    model = randomize_(Flux2Transformer2DModel(**CFG), seed=3, scale=0.15).eval()
    folder = tmp_path_factory.mktemp("lycoris") / "transformer"
    model.save_pretrained(str(folder))
    return model, folder


def inputs(seed=0, grid=(3, 5), text_len=6):
    from diffusers import Flux2Pipeline
    rng = np.random.default_rng(seed)
    text = rng.standard_normal((1, text_len, CFG["joint_attention_dim"])).astype(np.float32)
    return dict(hidden_states=rng.standard_normal((1, grid[0] * grid[1], CFG["in_channels"])).astype(np.float32),
                encoder_hidden_states=text, timestep=np.array([0.7], np.float32),
                img_ids=Flux2Pipeline._prepare_latent_ids(torch.zeros(1, 1, *grid)).numpy(),
                txt_ids=Flux2Pipeline._prepare_text_ids(torch.from_numpy(text)).numpy(),
                guidance=np.array([3.5], np.float32))


def torch_forward(model, x):
    with torch.no_grad():
        return model(**{k: torch.from_numpy(v) for k, v in x.items()}, return_dict=False)[0].numpy()


def mlx_forward(model, x):
    return np.array(model(**{k: mx.array(v) for k, v in x.items()}).astype(mx.float32))


def peft_adapter(model, config, seed, scale=0.2, alpha=ALPHA):
    """(a copy of the torch `model` with PEFT's adapter of `config` merged into its weights, the adapter's state dict
    in LyCORIS / kohya names): seeded random factors; DoRA's magnitudes PEFT's own (the weight norms) times noise."""
    from peft import inject_adapter_in_model
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils import get_peft_model_state_dict
    model = inject_adapter_in_model(config, copy.deepcopy(model))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "magnitude" in name:
                p.mul_(1 + 0.3 * torch.randn(p.shape, generator=g))
            elif any(k in name for k in ("lora_", "hada_", "lokr_")):
                p.copy_(torch.randn(p.shape, generator=g) * scale)
    state = get_peft_model_state_dict(model)
    assert state, "PEFT put no adapter on the model"
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, BaseTunerLayer):
                m.merge()
    return model.eval(), to_lycoris(state, alpha)


def gguf_q8_0(model):
    """mlxdiff's transformer with its Linear layers (in-width a multiple of 32) as GGUF Q8_0 blocks (RawLinear:
    the file's own blocks, decoded per call), as a GGUF file's layers are loaded."""
    from gguf import GGMLQuantizationType
    from gguf_helpers import encode
    from mlxdiff.formats.gguf import RawLinear
    from mlxdiff.lora.apply import _put
    layers = [(p, m) for p, m in model.named_modules() if type(m) is nn.Linear and m.weight.shape[1] % 32 == 0]
    for path, m in layers:
        out, in_ = m.weight.shape
        raw = RawLinear(in_, out, "Q8_0", bias="bias" in m, compute_dtype=mx.float32)
        raw.weight = mx.array(encode(np.array(m.weight), GGMLQuantizationType.Q8_0))
        if "bias" in m:
            raw.bias = m.bias
        raw.freeze()
        _put(model, path, raw)
    assert len(layers) > 10
    return model


def configs():
    from peft import LoHaConfig, LoKrConfig, LoraConfig
    return {
        "LoHa": LoHaConfig(r=4, alpha=ALPHA, target_modules=TARGETS, init_weights=False),
        # r=2: every w2 decomposed (scale alpha / r); decompose_both: w1 as lokr_w1_a @ lokr_w1_b too
        "LoKr": LoKrConfig(r=2, alpha=ALPHA, target_modules=TARGETS, init_weights=False),
        "LoKr both decomposed": LoKrConfig(r=2, alpha=ALPHA, target_modules=TARGETS, init_weights=False,
                                           decompose_both=True),
        # r=8 = alpha: the small layers' w1 and w2 both whole (LyCORIS: scale 1, PEFT: alpha / r = 1)
        "LoKr whole factors": LoKrConfig(r=8, alpha=ALPHA, target_modules=TARGETS, init_weights=False),
        "DoRA": LoraConfig(r=4, lora_alpha=ALPHA, target_modules=TARGETS, init_lora_weights=False, use_dora=True),
    }


FORMS = ["LoHa", "LoKr", "LoKr both decomposed", "LoKr whole factors", "DoRA"]
EXPECTED = {"LoHa": ".hada_w1_a", "LoKr": ".lokr_w2_a", "LoKr both decomposed": ".lokr_w1_a",
            "LoKr whole factors": ".lokr_w2", "DoRA": ".dora_scale"}


@pytest.mark.parametrize("base", ["plain", "affine 8-bit", "GGUF Q8_0"])
@pytest.mark.parametrize("form", FORMS)
def test_lycoris_matches_peft_merged(twin, tmp_path, form, base):
    """The adapter's file on mlxdiff's transformer against PEFT's merge of it into the twin (on a quantized base the
    twin holds the dequantized weights, and DoRA's magnitudes start from their norms, as PEFT's would)."""
    model, folder = twin
    ours = load_ours(folder, flux2)
    ref_base = model
    if base != "plain":
        ours = quantized(ours) if base == "affine 8-bit" else gguf_q8_0(ours)
        ref_base = dequantized_twin(model, ours)
    merged, tensors = peft_adapter(ref_base, configs()[form], seed=FORMS.index(form) + 1)
    assert any(k.endswith(EXPECTED[form]) for k in tensors), sorted(tensors)[:6]
    path = save(tmp_path / f"{form.replace(' ', '_')}.safetensors", tensors)
    x = inputs()
    plain = torch_forward(ref_base, x)
    ref = torch_forward(merged, x)
    lora.check(SimpleNamespace(name="transformer", arch=flux2, args=ours.args), path)
    out = mlx_forward(lora.apply_loras(ours, flux2, [(path, 1.0)]), x)
    wrapped = [m.base for _, m in ours.named_modules() if isinstance(m, lora.LoRALinear)]
    assert wrapped and (base == "plain" or sum(type(b) is not nn.Linear for b in wrapped) >= len(wrapped) // 2)
    err = max_rel_err(out, ref)
    print(f"{form} on {base}: max_rel_err {err:.2e}, moved by the adapter {max_rel_err(ref, plain):.2e}")
    assert err <= 1e-4
    assert max_rel_err(ref, plain) > 1e-2       # the adapter matters
    assert np.abs(mlx_forward(lora.remove_loras(ours), x) - plain).max() <= 1e-4 * np.abs(plain).max()


# -- bad input -----------------------------------------------------------------------------------------------------

LAYER = "lora_unet_transformer_blocks_0_attn_to_out_0"   # 64 in, 64 out


def _r(*shape, seed=0):
    return torch.from_numpy(np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * 0.1)


BAD = {
    "kron shape": ({".lokr_w1": _r(8, 8), ".lokr_w2": _r(8, 9)}, "make a 64 x 72 weight change"),
    "LoKr pair": ({".lokr_w1": _r(8, 8), ".lokr_w2_a": _r(8, 2), ".lokr_w2_b": _r(3, 8)}, "are not a pair"),
    "LoKr both forms": ({".lokr_w1": _r(8, 8), ".lokr_w1_a": _r(8, 2), ".lokr_w1_b": _r(2, 8),
                         ".lokr_w2": _r(8, 8)}, "not a LoKr"),
    "LoHa missing": ({".hada_w1_a": _r(64, 4), ".hada_w1_b": _r(4, 64), ".hada_w2_a": _r(64, 4)}, "not a LoHa"),
    "LoHa ranks": ({".hada_w1_a": _r(64, 4), ".hada_w1_b": _r(3, 64), ".hada_w2_a": _r(64, 4),
                    ".hada_w2_b": _r(4, 64)}, "not a LoHa"),
    "LoHa Tucker half": ({".hada_w1_a": _r(64, 4), ".hada_w1_b": _r(4, 64), ".hada_w2_a": _r(64, 4),
                          ".hada_w2_b": _r(4, 64), ".hada_t1": _r(4, 4, 1, 1)}, "Tucker"),
    "lokr_t1": ({".lokr_w1": _r(8, 8), ".lokr_w2": _r(8, 8), ".lokr_t1": _r(2, 2, 1, 1)}, "'" + LAYER + ".lokr_t1'"),
    "dora_scale rows": ({".lora_down.weight": _r(4, 64), ".lora_up.weight": _r(64, 4),
                         ".dora_scale": _r(63, 1) + 1}, "is not the DoRA magnitude"),
    # a per-column dora_scale (LyCORIS's wd_on_out=False) is read (tests/test_lycoris_tucker.py); one of another
    # width is not
    "dora_scale columns": ({".lora_down.weight": _r(4, 64), ".lora_up.weight": _r(64, 4),
                            ".dora_scale": _r(1, 63) + 1}, "wd_on_out=False"),
    "two magnitudes": ({".lora_down.weight": _r(4, 64), ".lora_up.weight": _r(64, 4),
                        ".dora_scale": _r(64, 1) + 1, ".lora_magnitude_vector": _r(64) + 1}, "both DoRA"),
    "LoHa and LoRA": ({".hada_w1_a": _r(64, 4), ".hada_w1_b": _r(4, 64), ".hada_w2_a": _r(64, 4),
                       ".hada_w2_b": _r(4, 64), ".lora_down.weight": _r(4, 64), ".lora_up.weight": _r(64, 4)},
                      "on one layer"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_lycoris_is_one_line(tmp_path, case):
    tensors, needle = BAD[case]
    path = save(tmp_path / "bad.safetensors", {LAYER + k: v for k, v in tensors.items()})
    args = flux2.ModelArgs.from_dict(CFG)
    with pytest.raises(MlxdiffError) as e:
        lora.check(SimpleNamespace(name="transformer", arch=flux2, args=args), path)
    message = str(e.value)
    print(message)
    assert "\n" not in message and needle in message and str(path) in message


# -- convolutions: the SD 1.5 UNet ---------------------------------------------------------------------------------

UNET_TARGETS = ["to_q", "to_out.0", "proj_in", "ff.net.2", "conv1", "conv2", "conv_shortcut", "conv_in", "conv_out",
                "time_emb_proj"]


@pytest.fixture(scope="module")
def unet_twin():
    """(the tiny SD 1.5 torch UNet, its inputs, a function of a torch UNet giving its noise prediction)."""
    from diffusers import UNet2DConditionModel
    torch.manual_seed(0)
    model = randomize_(UNet2DConditionModel(**UNETS["sd15"]["config"]), seed=1, scale=0.1).eval()
    x = unet_inputs("sd15")

    def run(m):
        with torch.no_grad():
            return m(torch.from_numpy(x["sample"]), torch.from_numpy(x["timestep"]),
                     torch.from_numpy(x["context"])).sample.numpy()
    return model, x, run, run(model)


@pytest.mark.parametrize("form", ["LoHa", "LoKr"])
def test_lycoris_on_unet_convolutions_matches_peft_merged(unet_twin, tmp_path, form):
    """LoHa / LoKr on the tiny SD 1.5 UNet's 3x3 and 1x1 convolutions and linear layers (PEFT's conv factors:
    w1_b / w2_b / lokr_w2_b as (r, in x kh x kw), a whole lokr_w2 as (c, d, kh, kw)): the noise prediction within
    1e-4 of PEFT's merge."""
    from peft import LoHaConfig, LoKrConfig
    from mlxdiff.models import unet
    model, x, run_torch, plain = unet_twin
    config = (LoHaConfig(r=3, alpha=6, target_modules=UNET_TARGETS, init_weights=False) if form == "LoHa" else
              LoKrConfig(r=2, alpha=6, target_modules=UNET_TARGETS, init_weights=False))
    merged, tensors = peft_adapter(model, config, seed=7, scale=0.15, alpha=6)
    assert any(k.endswith((".hada_w1_b", ".lokr_w2_b", ".lokr_w2")) and v.ndim >= 2 and "conv" in k
               for k, v in tensors.items())
    path = save(tmp_path / f"unet_{form}.safetensors", tensors)
    args = unet.ModelArgs.from_dict(dict(model.config))
    ours = unet.Model(args)
    ours.load_weights(list(ours.sanitize({k: mx.array(v.detach().numpy())
                                          for k, v in model.state_dict().items()}).items()), strict=True)
    lora.check(SimpleNamespace(name="unet", arch=unet, args=args), path)
    lora.apply_loras(ours, unet, [(path, 1.0)], component="unet")
    assert any(isinstance(m, lora.LoRAConv) for _, m in ours.named_modules())
    ref = run_torch(merged)
    out = np.array(ours(mx.array(x["sample"]), mx.array(x["timestep"]), mx.array(x["context"]), None))
    err = max_rel_err(out, ref)
    print(f"UNet {form}: max_rel_err {err:.2e}, moved by the adapter {max_rel_err(ref, plain):.2e}")
    assert err <= 1e-4
    assert max_rel_err(ref, plain) > 1e-2
