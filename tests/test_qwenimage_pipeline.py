"""End to end: mlxdiff's Qwen-Image pipeline against diffusers' QwenImagePipeline on the same injected noise, at a
tiny config: no CFG (true_cfg_scale 1), true CFG with a negative prompt (an explicit scale, and diffusers' default
4.0), true_cfg_scale > 1 without a negative prompt (diffusers warns and runs without CFG); the prompt embeddings and
masks against diffusers' encode_prompt (hidden_states[-1] of the Qwen2.5-VL language model, the template's first 34
tokens dropped), on right and left padding; img2img against QwenImageImg2ImgPipeline; the two weight
namings of Qwen2.5-VL; the multimodal RoPE of text alone against transformers' own; the schedule; the CLI (a
subprocess); transformer files (diffusers' names, bare or under ComfyUI's prefix, the config off the shapes); a LoRA
through the pipeline against QwenImagePipeline.load_lora_weights."""

import json
import shutil

import numpy as np
import pytest
import torch

import mlxdiff
import parity
from helpers import max_rel_err
from mlxdiff.errors import MlxdiffError
import fixture_guard
from qwenimage_helpers import H, NEGATIVE, PROMPT, SCHEDULER, SEQ, TEXT, W, Z, check_parity, noise, reference_unpacked
from qwenimage_helpers import qwen_tiny  # noqa: F401  (the fixture)


@pytest.fixture(autouse=True)
def _shared_fixtures_unchanged(request):
    """The module's shared fixtures are left as built (fixture_guard)."""
    yield from fixture_guard.unchanged(request, ['qwen_tiny'])


def check_embeds(ref, got, what):
    embeds, mask = ref
    mask = torch.ones(embeds.shape[:2], dtype=torch.long) if mask is None else mask
    assert got["prompt_embeds"].shape == tuple(embeds.shape), what
    np.testing.assert_array_equal(got["prompt_embeds_mask"], mask.numpy(), err_msg=what)
    err = max_rel_err(got["prompt_embeds"], embeds.float().numpy())
    print(f"{what}: prompt_embeds max_rel_err {err:.2e}")
    assert err <= 1e-4, what


@pytest.mark.parametrize("padding", ["right", "left"])
def test_encode_prompt_matches_diffusers(qwen_tiny, padding):
    """Two prompts of different lengths (the shorter row padded), and a cut at max_sequence_length."""
    _, pipe, ours = qwen_tiny
    prompts = [PROMPT, "a lighthouse"]
    pipe.tokenizer.padding_side = ours.tokenizer.padding_side = padding
    try:
        for seq in (SEQ, 20):
            with torch.no_grad():
                ref = pipe.encode_prompt(list(prompts), device="cpu", max_sequence_length=seq)
            got = ours.encode_prompt(prompts, max_sequence_length=seq).as_numpy()
            check_embeds(ref, got, f"{padding} padding, max_sequence_length {seq}")
    finally:
        pipe.tokenizer.padding_side = ours.tokenizer.padding_side = "right"


def run_both(qwen_tiny, ours_kw, ref_kw, steps=3, changes=None):
    """mlxdiff's Result, diffusers' unpacked latents and image for the same input; `changes` (each moving
    diffusers' result) checked on the way (parity.assert_inputs_matter)."""
    _, pipe, ours = qwen_tiny
    base = dict(prompt=PROMPT, height=H, width=W, num_inference_steps=steps, max_sequence_length=SEQ, **ref_kw)
    unpacked, ref = parity.assert_inputs_matter(
        lambda **kw: reference_unpacked(pipe, latents=torch.from_numpy(noise()), **kw), base, changes or {})
    got = ours.generate(PROMPT, width=W, height=H, steps=steps, latents=noise(), max_sequence_length=SEQ,
                        progress_bar=False, **ours_kw)
    return got, unpacked, ref


PROMPT_MOVES = {"the prompt": dict(prompt="a blue car parked in the desert at noon")}
CASES = {"no_cfg": (dict(true_cfg_scale=1.0), dict(true_cfg_scale=1.0), PROMPT_MOVES),
         "true_cfg": (dict(negative_prompt=NEGATIVE, true_cfg_scale=2.5), dict(negative_prompt=NEGATIVE,
                                                                               true_cfg_scale=2.5),
                      {**PROMPT_MOVES, "the negative prompt": dict(negative_prompt="sharp, vivid colours"),
                       "true_cfg_scale": dict(true_cfg_scale=1.5)}),
         "default_scale": (dict(negative_prompt=NEGATIVE), dict(negative_prompt=NEGATIVE),      # 4.0 on both
                           {"the default true_cfg_scale": dict(true_cfg_scale=2.0)}),
         "empty_negative": (dict(negative_prompt=""), dict(negative_prompt=""),                  # "" counts
                            {"the empty negative prompt": dict(negative_prompt=None)})}


