"""Z-Image LoRAs as people have them, against diffusers' ZImageTransformer2DModel with the same PEFT adapter on it: a
diffusers / PEFT file as ZImagePipeline.save_lora_weights writes it (`transformer.layers.0.attention.to_q.lora_A`,
its LoraConfig in lora_adapter_metadata), the same LoRA in the original names as ComfyUI / musubi-tuner-style
trainers write them (`diffusion_model.layers.0.attention.qkv.lora_down`, q, k, v fused, attention.out, .alpha), and
in kohya's (`lora_unet_layers_0_attention_qkv`); a LoRA of another architecture is refused in one line, both ways."""

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
from lora_helpers import shapes_config
from mlxdiff import lora
from mlxdiff.errors import MlxdiffError
from mlxdiff.models import flux2, zimage
import fixture_guard
from zimage_helpers import LORA_CONFIG as CONFIG

LATENT, TEXT_LEN, PROMPT_LEN = (8, 12), 10, (5, 9)
RANK, ALPHA = 4, 2.0           # scale alpha / rank = 0.5
TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "w1", "w2", "w3"]


@pytest.fixture(autouse=True)
def _shared_fixtures_unchanged(request):
    """The module's shared fixtures are left as built (fixture_guard)."""
    yield from fixture_guard.unchanged(request, ['lora_files', 'scaled_reference'])


def make_inputs(seed=0):
    rng = np.random.default_rng(seed)
    mask = np.stack([(np.arange(TEXT_LEN) < n).astype(np.float32) for n in PROMPT_LEN])
    return dict(hidden_states=rng.standard_normal((2, CONFIG["in_channels"], *LATENT)).astype(np.float32),
                timestep=np.array([0.25, 0.75], dtype=np.float32),
                encoder_hidden_states=rng.standard_normal((2, TEXT_LEN, CONFIG["cap_feat_dim"])).astype(np.float32),
                text_mask=mask)


def torch_forward(model, inputs):
    x = [torch.from_numpy(v)[:, None] for v in inputs["hidden_states"]]
    caps = [torch.from_numpy(e[m > 0]) for e, m in zip(inputs["encoder_hidden_states"], inputs["text_mask"])]
    with torch.no_grad():
        out = model(x, torch.from_numpy(inputs["timestep"]), caps, return_dict=False)[0]
    return torch.stack([o.float() for o in out]).squeeze(2).numpy()


def mlx_forward(model, inputs):
    return np.array(model(**{k: mx.array(v) for k, v in inputs.items()}).astype(mx.float32))


def original_layer(layer):
    """diffusers layer name -> (original name, part of a fused qkv or None)."""
    block, _, rest = layer.rpartition(".attention.")
    if block:
        if rest in ("to_q", "to_k", "to_v"):
            return f"{block}.attention.qkv", "qkv".index(rest[-1])
        if rest == "to_out.0":
            return f"{block}.attention.out", None
    return layer, None


@pytest.fixture(scope="module")
def lora_files(tmp_path_factory):
    """The base (diffusers folder), the base with a PEFT LoRA on every block's attention and SwiGLU (to_q, to_k and
    to_v of a block sharing one lora_A, so that the LoRA has a fused-qkv form), and its files in three namings."""
    from diffusers import ZImagePipeline, ZImageTransformer2DModel
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict
    root = tmp_path_factory.mktemp("zimage_lora")
    torch.manual_seed(0)
    base = randomize_(ZImageTransformer2DModel(**CONFIG), seed=3).eval()
    base.save_pretrained(str(root / "transformer"))
    adapted = copy.deepcopy(base)
    config = LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=TARGETS, init_lora_weights=False)
    adapted.add_adapter(config)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in adapted.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
        for name, m in adapted.named_modules():      # one lora_A for a block's q, k, v (a fused qkv's one A)
            if name.endswith(".attention.to_q"):
                parent = adapted.get_submodule(name.rpartition(".")[0])
                for c in "kv":
                    getattr(parent, f"to_{c}").lora_A["default"].weight.copy_(m.lora_A["default"].weight)
    adapted.eval()
    state = {k: v.detach().clone().contiguous() for k, v in get_peft_model_state_dict(adapted).items()}
    files = {"peft": root / "zimage-peft-lora.safetensors", "original": root / "zimage-original-lora.safetensors",
             "kohya": root / "zimage-kohya-lora.safetensors"}
    ZImagePipeline.save_lora_weights(str(root), transformer_lora_layers=state, weight_name=files["peft"].name,
                                     transformer_lora_adapter_metadata=config.to_dict())
    fused = {}
    for key, a in state.items():
        if key.endswith(".lora_A.weight"):
            layer = key[:-len(".lora_A.weight")]
            name, part = original_layer(layer)
            entry = fused.setdefault(name, {"A": a, "B": {}})
            entry["B"][part] = state[layer + ".lora_B.weight"]
    original, kohya = {}, {}
    for name, entry in fused.items():
        b = entry["B"][None] if None in entry["B"] else torch.cat([entry["B"][i] for i in range(3)])
        for out, prefix in ((original, "diffusion_model." + name), (kohya, "lora_unet_" + name.replace(".", "_"))):
            out[f"{prefix}.lora_down.weight"], out[f"{prefix}.lora_up.weight"] = entry["A"], b
            out[f"{prefix}.alpha"] = torch.tensor(ALPHA)
    assert any(".attention.qkv." in k for k in original) and any("noise_refiner_0_attention_qkv" in k for k in kohya)
    for name, tensors in (("original", original), ("kohya", kohya)):
        save_file({k: v.clone().contiguous() for k, v in tensors.items()}, str(files[name]))
    return base, adapted, root / "transformer", files


