"""generate(on_step=...): every denoising step reported with its index, total, timestep and a preview of the output's
size; returning False or pipe.cancel() (from another thread) stops the run between steps with Cancelled, nothing
decoded, the components kept or released as `keep` says; the CLI's --preview. The previews' projection against
ComfyUI's own formula (comfy/latent_formats.py's factors, latent_preview.py's F.linear and preview_to_image, and
FLUX.2's latent_rgb_factors_reshape), written out here in torch; the tiny VAE (--preview-vae) against diffusers'
AutoencoderTiny, in its diffusers and madebyollin namings."""

import threading

import numpy as np
import pytest
import torch
from diffusers import AutoencoderTiny
from PIL import Image
from safetensors.torch import save_file

import mlxdiff
import mlx.core as mx
from mlxdiff import default_model
from mlxdiff.errors import MlxdiffError
from mlxdiff.generate import main as generate_main
from mlxdiff.pipelines import FAMILIES
from mlxdiff.pipelines.base import Cancelled
from mlxdiff.pipelines.previews import FLUX1, FLUX2, SD3, SDXL, WAN21, latent_preview, load_tiny_vae

PROMPT = default_model.PROMPT


@pytest.fixture(scope="module")
def pipe():
    return mlxdiff.load(str(default_model.folder()), keep="auto")


def comfy_preview(latents, rgb, reshape=None):
    """ComfyUI's Latent2RGBPreviewer.decode_latent_to_preview on one image: F.linear over the channels with the
    factors (transposed, as it stores them) and bias, then preview_to_image's ((x + 1) / 2).clamp(0, 1)."""
    x0 = torch.tensor(latents)
    if reshape is not None:
        x0 = reshape(x0)
    factors = torch.tensor(rgb.factors).transpose(0, 1)
    image = torch.nn.functional.linear(x0[0].movedim(0, -1), factors, bias=torch.tensor(rgb.bias))
    return (((image + 1.0) / 2.0).clamp(0, 1) * 255).round().to(torch.uint8).numpy()


@pytest.mark.parametrize("rgb", [SD3, FLUX1, SDXL, WAN21], ids=["sd3", "flux1", "sdxl", "wan21"])
def test_projection_is_comfyui(rgb):
    latents = np.random.default_rng(0).standard_normal((1, len(rgb.factors), 6, 10)).astype(np.float32)
    ours = np.asarray(latent_preview(latents, rgb, 10, 6))          # at the latents' size: no resampling
    assert ours.shape == (6, 10, 3)
    assert np.abs(ours.astype(int) - comfy_preview(latents, rgb)).max() <= 1     # float32 rounding at .5


def test_flux2_unpatchify_is_comfyui():
    """FLUX.2's 128 patchified channels -> 32 at twice the size, ComfyUI's latent_rgb_factors_reshape."""
    latents = np.random.default_rng(1).standard_normal((1, 128, 3, 5)).astype(np.float32)
    reshape = (lambda t: t.reshape(t.shape[0], 32, 2, 2, t.shape[-2], t.shape[-1]).permute(0, 1, 4, 2, 5, 3)
               .reshape(t.shape[0], 32, t.shape[-2] * 2, t.shape[-1] * 2))
    ours = np.asarray(latent_preview(latents, FLUX2, 10, 6))
    assert np.abs(ours.astype(int) - comfy_preview(latents, FLUX2, reshape)).max() <= 1


KNOWN = {"sd3": SD3, "flux1": FLUX1, "chroma": FLUX1, "zimage": FLUX1, "qwenimage": WAN21, "flux2": FLUX2}


def test_families_name_comfyui_projections():
    """Each family with a ComfyUI latent format names its factors (a family without one: first_channels)."""
    named = {f.name: f for f in FAMILIES}
    for name, rgb in KNOWN.items():
        assert all(named[name].latent_rgb(c) is rgb for c in named[name].layouts), name
    sd = next(f for f in FAMILIES if f.name == "sd")
    assert sd.latent_rgb("StableDiffusionXLPipeline") is SDXL and sd.latent_rgb("StableDiffusionPipeline") is not SDXL


def test_preview_size_and_fallback():
    latents = np.random.default_rng(2).standard_normal((1, 16, 128, 96)).astype(np.float32)
    assert latent_preview(latents, FLUX1, 768, 1024).size == (384, 512)      # longest side 512
    # 8 channels: no factors fit (the embedded model's VAE), so its first three channels, each over its range
    small = np.asarray(latent_preview(latents[:, :8], FLUX1, 96, 128))
    assert small.shape == (128, 96, 3) and small.min() == 0 and small.max() == 255


def test_on_step_sees_every_step(pipe):
    seen, timesteps = [], []
    result = pipe.generate(PROMPT, seed=3, steps=3, width=64, height=48, progress_bar=False,
                           callback=lambda i, t, x: timesteps.append(t), on_step=seen.append)
    assert [s.index for s in seen] == [0, 1, 2] and {s.total for s in seen} == {3}
    assert [s.timestep for s in seen] == timesteps and timesteps[0] > timesteps[-1]
    previews = [s.preview for s in seen]
    assert all(p.size == (64, 48) and p.mode == "RGB" for p in previews)
    assert np.asarray(previews[0]).std() > 0                     # not a flat grey
    assert not np.array_equal(np.asarray(previews[0]), np.asarray(previews[-1]))    # it moves as the image forms
    assert result.image.size == (64, 48)