@pytest.mark.parametrize("case", list(CASES))
def test_qwenimage_pipeline_matches_diffusers(qwen_tiny, case):
    ours_kw, ref_kw, changes = CASES[case]
    got, ref_latents, ref = run_both(qwen_tiny, ours_kw, ref_kw, changes=changes)
    check_parity(got, ref_latents, ref, case)


def ours_only(qwen_tiny, **kw):
    return np.array(qwen_tiny[2].generate(PROMPT, width=W, height=H, steps=2, latents=noise(), max_sequence_length=SEQ,
                                          progress_bar=False, **kw).latents)


def test_scale_without_negative_prompt_runs_without_cfg(qwen_tiny):
    """diffusers warns that true_cfg_scale > 1 without a negative prompt does not enable CFG, and runs one forward a
    step; so does mlxdiff, saying so in the Result's notes. A negative prompt with a scale <= 1 is unused likewise;
    guidance (not guidance-distilled) is ignored with a note."""
    got, ref_latents, ref = run_both(qwen_tiny, dict(true_cfg_scale=5.0), dict(true_cfg_scale=5.0), steps=2)
    check_parity(got, ref_latents, ref, "true_cfg_scale 5 without a negative prompt")
    np.testing.assert_array_equal(np.array(got.latents), ours_only(qwen_tiny, true_cfg_scale=1.0))
    assert any("true_cfg_scale 5 without a negative prompt" in n for n in got.notes), got.notes
    unused, ref_unused, ref = run_both(qwen_tiny, dict(negative_prompt=NEGATIVE, true_cfg_scale=1.0, guidance=3.5),
                                       dict(negative_prompt=NEGATIVE, true_cfg_scale=1.0, guidance_scale=3.5),
                                       steps=2)
    check_parity(unused, ref_unused, ref, "a negative prompt at true_cfg_scale 1")
    assert any("negative prompt unused" in n for n in unused.notes) and any("guidance 3.5 ignored" in n
                                                                           for n in unused.notes), unused.notes


@pytest.mark.parametrize("strength,negative", [(0.6, None), (0.35, NEGATIVE)], ids=["no_cfg", "true_cfg"])
def test_img2img_matches_diffusers(qwen_tiny, strength, negative):
    """QwenImageImg2ImgPipeline with a seeded generator: its two draws (the VAE posterior's noise, then the latent
    noise) are made again here and given to mlxdiff as image_noise= and latents=. The init image, the strength and
    the prompt (and the negative prompt) each move diffusers' result."""
    from diffusers import QwenImageImg2ImgPipeline
    from twins import picture
    _, pipe, ours = qwen_tiny
    img2img = QwenImageImg2ImgPipeline(**pipe.components)
    init = picture(44, 30, 1)                           # resized to 48x32 by both
    h, w = H // 4, W // 4
    g = torch.Generator().manual_seed(7)
    posterior, latent_noise = torch.randn((1, Z, 1, h, w), generator=g), torch.randn((1, 1, Z, h, w), generator=g)
    packed = pipe._pack_latents(latent_noise, 1, Z, h, w).numpy()
    base = dict(prompt=PROMPT, negative_prompt=negative, image=init, strength=strength, height=H, width=W,
                num_inference_steps=4, true_cfg_scale=3.0, max_sequence_length=SEQ, generator_seed=7)
    changes = {"the init image": dict(image=picture(44, 30, 11)), "the prompt": PROMPT_MOVES["the prompt"],
               "the strength": dict(strength=0.6 if strength < 0.5 else 0.3)}    # 1 step against 2
    if negative:
        changes["the negative prompt"] = dict(negative_prompt="sharp, vivid colours")
    ref_latents, ref = parity.assert_inputs_matter(lambda **kw: reference_unpacked(img2img, **kw), base, changes)
    got = ours.generate(PROMPT, negative_prompt=negative, image=init, strength=strength, width=W, height=H, steps=4,
                        true_cfg_scale=3.0, latents=packed, image_noise=posterior[:, :, 0].numpy(),
                        max_sequence_length=SEQ, progress_bar=False)
    check_parity(got, ref_latents, ref, f"img2img strength {strength}")
    start = int(4 - 4 * strength)
    assert any(f"steps {start + 1} to 4" in n for n in got.notes), got.notes


