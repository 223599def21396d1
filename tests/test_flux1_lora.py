"""FLUX.1 LoRAs as people have them: kohya's (`lora_unet_double_blocks_0_img_attn_qkv`, the fused qkv and the single
blocks' linear1 whole), BFL / ComfyUI's original names (`diffusion_model.double_blocks.0.img_attn.qkv.lora_A`), and
diffusers / PEFT's (`transformer.single_transformer_blocks.0.attn.to_q.lora_A`), against diffusers' FluxPipeline with
the same LoRA loaded by load_lora_weights (in PEFT form: diffusers' own kohya and BFL converters hard-code FLUX.1's
3072 width, so the fused files' reference is their split written as PEFT, the fused A shared by the parts)."""

import pytest
import torch
from safetensors.torch import save_file

import mlxdiff
import parity
from lora_helpers import flux1_lora_files
from flux1_helpers import H, W, check_parity, flux1_components, packed_noise, reference_run
import fixture_guard

RANK, ALPHA = 4, 2.0       # kohya's scale alpha / rank = 0.5


@pytest.fixture(autouse=True)
def _shared_fixtures_unchanged(request):
    """The module's shared fixtures are left as built (fixture_guard)."""
    yield from fixture_guard.unchanged(request, ['lora_files', 'peft_reference'])


@pytest.fixture(scope="module")
def lora_files(tmp_path_factory):
    """A tiny dev folder, and one LoRA in three namings plus its PEFT twin for diffusers: on the first double block's
    image qkv and proj, the second's text MLP, every single block's linear1 and linear2."""
    from diffusers import FluxPipeline
    root = tmp_path_factory.mktemp("flux1_lora")
    pipe = FluxPipeline(**flux1_components("dev", seed=3))
    pipe.save_pretrained(str(root / "model"))
    cfg = pipe.transformer.config
    dim = cfg.num_attention_heads * cfg.attention_head_dim
    files = flux1_lora_files(root, "flux1", dim, cfg.num_single_layers, torch.Generator().manual_seed(9),
                             RANK, ALPHA)
    return root / "model", files


PROMPT = "a red fox in the snow"
RUN = dict(width=W, height=H, steps=3, guidance=3.5, progress_bar=False)


def reference(folder, lora, noise, scale, moved_scale, pipe=None):
    """diffusers' FluxPipeline (the folder's, or the test's own `pipe`, read from it) with the LoRA loaded by
    load_lora_weights at `scale`: (latents, image), after checking that the LoRA at `moved_scale` moves both
    (parity.assert_inputs_matter)."""
    from diffusers import FluxPipeline
    pipe = FluxPipeline.from_pretrained(str(folder)) if pipe is None else pipe
    pipe.load_lora_weights(str(lora), adapter_name="test")

    def run(scale):
        pipe.set_adapters(["test"], [scale])
        return reference_run(pipe, noise, prompt=PROMPT, num_inference_steps=3, guidance_scale=3.5,
                             max_sequence_length=512)
    return parity.assert_inputs_matter(run, dict(scale=scale), {"the LoRA's scale": dict(scale=moved_scale)})


@pytest.fixture(scope="module")
def peft_reference(lora_files):
    """The three namings' one reference: the PEFT twin at 0.8 (0.3 moves it), from packed_noise(4)."""
    folder, files = lora_files
    return reference(folder, files["peft"], packed_noise(4), 0.8, 0.3)


@pytest.mark.parametrize("naming", ["kohya", "original", "peft"])
def test_lora_matches_diffusers(lora_files, peft_reference, naming):
    folder, files = lora_files
    ref_latents, ref_image = peft_reference
    result = mlxdiff.load(str(folder), loras=[(str(files[naming]), 0.8)]).generate(PROMPT, latents=packed_noise(4),
                                                                                 **RUN)
    check_parity(result, ref_latents, ref_image, f"{naming} LoRA at 0.8")


def test_flux1_lora_on_another_family_is_one_line(lora_files, sd3_tiny):
    from mlxdiff.errors import MlxdiffError
    _, files = lora_files
    folder, _ = sd3_tiny
    with pytest.raises(MlxdiffError, match="FLUX.1") as e:
        mlxdiff.load(str(folder), loras=[str(files["kohya"])])
    assert "\n" not in str(e.value)


