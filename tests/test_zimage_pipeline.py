"""End to end: mlxdiff's Z-Image pipeline against diffusers' ZImagePipeline on the same injected noise, at a tiny
config: no CFG (guidance 0, Z-Image-Turbo's way) and CFG with a negative prompt; and the prompt embeddings against
diffusers' `_encode_prompt` (hidden_states[-2] of the Qwen3 encoder, each row's valid tokens)."""

import numpy as np
import pytest
import torch

import mlxdiff
import parity
from helpers import max_rel_err, randomize_
from twins import QWEN3_TEMPLATE, build_tokenizer, save_qwen3
import fixture_guard

H, W = 32, 48      # non-square; multiples of 2 (the VAE) x 2 (the patches): latents 16 x 24, 8 x 12 tokens
LATENT = 4
SEQ = 48           # prompt tokens: the short prompts leave padding to drop
TEXT = dict(hidden_size=40, intermediate_size=72, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
            head_dim=12, vocab_size=321, rope_theta=1e6)


@pytest.fixture(autouse=True)
def _shared_fixtures_unchanged(request):
    """The module's shared fixtures are left as built (fixture_guard)."""
    yield from fixture_guard.unchanged(request, ['zimage_tiny'])


@pytest.fixture(scope="module")
def zimage_tiny(tmp_path_factory):
    """A tiny ZImagePipeline: Qwen3 40 wide (3 layers, so hidden_states[-2] is layer 2's output), a transformer 64
    wide (2 heads of 32, RoPE axes 8, 12, 12; 2 main blocks, 1 of each refiner) over 4 latent channels, a 2-level
    AutoencoderKL with Z-Image's scaling and shift, a dynamic-shift flow-match scheduler; saved and read back."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel
    from transformers import AutoTokenizer
    root = tmp_path_factory.mktemp("zimage")
    encoder = save_qwen3(root / "te_src", TEXT, seed=5)
    tok_dir = build_tokenizer(root / "tok_src", ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>",
                                                 "</think>"], QWEN3_TEMPLATE, "right", "<|endoftext|>",
                              eos="<|im_end|>")
    torch.manual_seed(0)
    transformer = ZImageTransformer2DModel(
        all_patch_size=(2,), all_f_patch_size=(1,), in_channels=LATENT, dim=64, n_layers=2, n_refiner_layers=1,
        n_heads=2, n_kv_heads=2, cap_feat_dim=TEXT["hidden_size"], axes_dims=(8, 12, 12), axes_lens=(128, 32, 32))
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, block_out_channels=(8, 12), layers_per_block=1, latent_channels=LATENT,
        norm_num_groups=4, down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
        scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False)
    for i, m in enumerate((transformer, vae)):
        randomize_(m, seed=10 + i, scale=0.15)
        m.eval()
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True,
                                                base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
                                                max_image_seq_len=4096)
    pipe = ZImagePipeline(scheduler=scheduler, vae=vae, text_encoder=encoder.float().eval(),
                          tokenizer=AutoTokenizer.from_pretrained(str(tok_dir)), transformer=transformer)
    folder = root / "pipeline"
    pipe.save_pretrained(str(folder))
    return folder, ZImagePipeline.from_pretrained(str(folder)), mlxdiff.load(str(folder), dtype="float32")


def test_encode_prompt_matches_diffusers(zimage_tiny):
    _, pipe, ours = zimage_tiny
    prompts = ["a red fox in the snow", "a lighthouse"]
    with torch.no_grad():
        ref = pipe._encode_prompt(list(prompts), device="cpu", max_sequence_length=SEQ)
    got = ours.encode_prompt(prompts, do_classifier_free_guidance=False, max_sequence_length=SEQ).as_numpy()
    for i, r in enumerate(ref):
        valid = got["prompt_embeds"][i][got["prompt_attention_mask"][i] > 0]
        assert valid.shape == tuple(r.shape)
        assert max_rel_err(valid, r.float().numpy()) <= 1e-4


def reference_run(pipe, noise=None, generator_seed=None, **kw):
    """One diffusers run from the noise (or a generator seeded afresh): (its final latents, from the step callback;
    its image in [0, 1])."""
    final = {}

    def keep_latents(_, i, t, tensors):
        final["latents"] = tensors["latents"].numpy().copy()
        return {}
    if noise is not None:
        kw["latents"] = torch.from_numpy(noise)
    if generator_seed is not None:
        kw["generator"] = torch.Generator().manual_seed(generator_seed)
    with torch.no_grad():
        image = pipe(max_sequence_length=SEQ, output_type="np", callback_on_step_end=keep_latents, **kw).images[0]
    return final["latents"], image


def check_parity(result, ref_latents, ref_image, what):
    """mlxdiff's latents within LATENT_TOL of diffusers', its image within IMAGE_LEVELS."""
    latents = np.asarray(result.latents, np.float32)
    assert latents.shape == ref_latents.shape
    err = max_rel_err(latents, ref_latents)
    shift = parity.levels(result.image, ref_image)
    print(f"{what}: latents max_rel_err {err:.2e}, image {shift}/255")
    assert err <= parity.LATENT_TOL and shift <= parity.IMAGE_LEVELS
    return err


@pytest.mark.parametrize("guidance,negative", [(0.0, None), (3.5, "blurry, dark")], ids=["no_cfg", "cfg"])
def test_zimage_pipeline_matches_diffusers(zimage_tiny, guidance, negative):
    """The prompt moves diffusers' result; with CFG the negative prompt and the scale do too."""
    _, pipe, ours = zimage_tiny
    noise = np.random.default_rng(2).standard_normal((1, LATENT, H // 2, W // 2)).astype(np.float32)
    base = dict(prompt="a red fox in the snow", negative_prompt=negative, height=H, width=W, num_inference_steps=3,
                guidance_scale=guidance)
    changes = {"the prompt": dict(prompt="a blue car in the desert")}
    if guidance:
        changes.update({"the negative prompt": dict(negative_prompt="sharp, vivid colours"),
                        "the CFG scale": dict(guidance_scale=1.5)})
    ref_latents, ref = parity.assert_inputs_matter(lambda **kw: reference_run(pipe, noise, **kw), base, changes)
    got = ours.generate("a red fox in the snow", negative_prompt=negative, width=W, height=H, steps=3,
                        guidance=guidance, latents=noise, max_sequence_length=SEQ, progress_bar=False)
    check_parity(got, ref_latents, ref, f"Z-Image guidance {guidance}")


def test_defaults_are_diffusers():
    from mlxdiff.pipelines.zimage import ZImagePipeline
    assert ZImagePipeline.defaults(None) == {"steps": 50, "guidance": 5.0}


@pytest.mark.parametrize("dynamic", [True, False], ids=["dynamic_shift", "turbo_static_shift"])
def test_schedule_matches_diffusers(dynamic):
    """The sigmas and timesteps ZImagePipeline sets, for a dynamic-shift config and Z-Image-Turbo's (static shift 3)."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.z_image.pipeline_z_image import calculate_shift, get_default_z_image_sigmas
    from mlxdiff.pipelines.zimage.pipeline import zimage_sigmas
    config = dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=dynamic)
    for steps, seq in ((3, 96), (9, 4096), (50, 1024)):
        scheduler = FlowMatchEulerDiscreteScheduler(**config)
        scheduler.set_timesteps(sigmas=get_default_z_image_sigmas(steps), mu=calculate_shift(seq))
        sigmas, timesteps = zimage_sigmas(steps, seq, dict(scheduler.config))
        np.testing.assert_allclose(sigmas, scheduler.sigmas.numpy(), rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(timesteps, scheduler.timesteps.numpy(), rtol=1e-6, atol=1e-4)