def test_bad_inputs_are_one_line(qwen_tiny):
    from PIL import Image
    _, _, ours = qwen_tiny
    for kwargs, needle in ((dict(true_cfg_scale=-1.0), "true_cfg_scale=-1"),
                           (dict(width=44), "multiples of 8"),
                           (dict(steps=1), "steps=1: the scheduler's shift_terminal 0.02"),
                           (dict(latents=np.zeros((1, 4, 4 * Z), np.float32)), "packed layout"),
                           (dict(image=[Image.new("RGB", (W, H))] * 2), "starts from one image"),
                           (dict(image_noise=np.zeros((1, Z, 2, 2), np.float32), image=Image.new("RGB", (W, H))),
                            f"image_noise has shape (1, {Z}, 2, 2), expected (1, {Z}, {H // 4}, {W // 4})"),
                           (dict(image_noise=np.zeros((1, Z, H // 4, W // 4), np.float32)), "give image= too")):
        with pytest.raises(MlxdiffError) as e:
            ours.generate(PROMPT, **{"width": W, "height": H, "steps": 2, "progress_bar": False, **kwargs})
        assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_cli_writes_the_apis_image(qwen_tiny, tmp_path):
    """python -m mlxdiff.generate on the tiny folder: the PNG is the API's image for the same seed."""
    import subprocess
    import sys
    from PIL import Image
    folder, _, ours = qwen_tiny
    out = tmp_path / "cli.png"
    done = subprocess.run([sys.executable, "-m", "mlxdiff.generate", "--model", str(folder), "--prompt", PROMPT,
                           "--negative-prompt", NEGATIVE, "--true-cfg-scale", "3", "--width", str(W), "--height",
                           str(H), "--steps", "2", "--seed", "7", "--dtype", "float32", "--output", str(out),
                           "--no-progress"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and out.is_file(), done.stderr[-2000:]
    api = ours.generate(PROMPT, negative_prompt=NEGATIVE, true_cfg_scale=3.0, width=W, height=H, steps=2, seed=7,
                        progress_bar=False)
    np.testing.assert_array_equal(np.asarray(Image.open(out).convert("RGB")), np.asarray(api.image))


def test_transformers_5_names_and_vision_tower(qwen_tiny, tmp_path):
    """The text encoder's weights as transformers 5.x names them in memory (`model.language_model.*`, the vision
    tower under `model.visual.*`) give the same embeddings as the saved `model.layers.*` / `visual.*`; the vision
    tower and lm_head are never read."""
    from safetensors.numpy import load_file, save_file
    from mlxdiff.models import text_llm
    folder, _, ours = qwen_tiny
    copy = tmp_path / "renamed"
    shutil.copytree(folder, copy)
    weights = load_file(str(copy / "text_encoder" / "model.safetensors"))
    assert any(k.startswith("model.layers.") for k in weights) and any(k.startswith("visual.") for k in weights)
    renamed = {("model.language_model." + k[len("model."):] if k.startswith("model.") else
                "model." + k if k.startswith("visual.") else k): v for k, v in weights.items()}
    (copy / "text_encoder" / "model.safetensors").unlink()
    save_file(renamed, str(copy / "text_encoder" / "model.safetensors"))
    other = mlxdiff.load(str(copy), dtype="float32")
    args = other.components["text_encoder"].args
    assert not any(text_llm.reads_stored(k, args) for k in renamed if k.startswith(("model.visual.", "lm_head.")))
    assert all(text_llm.reads_stored(k, args) for k in renamed if k.startswith("model.language_model."))
    a = ours.encode_prompt([PROMPT, "a lighthouse"], max_sequence_length=SEQ).as_numpy()
    b = other.encode_prompt([PROMPT, "a lighthouse"], max_sequence_length=SEQ).as_numpy()
    np.testing.assert_array_equal(a["prompt_embeds"], b["prompt_embeds"])


def test_text_alone_multimodal_rope_is_plain_rope():
    """Qwen2.5-VL's rotary embedding (transformers) with its three position rows equal, as a text-only forward
    builds them, is the ordinary RoPE table over the whole head: what mlx-lm's Qwen2 layers apply."""
    import transformers
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLRotaryEmbedding
    for section, head in (([2, 2, 1], 10), ([16, 24, 24], 128)):
        config = transformers.Qwen2_5_VLConfig(text_config=dict(
            TEXT, hidden_size=head * 4, rope_parameters=dict(rope_type="default", rope_theta=1e6,
                                                             mrope_section=section))).text_config
        rope = Qwen2_5_VLRotaryEmbedding(config)
        positions = torch.arange(37)[None, None, :].expand(3, 2, -1)
        cos, sin = rope(torch.zeros(1, dtype=torch.float32), positions)
        inv_freq = 1.0 / (1e6 ** (torch.arange(0, head, 2, dtype=torch.float) / head))
        freqs = torch.arange(37, dtype=torch.float)[:, None] * inv_freq[None]
        plain = torch.cat([freqs, freqs], dim=-1)
        assert cos.shape == sin.shape == (2, 37, head)
        torch.testing.assert_close(cos, plain.cos().expand(2, -1, -1), rtol=0, atol=0)
        torch.testing.assert_close(sin, plain.sin().expand(2, -1, -1), rtol=0, atol=0)


def test_schedule_matches_diffusers():
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift, retrieve_timesteps
    from mlxdiff.pipelines.qwenimage.pipeline import qwenimage_sigmas
    for steps, seq in ((3, 24), (50, 4096), (20, 6240)):
        scheduler = FlowMatchEulerDiscreteScheduler(**SCHEDULER)
        mu = calculate_shift(seq, 256, 8192, 0.5, 0.9)
        retrieve_timesteps(scheduler, steps, "cpu", sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)
        sigmas, timesteps = qwenimage_sigmas(steps, seq, dict(scheduler.config))
        np.testing.assert_allclose(sigmas, scheduler.sigmas.numpy(), rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(timesteps, scheduler.timesteps.numpy(), rtol=1e-6, atol=1e-4)


def test_defaults_are_diffusers(qwen_tiny):
    import inspect
    from diffusers import QwenImagePipeline as Reference
    from mlxdiff.pipelines.qwenimage.pipeline import TRUE_CFG_SCALE
    _, pipe, ours = qwen_tiny
    params = inspect.signature(Reference.__call__).parameters
    assert ours.defaults()["steps"] == params["num_inference_steps"].default == 50
    assert TRUE_CFG_SCALE == params["true_cfg_scale"].default
    assert ours.default_size() == pipe.default_sample_size * pipe.vae_scale_factor
    assert json.loads((qwen_tiny[0] / "model_index.json").read_text())["_class_name"] == "QwenImagePipeline"


@pytest.mark.parametrize("prefix", ["model.diffusion_model.", ""], ids=["comfy", "bare"])
def test_transformer_file_replaces_the_folders(qwen_tiny, tmp_path, prefix):
    """transformer= a file in diffusers' names, under ComfyUI's prefix or bare (as diffusers' from_single_file reads
    them: the identity), its config read off the shapes, gives the folder's result; a file of another model, a
    damaged one and Qwen-Image 2.1's names are one line each."""
    from safetensors.numpy import load_file, save_file
    from mlxdiff.models import qwenimage
    folder, _, ours = qwen_tiny
    weights = load_file(str(folder / "transformer" / "diffusion_pytorch_model.safetensors"))
    path = tmp_path / "qwen_image.safetensors"
    save_file({prefix + k: v for k, v in weights.items()}, str(path))
    assert qwenimage.is_original(list(load_file(str(path))))
    # the config from the shapes is the folder's (axes_dims_rope, which the shapes do not give, aside)
    config = json.loads((folder / "transformer" / "config.json").read_text())
    read = qwenimage.config_from_original(weights)
    for key in ("patch_size", "in_channels", "out_channels", "num_layers", "attention_head_dim",
                "num_attention_heads", "joint_attention_dim"):
        assert read[key] == config[key], key
    assert sum(read["axes_dims_rope"]) == config["attention_head_dim"]
    assert qwenimage.rope_axes(128) == [16, 56, 56]          # Qwen/Qwen-Image's own split
    other = mlxdiff.load(str(folder), transformer=str(path), dtype="float32")
    assert other.components["transformer"].args == ours.components["transformer"].args
    kw = dict(width=W, height=H, steps=2, latents=noise(), max_sequence_length=SEQ, progress_bar=False)
    np.testing.assert_array_equal(np.array(other.generate(PROMPT, **kw).latents),
                                  np.array(ours.generate(PROMPT, **kw).latents))
    save_file({"blocks.0.weight": np.zeros((2, 2), np.float32)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(MlxdiffError, match="not a Qwen-Image transformer in diffusers' names"):
        mlxdiff.load(str(folder), transformer=str(tmp_path / "other.safetensors"))
    key = "transformer_blocks.1.txt_mlp.net.2.weight"
    for name, tensors, needle in (
            ("short.safetensors", {**weights, key: weights[key][:, :-1]}, f"tensor '{key}' has shape"),
            ("gap.safetensors", {k: v for k, v in weights.items() if not k.startswith("transformer_blocks.0.")},
             "transformer_blocks indices are not 0..n-1"),
            ("v21.safetensors", {**weights, "txt_in.text_norm.weight": weights["txt_norm.weight"]},
             "not a Qwen-Image transformer")):
        save_file({prefix + k: v for k, v in tensors.items()}, str(tmp_path / name))
        with pytest.raises(MlxdiffError) as e:
            mlxdiff.load(str(folder), transformer=str(tmp_path / name))
        assert needle in str(e.value) and "\n" not in str(e.value) and name in str(e.value), str(e.value)


def test_components_that_do_not_belong_together_are_one_line(qwen_tiny, tmp_path):
    folder, _, _ = qwen_tiny
    copy = tmp_path / "mismatch"
    shutil.copytree(folder, copy)
    config = json.loads((copy / "transformer" / "config.json").read_text())
    (copy / "transformer" / "config.json").write_text(json.dumps({**config, "joint_attention_dim": 24}))
    with pytest.raises(MlxdiffError, match="joint_attention_dim is 24 but the text encoder .* gives 40 features"):
        mlxdiff.load(str(copy))


def test_lora_through_the_pipeline_matches_diffusers(qwen_tiny, tmp_path):
    """loras=[(a kohya-named file, 0.7)] on the whole pipeline (true CFG, both forwards) against
    QwenImagePipeline.load_lora_weights with the same file and scale."""
    import copy
    from diffusers import QwenImagePipeline
    from safetensors.torch import save_file
    folder, pipe, ours = qwen_tiny
    g = torch.Generator().manual_seed(3)
    width, tensors = 3 * 32, {}
    for i in range(2):
        for layer, (n_in, n_out) in (("attn_to_q", (width, width)), ("attn_add_v_proj", (width, width)),
                                     ("img_mlp_net_2", (4 * width, width)), ("txt_mod_1", (width, 6 * width))):
            name = f"lora_unet_transformer_blocks_{i}_{layer}"
            tensors[f"{name}.lora_down.weight"] = torch.randn(2, n_in, generator=g) * 0.3
            tensors[f"{name}.lora_up.weight"] = torch.randn(n_out, 2, generator=g) * 0.3
            tensors[f"{name}.alpha"] = torch.tensor(1.0)
    path = tmp_path / "qwen-style.safetensors"
    save_file(tensors, str(path))
    twin = QwenImagePipeline(**{**pipe.components, "transformer": copy.deepcopy(pipe.transformer)})
    twin.load_lora_weights(str(path), adapter_name="style")
    with_lora = mlxdiff.load(str(folder), loras=[(str(path), 0.7)], dtype="float32")
    kw = dict(negative_prompt=NEGATIVE, true_cfg_scale=2.5)
    base = dict(prompt=PROMPT, height=H, width=W, num_inference_steps=2, max_sequence_length=SEQ, **kw)

    def run(scale):
        twin.set_adapters(["style"], [scale])
        return reference_unpacked(twin, latents=torch.from_numpy(noise()), **base)
    ref_latents, ref = parity.assert_inputs_matter(run, dict(scale=0.7), {"the LoRA's scale": dict(scale=0.3)})
    got = with_lora.generate(PROMPT, width=W, height=H, steps=2, latents=noise(), max_sequence_length=SEQ,
                             progress_bar=False, **kw)
    check_parity(got, ref_latents, ref, "Qwen-Image pipeline with a LoRA at 0.7")