def test_xlabs_lora_matches_diffusers(lora_files, tmp_path):
    """XLabs' naming (x-flux: double_blocks.N.processor.qkv_lora1 / proj_lora2 ..., single_blocks.N.processor.
    qkv_lora / proj_lora; .down / .up, no alpha), against diffusers' own XLabs converter on the same file."""
    import json
    folder, _ = lora_files
    cfg = json.loads((folder / "transformer" / "config.json").read_text())     # no pipeline load for its widths
    dim = cfg["num_attention_heads"] * cfg["attention_head_dim"]
    g = torch.Generator().manual_seed(13)
    tensors = {}

    def lora(name, ins, outs):
        tensors[f"{name}.down.weight"] = torch.randn(RANK, ins, generator=g) * 0.3
        tensors[f"{name}.up.weight"] = torch.randn(outs, RANK, generator=g) * 0.3

    for i in range(cfg["num_layers"]):
        for stream in ("1", "2"):
            lora(f"double_blocks.{i}.processor.qkv_lora{stream}", dim, 3 * dim)
            lora(f"double_blocks.{i}.processor.proj_lora{stream}", dim, dim)
    lora("single_blocks.0.processor.qkv_lora", dim, 3 * dim)
    lora("single_blocks.1.processor.proj_lora", 5 * dim, dim)
    path = tmp_path / "flux1-xlabs-lora.safetensors"
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
    noise = packed_noise(6)
    ref_latents, ref_image = reference(folder, path, noise, 0.7, 0.3)
    result = mlxdiff.load(str(folder), loras=[(str(path), 0.7)]).generate(PROMPT, latents=noise, **RUN)
    check_parity(result, ref_latents, ref_image, "xlabs LoRA at 0.7")


def test_dora_matches_diffusers(lora_files, tmp_path):
    """PEFT's DoRA (use_dora: a lora_magnitude_vector per layer) as diffusers saves it, against diffusers'
    load_lora_weights (PEFT's DoraLinearLayer) on the same file: m / ||W + s B A|| per output row scales the layer's
    output and the LoRA's term."""
    from diffusers import FluxPipeline
    folder, _ = lora_files
    pipe = FluxPipeline.from_pretrained(str(folder))
    base = pipe.transformer.state_dict()
    g = torch.Generator().manual_seed(17)
    tensors = {}
    for layer in ("transformer_blocks.0.attn.to_q", "transformer_blocks.1.ff.net.2",
                  "single_transformer_blocks.1.proj_mlp", "single_transformer_blocks.0.proj_out"):
        weight = base[layer + ".weight"]
        out, ins = weight.shape
        tensors[f"transformer.{layer}.lora_A.weight"] = torch.randn(RANK, ins, generator=g) * 0.3
        tensors[f"transformer.{layer}.lora_B.weight"] = torch.randn(out, RANK, generator=g) * 0.3
        # a trained magnitude: the row norms of W moved, so the factor is not 1
        tensors[f"transformer.{layer}.lora_magnitude_vector"] = weight.norm(dim=1) * (
            1 + 0.3 * torch.randn(out, generator=g))
    path = tmp_path / "flux1-dora.safetensors"
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
    noise = packed_noise(8)
    ref_latents, ref_image = reference(folder, path, noise, 0.9, 0.4, pipe=pipe)
    result = mlxdiff.load(str(folder), loras=[(str(path), 0.9)]).generate(PROMPT, latents=noise, **RUN)
    check_parity(result, ref_latents, ref_image, "DoRA at 0.9")
    # the magnitudes matter: the same LoRA without them (plain LoRA) moves diffusers' result
    plain = {k: v for k, v in tensors.items() if "magnitude" not in k}
    save_file({k: v.contiguous() for k, v in plain.items()}, str(tmp_path / "plain.safetensors"))
    pipe.load_lora_weights(str(tmp_path / "plain.safetensors"), adapter_name="plain")
    pipe.set_adapters(["plain"], [0.9])
    without = reference_run(pipe, noise, prompt=PROMPT, num_inference_steps=3, guidance_scale=3.5,
                            max_sequence_length=512)
    parity.assert_moves("the DoRA magnitudes", ref_latents, without[0], ref_image, without[1])