def ours_with(folder, path, scale=1.0):
    model = load_ours(folder, zimage)
    lora.check(SimpleNamespace(name="transformer", arch=zimage, args=model.args), path)
    return lora.apply_loras(model, zimage, [(path, scale)])


SCALE = 0.6       # not 1: a scale applied twice (or squared) must show


@pytest.fixture(scope="module")
def scaled_reference(lora_files):
    """diffusers' output with the adapter at SCALE (PEFT's set_adapters on a copy); the LoRA at scale 1 and no LoRA
    each move it (parity.assert_moves)."""
    base, adapted, _, _ = lora_files
    inputs = make_inputs()
    scaled = copy.deepcopy(adapted)
    scaled.set_adapters(["default"], weights=[SCALE])
    ref = torch_forward(scaled, inputs)
    parity.assert_moves("the LoRA's scale", ref, torch_forward(adapted, inputs))
    parity.assert_moves("the LoRA", ref, torch_forward(base, inputs))
    return ref


@pytest.mark.parametrize("naming", ["peft", "original", "kohya"])
def test_lora_matches_diffusers(lora_files, scaled_reference, naming):
    base, adapted, folder, files = lora_files
    inputs = make_inputs()
    model = ours_with(folder, files[naming], SCALE)
    wrapped = [n for n, m in model.named_modules() if isinstance(m, lora.LoRALinear)]
    assert len(wrapped) == (CONFIG["n_layers"] + 2 * CONFIG["n_refiner_layers"]) * len(TARGETS)
    err = max_rel_err(mlx_forward(model, inputs), scaled_reference)
    print(f"Z-Image LoRA ({naming}) at {SCALE}: max_rel_err {err:.2e}")
    assert err <= parity.LATENT_TOL
    lora.remove_loras(model)
    assert max_rel_err(mlx_forward(model, inputs), torch_forward(base, inputs)) <= parity.LATENT_TOL


@pytest.mark.parametrize("naming", ["peft", "kohya"])
def test_the_reference_is_what_diffusers_loads(lora_files, naming):
    """diffusers' own ZImageLoraLoaderMixin.load_lora_weights reads the PEFT and kohya files as the adapter the
    files were made from (its converter drops the `diffusion_model.`-named fused qkv, which mlxdiff splits as it
    splits kohya's)."""
    from diffusers.loaders.lora_pipeline import ZImageLoraLoaderMixin
    base, adapted, _, files = lora_files

    class Pipeline(ZImageLoraLoaderMixin):     # what load_lora_weights needs of a pipeline: its transformer
        components = {}
        hf_device_map = None

        def __init__(self, transformer):
            self.transformer = transformer
    model = copy.deepcopy(base)
    Pipeline(model).load_lora_weights(str(files[naming]), adapter_name="x")
    inputs = make_inputs()
    assert max_rel_err(torch_forward(model, inputs), torch_forward(adapted, inputs)) <= 1e-5


def test_another_architectures_lora_is_refused(lora_files, tmp_path):
    """A FLUX.1 LoRA on Z-Image, and a Z-Image LoRA on FLUX.2 (the embedded klein shapes), each in one line."""
    _, _, folder, files = lora_files
    flux = tmp_path / "flux1-lora.safetensors"
    save_file({"lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight": torch.zeros(RANK, 96),
               "lora_unet_double_blocks_0_img_attn_qkv.lora_up.weight": torch.zeros(288, RANK)}, str(flux))
    model = load_ours(folder, zimage)
    with pytest.raises(MlxdiffError) as e:
        lora.check(SimpleNamespace(name="transformer", arch=zimage, args=model.args), flux)
    message = str(e.value)
    assert "\n" not in message and "a LoRA for FLUX.1" in message and "Z-Image transformer" in message, message
    args = flux2.ModelArgs.from_dict(shapes_config())
    for naming in ("peft", "original", "kohya"):
        with pytest.raises(MlxdiffError) as e:
            lora.check(SimpleNamespace(name="transformer", arch=flux2, args=args), files[naming])
        message = str(e.value)
        assert "\n" not in message and "a LoRA for Z-Image" in message, (naming, message)