def test_false_stops_between_steps(pipe):
    calls = []
    with pytest.raises(Cancelled, match="after step 2 of 4; no image was made"):
        pipe.generate(PROMPT, seed=3, steps=4, progress_bar=False,
                      on_step=lambda s: calls.append(s.index) or s.index < 1)
    assert calls == [0, 1]
    assert issubclass(Cancelled, MlxdiffError) and mlxdiff.Cancelled is Cancelled     # exported as mlxdiff.Cancelled
    # keep="auto": the components stay loaded, and the next run is unharmed (the same image as from a fresh pipeline)
    assert {key[0] for key in pipe.residency.models} == {"text_encoder", "transformer", "vae"}
    again = pipe.generate(PROMPT, seed=3, steps=2, progress_bar=False).image
    fresh = mlxdiff.load(str(default_model.folder())).generate(PROMPT, seed=3, steps=2, progress_bar=False).image
    assert np.array_equal(np.asarray(again), np.asarray(fresh))


def test_cancel_from_another_thread():
    pipe = mlxdiff.load(str(default_model.folder()))     # keep="none": everything released after the stop
    pipe.cancel()                                        # no run in progress: ignored by the next run
    calls = []

    def on_step(step):
        calls.append(step.index)
        if step.index == 1:
            other = threading.Thread(target=pipe.cancel)
            other.start()
            other.join()

    with pytest.raises(Cancelled, match="after step 2 of 5"):
        pipe.generate(PROMPT, seed=1, steps=5, progress_bar=False, on_step=on_step)
    assert calls == [0, 1] and not pipe.residency.models
    assert pipe.generate(PROMPT, seed=1, steps=1, progress_bar=False).image.size == (64, 64)


def test_cli_preview(tmp_path, capsys):
    out, preview = tmp_path / "out.png", tmp_path / "preview.png"
    assert generate_main(["--steps", "2", "--output", str(out), "--preview", str(preview), "--no-progress"]) == 0
    written = Image.open(preview)
    assert written.size == (64, 64) and written.text["mlxdiff:step"] == "2 of 2"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.png", "preview.png"]     # no temp file left
    assert generate_main(["--steps", "1", "--output", str(out), "--preview", str(tmp_path / "p.jpg")]) == 2
    assert "mlxdiff writes PNG files" in capsys.readouterr().err


def tiny_vae(tmp_path, latent_channels):
    """A diffusers AutoencoderTiny twin (DecoderTiny keeps one width: 12 at every level; 2, 1, 1 blocks, so two 2x
    upsamplings), saved whole in diffusers' names and its decoder alone in madebyollin's (index + 1, behind the
    Clamp)."""
    torch.manual_seed(0)
    twin = AutoencoderTiny(latent_channels=latent_channels, encoder_block_out_channels=(12, 12, 12),
                           decoder_block_out_channels=(12, 12, 12), num_encoder_blocks=(1, 1, 2),
                           num_decoder_blocks=(2, 1, 1)).eval()
    state = {k: v.contiguous() for k, v in twin.state_dict().items()}
    save_file(state, tmp_path / "diffusers.safetensors")
    original = {f"{int(k.split('.')[2]) + 1}.{k.split('.', 3)[3]}": v for k, v in state.items()
                if k.startswith("decoder.layers.")}
    save_file(original, tmp_path / "taesd_decoder.safetensors")
    return twin


def test_tiny_vae_is_diffusers_autoencoder_tiny(tmp_path):
    twin = tiny_vae(tmp_path, latent_channels=5)
    z = np.random.default_rng(3).standard_normal((1, 5, 6, 10)).astype(np.float32) * 2
    with torch.no_grad():
        expected = twin.decode(torch.tensor(z)).sample.numpy()
    ours = np.array(load_tiny_vae(tmp_path / "diffusers.safetensors")(mx.array(z)))
    assert ours.shape == expected.shape == (1, 3, 24, 40)
    assert np.abs(ours - expected).max() / np.abs(expected).max() <= 1e-4
    original = np.array(load_tiny_vae(tmp_path / "taesd_decoder.safetensors")(mx.array(z)))
    assert np.array_equal(original, ours)
    with pytest.raises(MlxdiffError, match="5-channel latents, but this model's VAE has 16"):
        load_tiny_vae(tmp_path / "diffusers.safetensors", latent_channels=16)


def test_previews_through_the_tiny_vae(tmp_path):
    """The embedded model's previews with a tiny VAE for its 8 latent channels: each step's latents (unpacked and
    unpatchified as diffusers' Flux2 pipeline does) through diffusers' decoder, at the 64x64 output."""
    twin = tiny_vae(tmp_path, latent_channels=8)
    pipe = mlxdiff.load(str(default_model.folder())).set_preview_vae(tmp_path / "diffusers.safetensors")
    steps = []
    pipe.generate(PROMPT, seed=2, steps=2, progress_bar=False, on_step=steps.append)
    for step in steps:
        tokens = np.array(step.latents)                                   # (1, 64 tokens, 32 channels)
        packed = torch.tensor(tokens).permute(0, 2, 1).reshape(1, 32, 8, 8)
        latents = packed.reshape(1, 8, 2, 2, 8, 8).permute(0, 1, 4, 2, 5, 3).reshape(1, 8, 16, 16)
        with torch.no_grad():
            image = ((twin.decode(latents).sample / 2 + 0.5).clamp(0, 1)[0].permute(1, 2, 0).numpy() * 255)
        assert step.preview.size == (64, 64)
        assert np.abs(np.asarray(step.preview).astype(float) - image.round()).max() <= 2
    assert generate_main(["--steps", "1", "--output", str(tmp_path / "o.png"), "--preview-vae",
                          str(tmp_path / "diffusers.safetensors")]) == 2     # without --preview: one line
