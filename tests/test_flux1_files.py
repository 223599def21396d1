"""FLUX.1 from the files people have, against diffusers' FluxPipeline on the same components: BFL names with the
ComfyUI prefix in ComfyUI's folders (models/unet, models/clip, models/vae), an all-in-one checkpoint carrying
text_encoders.* and vae.*, and the files given alone."""

import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import mlxdiff
import parity
from helpers import ASSETS, FIXTURES, randomize_
from mlxdiff.errors import MlxdiffError
from flux1_helpers import check_parity, flux1_components, reference_run
from flux2_helpers import CONFIGS as FLUX2_CONFIGS, make_torch_model
from twins import diffusers_to_ldm, flux1_to_bfl
import fixture_guard

H, W = 40, 24
LATENT = 6


@pytest.fixture(autouse=True)
def _shared_fixtures_unchanged(request):
    """The module's shared fixtures are left as built (fixture_guard)."""
    yield from fixture_guard.unchanged(request, ['files'])


def components(seed=5):
    """Sizes whose configs the files' shapes give back (as real files have none): CLIP-L 64 wide (64-wide heads,
    eos_token_id 2 as the single-file default), T5 with 32 buckets / distance 128, a transformer whose head (32)
    splits into (4, 14, 14) as config_from_original infers, a VAE with 32 groups."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer, T5Config, T5EncoderModel, T5TokenizerFast
    torch.manual_seed(seed)
    clip = CLIPTextModel(CLIPTextConfig(
        vocab_size=49408, hidden_size=64, intermediate_size=80, num_hidden_layers=2, num_attention_heads=1,
        max_position_embeddings=77, hidden_act="gelu", eos_token_id=2))
    t5 = T5EncoderModel(T5Config(
        vocab_size=32128, d_model=224, d_kv=12, d_ff=70, num_layers=2, num_heads=5, feed_forward_proj="gated-gelu",
        relative_attention_num_buckets=32, relative_attention_max_distance=128))
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=4 * LATENT, num_layers=1, num_single_layers=2, attention_head_dim=32,
        num_attention_heads=3, joint_attention_dim=224, pooled_projection_dim=64, guidance_embeds=True,
        axes_dims_rope=(4, 14, 14))
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, block_out_channels=(32, 64), layers_per_block=1, latent_channels=LATENT,
        norm_num_groups=32, down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
        scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False)
    for i, m in enumerate((clip, t5, transformer, vae)):
        randomize_(m, seed=seed * 10 + i, scale=0.15)
        m.eval()
    vocab = FIXTURES / "clip" if (FIXTURES / "clip" / "vocab.json").exists() else ASSETS / "clip"
    t5_file = FIXTURES / "t5" if (FIXTURES / "t5" / "tokenizer.json").exists() else ASSETS / "t5"
    return dict(transformer=transformer, vae=vae, text_encoder=clip, text_encoder_2=t5,
                tokenizer=CLIPTokenizer(str(vocab / "vocab.json"), str(vocab / "merges.txt"), model_max_length=77),
                tokenizer_2=T5TokenizerFast(tokenizer_file=str(t5_file / "tokenizer.json"), model_max_length=512),
                scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, base_shift=0.5,
                                                          max_shift=1.15, base_image_seq_len=256,
                                                          max_image_seq_len=4096))


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    from diffusers import FluxPipeline
    comps = components()
    pipe = FluxPipeline(**comps)
    sd = lambda m: {k: v.detach().clone().contiguous() for k, v in m.state_dict().items()}
    cfg = dict(pipe.transformer.config)
    transformer = {"model.diffusion_model." + k: v for k, v in flux1_to_bfl(sd(pipe.transformer), cfg).items()}
    ae = diffusers_to_ldm(sd(pipe.vae), 2)
    # transformers 5 leaves the text_model. prefix out of CLIPTextModel's state dict; the files people have carry it
    clip_l = {k if k.startswith("text_model.") else "text_model." + k: v for k, v in sd(pipe.text_encoder).items()}
    clip_l["text_projection.weight"] = torch.eye(64)   # ComfyUI's clip_l.safetensors carries a projection
    t5 = {k: v for k, v in sd(pipe.text_encoder_2).items() if k != "encoder.embed_tokens.weight"}
    root = tmp_path_factory.mktemp("flux1_files")
    models = root / "models"
    for d in ("unet", "clip", "vae", "checkpoints"):
        (models / d).mkdir(parents=True)
    save_file(transformer, str(models / "unet" / "flux1-tiny.safetensors"))
    save_file(clip_l, str(models / "clip" / "clip_l.safetensors"))
    save_file(t5, str(models / "clip" / "t5xxl_fp16.safetensors"))
    save_file(ae, str(models / "vae" / "ae.safetensors"))
    whole = dict(transformer)
    whole.update({"text_encoders.clip_l.transformer." + k: v for k, v in clip_l.items()})
    whole.update({"text_encoders.t5xxl.transformer." + k: v for k, v in t5.items()})
    whole.update({"vae." + k: v for k, v in ae.items()})
    save_file(whole, str(models / "checkpoints" / "flux1-tiny-fp16.safetensors"))
    return models, pipe


PROMPT = "a lighthouse at dusk"


def test_files_match_diffusers(files):
    """The three layouts against one diffusers run (the prompt moves it); the layouts hold the same tensors under
    other names, so mlxdiff's three results are equal bit for bit."""
    models, pipe = files
    noise = np.random.default_rng(7).standard_normal((1, (H // 4) * (W // 4), 4 * LATENT)).astype(np.float32)
    ref_latents, ref = parity.assert_inputs_matter(
        lambda **kw: reference_run(pipe, noise, num_inference_steps=3, guidance_scale=3.5, max_sequence_length=512,
                                   **kw),
        dict(prompt=PROMPT), {"the prompt": dict(prompt="a red barn at noon")})
    unet = str(models / "unet" / "flux1-tiny.safetensors")
    layouts = {"comfyui_folders": lambda: mlxdiff.load(unet),
               "all_in_one": lambda: mlxdiff.load(str(models / "checkpoints" / "flux1-tiny-fp16.safetensors")),
               "files_alone": lambda: mlxdiff.load(
                   transformer=unet, vae=str(models / "vae" / "ae.safetensors"),
                   text_encoders={"clip_l": str(models / "clip" / "clip_l.safetensors"),
                                  "t5xxl": str(models / "clip" / "t5xxl_fp16.safetensors")})}
    first = None
    for layout, load in layouts.items():
        loaded = load()
        assert loaded.family == "flux1" and loaded.defaults() == {"steps": 28, "guidance": 3.5}
        ours = loaded.generate(PROMPT, width=W, height=H, steps=3, guidance=3.5, latents=noise,
                               max_sequence_length=512, progress_bar=False)
        if first is None:
            check_parity(ours, ref_latents, ref, layout)
            first = ours
        else:
            assert np.array_equal(ours.latents, first.latents), layout
            assert np.array_equal(np.asarray(ours.image), np.asarray(first.image)), layout


def test_a_missing_part_is_one_line_naming_it(files, tmp_path):
    models, _ = files
    (tmp_path / "unet").mkdir()
    shutil.copy(models / "unet" / "flux1-tiny.safetensors", tmp_path / "unet" / "flux1-tiny.safetensors")
    with pytest.raises(MlxdiffError, match="no clip_l text encoder found.*text_encoders=") as e:
        mlxdiff.load(str(tmp_path / "unet" / "flux1-tiny.safetensors"))
    assert "\n" not in str(e.value)
    (tmp_path / "clip").mkdir()
    for name in ("clip_l.safetensors", "t5xxl_fp16.safetensors"):
        shutil.copy(models / "clip" / name, tmp_path / "clip" / name)
    with pytest.raises(MlxdiffError, match="no FLUX.1 VAE found.*ae.safetensors"):
        mlxdiff.load(str(tmp_path / "unet" / "flux1-tiny.safetensors"))


def test_flux1_file_is_not_taken_for_flux2(files):
    """A FLUX.1 transformer given where FLUX.2 files go is read as FLUX.1, and FLUX.2's readers refuse it as FLUX.1."""
    models, _ = files
    from mlxdiff.pipelines import flux2
    from mlxdiff.formats import tensor_shapes
    names = list(tensor_shapes(models / "unet" / "flux1-tiny.safetensors"))
    assert flux2.FAMILY.part_of(names) is None
    with pytest.raises(MlxdiffError, match="FLUX.1"):
        flux2.flux2_files(models / "unet" / "flux1-tiny.safetensors", None, None, None)


def test_cli_from_files_alone(files, tmp_path):
    """python -m mlxdiff.generate with --transformer, --text-encoder clip_l=/t5xxl= and --vae: the API's image."""
    from PIL import Image
    from mlxdiff.generate import main
    models, _ = files
    parts = dict(transformer=str(models / "unet" / "flux1-tiny.safetensors"),
                 text_encoders={"clip_l": str(models / "clip" / "clip_l.safetensors"),
                                "t5xxl": str(models / "clip" / "t5xxl_fp16.safetensors")},
                 vae=str(models / "vae" / "ae.safetensors"))
    out = tmp_path / "out.png"
    rc = main(["--transformer", parts["transformer"], "--text-encoder", f"clip_l={parts['text_encoders']['clip_l']}",
               "--text-encoder", f"t5xxl={parts['text_encoders']['t5xxl']}", "--vae", parts["vae"], "--prompt",
               "a lighthouse at dusk", "--negative-prompt", "fog", "--true-cfg-scale", "2", "--width", str(W),
               "--height", str(H), "--steps", "2", "--seed", "3", "--output", str(out), "--no-progress"])
    assert rc == 0
    api = mlxdiff.load(**parts).generate("a lighthouse at dusk", negative_prompt="fog", true_cfg_scale=2.0, width=W,
                                         height=H, steps=2, seed=3, progress_bar=False)
    assert np.array_equal(np.asarray(Image.open(out).convert("RGB")), np.asarray(api.image))
    assert Image.open(out).text["mlxdiff:true_cfg_scale"] == "2.0"


def test_true_cfg_scale_is_flux1s_only(files, sd3_tiny, tmp_path, capsys):
    from mlxdiff.generate import main
    folder, _ = sd3_tiny
    rc = main(["--model", str(folder), "--prompt", "a cat", "--true-cfg-scale", "2", "--width", "32", "--height", "32",
               "--steps", "1", "--output", str(tmp_path / "x.png"), "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "true_cfg_scale: an option of FLUX.1 and Qwen-Image models only" in err[0]
    assert not (tmp_path / "x.png").exists()


def test_a_flux2_transformer_given_to_flux1_is_one_line(tmp_path):
    """The reverse of test_flux1_file_is_not_taken_for_flux2: a FLUX.2 BFL file as a FLUX.1 folder's transformer."""
    from diffusers import FluxPipeline
    from twins import flux2_to_bfl
    folder = tmp_path / "dev"
    FluxPipeline(**flux1_components("dev", seed=4)).save_pretrained(str(folder))
    flux2_model = make_torch_model("klein", seed=1)
    state = {k: v.detach().clone().contiguous() for k, v in flux2_model.state_dict().items()}
    save_file(flux2_to_bfl(state, FLUX2_CONFIGS["klein"]), str(tmp_path / "flux2-klein.safetensors"))
    with pytest.raises(MlxdiffError, match="a FLUX.2 transformer alone.*this is a FLUX.1 model") as e:
        mlxdiff.load(str(folder), transformer=str(tmp_path / "flux2-klein.safetensors"))
    assert "\n" not in str(e.value)
