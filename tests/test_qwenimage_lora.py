"""Qwen-Image LoRAs as people have them, against diffusers' QwenImageTransformer2DModel with the same PEFT adapter on
it: a diffusers / PEFT file as QwenImagePipeline.save_lora_weights writes it (`transformer.transformer_blocks.0.attn.
to_q.lora_A`, its LoraConfig in lora_adapter_metadata), the Lightning / ComfyUI / musubi style
(`diffusion_model.transformer_blocks.0.attn.to_q.lora_down` with .alpha, and the same with lora_A / lora_B) and
kohya's (`lora_unet_transformer_blocks_0_attn_to_q`): every naming names diffusers' layers, as diffusers'
QwenImageLoraLoaderMixin reads them; a LoRA of another architecture is refused in one line, both ways."""

import copy
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

import mlxdiff  # noqa: F401  (OpenBLAS preload before mlx)
import mlx.core as mx

import parity
from helpers import load_ours, max_rel_err
from lora_helpers import shapes_config
from mlxdiff import lora
from mlxdiff.errors import MlxdiffError
from mlxdiff.models import flux1, flux2, qwenimage, zimage
from qwenimage_helpers import CONFIG, make_inputs, make_torch_model, mlx_forward, text_mask, torch_forward
import fixture_guard
import zimage_helpers

RANK, ALPHA = 3, 1.5           # scale alpha / rank = 0.5
# every block's attention (image and text streams), both MLPs and both modulations
TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
           "net.0.proj", "net.2", "img_mod.1", "txt_mod.1"]
PER_BLOCK = 8 + 2 * 2 + 2
NAMINGS = {"peft": None, "comfy": ("diffusion_model.", ".", "lora_down", "lora_up"),
           "comfy_ab": ("diffusion_model.", ".", "lora_A", "lora_B"), "kohya": ("lora_unet_", "_", "lora_down",
                                                                             "lora_up")}
CASE = "text-to-image"


@pytest.fixture(autouse=True)
def _shared_fixtures_unchanged(request):
    """The module's shared fixtures are left as built (fixture_guard)."""
    yield from fixture_guard.unchanged(request, ['lora_files', 'scaled_reference'])


@pytest.fixture(scope="module")
def lora_files(tmp_path_factory):
    """The base (a save_pretrained folder), the base with a random PEFT LoRA on TARGETS, and its files in every
    naming."""
    from diffusers import QwenImagePipeline
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict
    root = tmp_path_factory.mktemp("qwenimage_lora")
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
    assert len(state) == 2 * PER_BLOCK * CONFIG["num_layers"]
    files = {name: root / f"qwenimage-{name}-lora.safetensors" for name in NAMINGS}
    QwenImagePipeline.save_lora_weights(str(root), transformer_lora_layers=state, weight_name=files["peft"].name,
                                        transformer_lora_adapter_metadata=config.to_dict())
    for naming, spec in NAMINGS.items():
        if spec is None:
            continue
        prefix, dot, down, up = spec
        out = {}
        for key, a in state.items():
            if key.endswith(".lora_A.weight"):
                layer = key[:-len(".lora_A.weight")]
                name = prefix + layer.replace(".", dot)
                out[f"{name}.{down}.weight"], out[f"{name}.{up}.weight"] = a, state[layer + ".lora_B.weight"]
                out[f"{name}.alpha"] = torch.tensor(ALPHA)
        save_file({k: v.clone().contiguous() for k, v in out.items()}, str(files[naming]))
    return base, adapted, root / "transformer", files


def ours_with(folder, path, scale=1.0):
    model = load_ours(folder, qwenimage)
    lora.check(SimpleNamespace(name="transformer", arch=qwenimage, args=model.args), path)
    return lora.apply_loras(model, qwenimage, [(path, scale)])


SCALE = 0.6       # not 1: a scale applied twice (or squared) must show


@pytest.fixture(scope="module")
def scaled_reference(lora_files):
    """diffusers' output with the adapter at SCALE (PEFT's set_adapters on a copy); the LoRA at scale 1 and no LoRA
    each move it (parity.assert_moves)."""
    base, adapted, _, _ = lora_files
    inputs, mask = make_inputs(CASE), text_mask()
    scaled = copy.deepcopy(adapted)
    scaled.set_adapters(["default"], weights=[SCALE])
    ref = torch_forward(scaled, inputs, CASE, mask)
    parity.assert_moves("the LoRA's scale", ref, torch_forward(adapted, inputs, CASE, mask))
    parity.assert_moves("the LoRA", ref, torch_forward(base, inputs, CASE, mask))
    return ref


