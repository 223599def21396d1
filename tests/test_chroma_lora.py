"""Chroma takes FLUX.1's LoRAs (its blocks are FLUX.1's under the same names): kohya's fused names
(`lora_unet_double_blocks_0_img_attn_qkv`, a single block's linear1 whole), BFL / ComfyUI's original names and
diffusers / PEFT's, against diffusers' ChromaPipeline with the LoRA loaded by its own load_lora_weights (in PEFT
form: the fused files' reference is their split written as PEFT, the fused A shared by the parts). A LoRA layer
Chroma does not have (FLUX.1's per-block modulation, which Chroma's approximator replaces) is refused in one line."""

import pytest
import torch
from safetensors.torch import load_file, save_file

import mlxdiff
import parity
from lora_helpers import flux1_lora_files
from mlxdiff.errors import MlxdiffError
from chroma_helpers import (H, W, check_parity, chroma_tiny, packed_noise,  # noqa: F401  (the fixture)
                            reference_run)
import fixture_guard

RANK, ALPHA = 4, 2.0       # kohya's scale alpha / rank = 0.5
PROMPT, NEGATIVE, SEQUENCE = "a red fox in the snow", "blurry", 40


@pytest.fixture(autouse=True)
def _shared_fixtures_unchanged(request):
    """The module's shared fixtures are left as built (fixture_guard)."""
    yield from fixture_guard.unchanged(request, ['chroma_tiny', 'lora_files'])


@pytest.fixture(scope="module")
def lora_files(chroma_tiny, tmp_path_factory):  # noqa: F811
    """One LoRA in three namings: the first double block's image qkv and proj, the second's text MLP, every single
    block's linear1 and linear2."""
    folder, pipe = chroma_tiny
    root = tmp_path_factory.mktemp("chroma_lora")
    cfg = pipe.transformer.config
    dim = cfg.num_attention_heads * cfg.attention_head_dim
    files = flux1_lora_files(root, "chroma", dim, cfg.num_single_layers, torch.Generator().manual_seed(11),
                             RANK, ALPHA)
    kohya = load_file(str(files["kohya"]))
    modulation = root / "flux1-modulation-lora.safetensors"      # a FLUX.1 LoRA that also trains img_mod
    save_file({**{k: v.clone().contiguous() for k, v in kohya.items()},
               "lora_unet_double_blocks_0_img_mod_lin.lora_down.weight": torch.zeros(RANK, dim),
               "lora_unet_double_blocks_0_img_mod_lin.lora_up.weight": torch.zeros(6 * dim, RANK)}, str(modulation))
    files["modulation"] = modulation
    return folder, files


@pytest.fixture(scope="module")
def peft_reference(lora_files):
    """The three namings' one reference: diffusers' ChromaPipeline with the PEFT twin loaded by load_lora_weights at
    0.8 (true CFG at 4), from packed_noise(5); the LoRA at 0.3 moves it (parity.assert_inputs_matter)."""
    from diffusers import ChromaPipeline
    folder, files = lora_files
    pipe = ChromaPipeline.from_pretrained(str(folder))
    pipe.load_lora_weights(str(files["peft"]), adapter_name="test")

    def run(scale):
        pipe.set_adapters(["test"], [scale])
        return reference_run(pipe, packed_noise(5), prompt=PROMPT, negative_prompt=NEGATIVE, num_inference_steps=3,
                             guidance_scale=4.0)
    return parity.assert_inputs_matter(run, dict(scale=0.8), {"the LoRA's scale": dict(scale=0.3)})


@pytest.mark.parametrize("naming", ["kohya", "original", "peft"])
def test_chroma_lora_matches_diffusers(lora_files, peft_reference, naming):
    folder, files = lora_files
    ref_latents, ref_image = peft_reference
    result = mlxdiff.load(str(folder), loras=[(str(files[naming]), 0.8)]).generate(
        PROMPT, negative_prompt=NEGATIVE, steps=3, guidance=4.0, width=W, height=H, latents=packed_noise(5),
        max_sequence_length=SEQUENCE, progress_bar=False)
    check_parity(result, ref_latents, ref_image, f"Chroma LoRA ({naming}) at 0.8")


def test_a_layer_chroma_lacks_is_one_line(lora_files):
    folder, files = lora_files
    with pytest.raises(MlxdiffError) as e:
        mlxdiff.load(str(folder), loras=[str(files["modulation"])]).generate(
            PROMPT, steps=1, width=W, height=H, max_sequence_length=SEQUENCE, progress_bar=False)
    message = str(e.value)
    print(message)
    assert "\n" not in message and "img_mod" in message, message
