"""FLUX.1 LoRAs as people have them: kohya's (`lora_unet_double_blocks_0_img_attn_qkv`, the fused qkv and the single
blocks' linear1 whole), BFL / ComfyUI's original names (`diffusion_model.double_blocks.0.img_attn.qkv.lora_A`), and
diffusers / PEFT's (`transformer.single_transformer_blocks.0.attn.to_q.lora_A`), against diffusers' FluxPipeline with
the same LoRA loaded by load_lora_weights (in PEFT form: diffusers' own kohya and BFL converters hard-code FLUX.1's
3072 width, so the fused files' reference is their split written as PEFT, the fused A shared by the parts)."""

import pytest
import torch
from safetensors.torch import save_file

import mlxdiff
from helpers import max_rel_err
from lora_helpers import flux1_lora_files
from test_flux1_pipeline import H, W, flux1_components, packed_noise

RANK, ALPHA = 4, 2.0       # kohya's scale alpha / rank = 0.5


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


def reference(folder, lora, noise, scale=1.0):
    from diffusers import FluxPipeline
    pipe = FluxPipeline.from_pretrained(str(folder))
    pipe.load_lora_weights(str(lora), adapter_name="test")
    pipe.set_adapters(["test"], [scale])
    return pipe(prompt="a red fox in the snow", height=H, width=W, num_inference_steps=3, guidance_scale=3.5,
                latents=torch.from_numpy(noise), output_type="latent", max_sequence_length=512).images


@pytest.mark.parametrize("naming", ["kohya", "original", "peft"])
def test_lora_matches_diffusers(lora_files, naming):
    folder, files = lora_files
    from diffusers import FluxPipeline
    noise = packed_noise(4)
    ref = reference(folder, files["peft"], noise, scale=0.8)
    result = mlxdiff.load(str(folder), loras=[(str(files[naming]), 0.8)]).generate(
        "a red fox in the snow", width=W, height=H, steps=3, guidance=3.5, latents=noise, progress_bar=False)
    ref_unpacked = FluxPipeline._unpack_latents(ref, H, W, 2).numpy()
    err = max_rel_err(result.latents, ref_unpacked)
    plain = mlxdiff.load(str(folder)).generate("a red fox in the snow", width=W, height=H, steps=3, guidance=3.5,
                                               latents=noise, progress_bar=False)
    moved = max_rel_err(plain.latents, ref_unpacked)
    print(f"{naming}: latents {err:.2e} from diffusers with the LoRA; the LoRA moves them {moved:.2e}")
    assert err <= 1e-4
    assert moved > 1e-2


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
    from diffusers import FluxPipeline
    folder, _ = lora_files
    cfg = FluxPipeline.from_pretrained(str(folder)).transformer.config
    dim = cfg.num_attention_heads * cfg.attention_head_dim
    g = torch.Generator().manual_seed(13)
    tensors = {}

    def lora(name, ins, outs):
        tensors[f"{name}.down.weight"] = torch.randn(RANK, ins, generator=g) * 0.3
        tensors[f"{name}.up.weight"] = torch.randn(outs, RANK, generator=g) * 0.3

    for i in range(cfg.num_layers):
        for stream in ("1", "2"):
            lora(f"double_blocks.{i}.processor.qkv_lora{stream}", dim, 3 * dim)
            lora(f"double_blocks.{i}.processor.proj_lora{stream}", dim, dim)
    lora("single_blocks.0.processor.qkv_lora", dim, 3 * dim)
    lora("single_blocks.1.processor.proj_lora", 5 * dim, dim)
    path = tmp_path / "flux1-xlabs-lora.safetensors"
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
    noise = packed_noise(6)
    ref = reference(folder, path, noise, scale=0.7)
    result = mlxdiff.load(str(folder), loras=[(str(path), 0.7)]).generate(
        "a red fox in the snow", width=W, height=H, steps=3, guidance=3.5, latents=noise, progress_bar=False)
    err = max_rel_err(result.latents, FluxPipeline._unpack_latents(ref, H, W, 2).numpy())
    print(f"xlabs: latents {err:.2e} from diffusers with the same file")
    assert err <= 1e-4


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
    ref = reference(folder, path, noise, scale=0.9)
    result = mlxdiff.load(str(folder), loras=[(str(path), 0.9)]).generate(
        "a red fox in the snow", width=W, height=H, steps=3, guidance=3.5, latents=noise, progress_bar=False)
    err = max_rel_err(result.latents, FluxPipeline._unpack_latents(ref, H, W, 2).numpy())
    plain = {k: v for k, v in tensors.items() if "magnitude" not in k}
    save_file({k: v.contiguous() for k, v in plain.items()}, str(tmp_path / "plain.safetensors"))
    without = reference(folder, tmp_path / "plain.safetensors", noise, scale=0.9)
    moved = max_rel_err(without.numpy(), ref.numpy())
    print(f"dora: latents {err:.2e} from diffusers with the same file; the magnitudes move them {moved:.2e}")
    assert err <= 1e-4 and moved > 100 * max(err, 1e-6)