@pytest.mark.parametrize("naming", list(NAMINGS))
def test_lora_matches_diffusers(lora_files, scaled_reference, naming):
    base, adapted, folder, files = lora_files
    inputs, mask = make_inputs(CASE), text_mask()
    model = ours_with(folder, files[naming], SCALE)
    wrapped = [n for n, m in model.named_modules() if isinstance(m, lora.LoRALinear)]
    assert len(wrapped) == PER_BLOCK * CONFIG["num_layers"]
    err = max_rel_err(mlx_forward(model, inputs, CASE, mask), scaled_reference)
    print(f"Qwen-Image LoRA ({naming}) at {SCALE}: max_rel_err {err:.2e}")
    assert err <= parity.LATENT_TOL
    lora.remove_loras(model)
    assert max_rel_err(mlx_forward(model, inputs, CASE, mask), torch_forward(base, inputs, CASE, mask)) <= \
        parity.LATENT_TOL


@pytest.mark.parametrize("naming", ["peft", "comfy", "kohya"])
def test_the_reference_is_what_diffusers_loads(lora_files, naming):
    """diffusers' own QwenImageLoraLoaderMixin.load_lora_weights reads the PEFT, ComfyUI-style and kohya files as the
    adapter the files were made from (its _convert_non_diffusers_qwen_lora_to_diffusers for the last two)."""
    from diffusers.loaders.lora_pipeline import QwenImageLoraLoaderMixin
    base, adapted, _, files = lora_files

    class Pipeline(QwenImageLoraLoaderMixin):     # what load_lora_weights needs of a pipeline: its transformer
        components = {}
        hf_device_map = None

        def __init__(self, transformer):
            self.transformer = transformer
    model = copy.deepcopy(base)
    Pipeline(model).load_lora_weights(str(files[naming]), adapter_name="x")
    inputs, mask = make_inputs(CASE), text_mask()
    assert max_rel_err(torch_forward(model, inputs, CASE, mask), torch_forward(adapted, inputs, CASE, mask)) <= 1e-5


def refusal(arch, args, path):
    with pytest.raises(MlxdiffError) as e:
        lora.check(SimpleNamespace(name="transformer", arch=arch, args=args), path)
    message = str(e.value)
    assert "\n" not in message and str(path) in message, message
    return message


def test_another_architectures_lora_is_refused(lora_files, tmp_path):
    """FLUX.1 (kohya) and SD3 / FLUX.1 (diffusers' ff.net, norm1_context) LoRAs on Qwen-Image, and a Qwen-Image LoRA
    in every naming on FLUX.2 (the embedded klein shapes), Z-Image and FLUX.1, each in one line naming the
    architecture; Z-Image's LoRAs are refused on Qwen-Image too."""
    _, _, folder, files = lora_files
    width = CONFIG["num_attention_heads"] * CONFIG["attention_head_dim"]
    args = load_ours(folder, qwenimage).args
    others = {"flux1": {"lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight": torch.zeros(RANK, width),
                        "lora_unet_double_blocks_0_img_attn_qkv.lora_up.weight": torch.zeros(3 * width, RANK)},
              "sd3": {"transformer.transformer_blocks.0.ff.net.2.lora_A.weight": torch.zeros(RANK, 4 * width),
                      "transformer.transformer_blocks.0.ff.net.2.lora_B.weight": torch.zeros(width, RANK),
                      "transformer.transformer_blocks.0.norm1_context.linear.lora_A.weight": torch.zeros(RANK, width),
                      "transformer.transformer_blocks.0.norm1_context.linear.lora_B.weight":
                          torch.zeros(6 * width, RANK)}}
    for name, tensors in others.items():
        save_file(tensors, str(tmp_path / f"{name}.safetensors"))
        message = refusal(qwenimage, args, tmp_path / f"{name}.safetensors")
        assert "a LoRA for FLUX.1" in message and "Qwen-Image transformer" in message, message
    save_file({"diffusion_model.layers.0.attention.qkv.lora_down.weight": torch.zeros(RANK, width),
               "diffusion_model.layers.0.attention.qkv.lora_up.weight": torch.zeros(3 * width, RANK)},
              str(tmp_path / "zimage.safetensors"))
    assert "a LoRA for Z-Image" in refusal(qwenimage, args, tmp_path / "zimage.safetensors")
    targets = {flux2: flux2.ModelArgs.from_dict(shapes_config()),
               zimage: zimage.ModelArgs.from_dict(zimage_helpers.LORA_CONFIG),
               flux1: flux1.ModelArgs.from_dict(dict(num_layers=1, num_single_layers=1, attention_head_dim=16,
                                                     num_attention_heads=2, joint_attention_dim=24,
                                                     pooled_projection_dim=20, in_channels=16,
                                                     axes_dims_rope=(4, 6, 6)))}
    for arch, other_args in targets.items():
        for naming in NAMINGS:
            message = refusal(arch, other_args, files[naming])
            assert "a LoRA for Qwen-Image" in message and arch.LORA_NAME in message, (naming, message)
