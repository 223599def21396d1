"""Broken model folders and files are refused in one line (issue 13, the model-folder part).

An adversarial corpus made from the embedded default (weights/klein-shapes: its JSON files mutated one way per case)
and from a config-only tiny SD3.5 folder, each case run through the CLI (or the API) in its own forked child under a
memory cap (tests/adversarial.py): exit 2, one `mlxdiff:` line naming the file and the key, no traceback, no image.
Plus, in process: real diffusers / transformers configs (with the many keys mlxdiff ignores) still pass the checks.
"""

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from adversarial import refused, run_cases
from mlxdiff import default_model
from mlxdiff.config_checks import MAX_WIDTH
from mlxdiff.errors import MlxdiffError
from mlxdiff.loading.sources import SchedulerArgs
from mlxdiff.pipelines.flux2.folder import Flux2FolderOptions
from mlxdiff.models import clip, flux2, mmdit, t5, text_llm, vae, vae_flux2

BIG = 10 ** 9


# -- folders ------------------------------------------------------------------------------------------------------

def write_json(path, value):
    """Replace (never edit in place: the variants share the base's files through hard links)."""
    path = Path(path)
    if path.exists() or path.is_symlink():
        path.unlink()
    path.write_text(value if isinstance(value, str) else json.dumps(value))


def read_json(path):
    return json.loads(Path(path).read_text())


class Folders:
    """Variants of one base folder: the base copied into tmp_path once, each variant a hard-linked copy of that
    (a copy of 15 MB each would cost more than the cases; the repository's own files are never linked)."""

    def __init__(self, base, tmp_path):
        self.base = shutil.copytree(base, tmp_path / "base")
        self.root, self.n = tmp_path / "variants", 0

    def make(self, edit):
        self.n += 1
        folder = self.root / f"v{self.n}"
        shutil.copytree(self.base, folder, copy_function=os.link)
        edit(folder)
        return folder


def set_keys(relpath, **changes):
    """An edit: these keys of one JSON file of the folder set (a value of DELETE removes the key)."""
    def edit(folder):
        value = read_json(folder / relpath)
        for key, v in changes.items():
            if v is DELETE:
                value.pop(key, None)
            else:
                value[key] = v
        write_json(folder / relpath, value)
    return edit


def replace(relpath, text):
    return lambda folder: write_json(folder / relpath, text)


DELETE = object()


def symlink_out(relpath):
    """An edit: `relpath` (a folder or file) moved outside the model folder and linked back."""
    def edit(folder):
        target = folder.parent / f"outside-{folder.name}" / Path(relpath).name
        target.parent.mkdir(parents=True)
        (folder / relpath).rename(target)
        (folder / relpath).symlink_to(target, target_is_directory=target.is_dir())
    return edit


def sd3_config_folder(root):
    """A tiny SD3.5 folder of configs, each weight file a one-tensor stand-in: enough for every config check, which
    runs before any weight is read (and for nothing else)."""
    from safetensors.numpy import save_file
    configs = {
        "transformer": {"_class_name": "SD3Transformer2DModel", "sample_size": 16, "patch_size": 2,
                        "in_channels": 16, "num_layers": 2, "attention_head_dim": 8, "num_attention_heads": 3,
                        "joint_attention_dim": 32, "caption_projection_dim": 24, "pooled_projection_dim": 56,
                        "out_channels": 16, "pos_embed_max_size": 20, "dual_attention_layers": [0],
                        "qk_norm": "rms_norm"},
        "vae": {"_class_name": "AutoencoderKL", "block_out_channels": [8, 12], "latent_channels": 16,
                "norm_num_groups": 4, "down_block_types": ["DownEncoderBlock2D"] * 2,
                "up_block_types": ["UpDecoderBlock2D"] * 2, "layers_per_block": 1},
        "text_encoder": {"architectures": ["CLIPTextModelWithProjection"], "model_type": "clip_text_model",
                         "vocab_size": 49408, "hidden_size": 32, "intermediate_size": 44, "projection_dim": 28,
                         "num_hidden_layers": 2, "num_attention_heads": 4, "hidden_act": "quick_gelu"},
        "text_encoder_2": {"architectures": ["CLIPTextModelWithProjection"], "model_type": "clip_text_model",
                           "vocab_size": 49408, "hidden_size": 40, "intermediate_size": 52, "projection_dim": 28,
                           "num_hidden_layers": 2, "num_attention_heads": 5, "hidden_act": "gelu"},
        "text_encoder_3": {"architectures": ["T5EncoderModel"], "model_type": "t5", "d_model": 32, "d_kv": 8,
                           "d_ff": 40, "num_layers": 2, "num_heads": 4, "feed_forward_proj": "gated-gelu"},
    }
    classes = {"transformer": ("diffusers", "SD3Transformer2DModel"), "vae": ("diffusers", "AutoencoderKL"),
               "text_encoder": ("transformers", "CLIPTextModelWithProjection"),
               "text_encoder_2": ("transformers", "CLIPTextModelWithProjection"),
               "text_encoder_3": ("transformers", "T5EncoderModel"), "tokenizer": ("transformers", "CLIPTokenizer"),
               "tokenizer_2": ("transformers", "CLIPTokenizer"), "tokenizer_3": ("transformers", "T5TokenizerFast"),
               "scheduler": ("diffusers", "FlowMatchEulerDiscreteScheduler")}
    root.mkdir(parents=True)
    write_json(root / "model_index.json", {"_class_name": "StableDiffusion3Pipeline", **classes})
    for name, config in configs.items():
        (root / name).mkdir()
        write_json(root / name / "config.json", config)
        save_file({"x": np.zeros(1, np.float32)}, str(root / name / "model.safetensors"))
    return root


# -- transformer files with impossible shapes ---------------------------------------------------------------------

def flux2_bfl_shapes(dim=192, heads=6, in_channels=32, joint=192, tg=64):
    """The BFL tensors config_from_original reads, in klein-shapes' sizes (zeros: only shapes matter here)."""
    head = dim // heads
    return {"img_in.weight": (dim, in_channels), "txt_in.weight": (dim, joint),
            "time_in.in_layer.weight": (dim, tg), "time_in.out_layer.weight": (dim, dim),
            "double_blocks.0.img_attn.norm.query_norm.scale": (head,),
            "double_blocks.0.img_mlp.0.weight": (6 * dim, dim), "final_layer.linear.weight": (in_channels, dim)}


def write_gguf(path, shapes):
    from gguf import GGUFWriter
    w = GGUFWriter(str(path), "flux")
    for name, shape in shapes.items():
        w.add_tensor(name, np.zeros(shape, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def write_safetensors(path, shapes):
    from safetensors.numpy import save_file
    save_file({k: np.zeros(v, np.float32) for k, v in shapes.items()}, str(path))
    return str(path)


# -- the corpus ---------------------------------------------------------------------------------------------------

MI, TR, VA, TE = "model_index.json", "transformer/config.json", "vae/config.json", "text_encoder/config.json"

# (case, edit, what the one line must contain)
KLEIN_CASES = [
    # model_index.json
    ("index is a list", replace(MI, "[1, 2]"), ["model_index.json", "a list", "JSON object"]),
    ("_class_name is a list", set_keys(MI, _class_name=["Flux2KleinPipeline"]), ["model_index.json", "_class_name"]),
    ("component entry 5", set_keys(MI, vae=5), ["model_index.json", "'vae'", "5"]),
    ("component entry [diffusers]", set_keys(MI, transformer=["diffusers"]), ["'transformer'", '["diffusers"]']),
    ("transformer names the VAE class", set_keys(MI, transformer=["diffusers", "AutoencoderKLFlux2"]),
     ["'transformer'", "AutoencoderKLFlux2", "Flux2Transformer2DModel"]),
    ("component missing", set_keys(MI, vae=DELETE), ["model_index.json", "'vae' is missing"]),
    ("out_layers -1", set_keys(MI, text_encoder_out_layers=-1), ["model_index.json", "text_encoder_out_layers"]),
    ("out_layers past the layers", set_keys(MI, text_encoder_out_layers=[1, 2, 9]),
     ["text_encoder_out_layers", "0 to 3"]),
    ("max_sequence_length 0", set_keys(MI, max_sequence_length=0), ["max_sequence_length is 0", "1 to 512"]),
    ("max_sequence_length -5", set_keys(MI, max_sequence_length=-5), ["max_sequence_length is -5"]),
    ("max_sequence_length '64'", set_keys(MI, max_sequence_length="64"), ['max_sequence_length is "64"']),
    ("max_sequence_length 1e9", set_keys(MI, max_sequence_length=BIG), [f"max_sequence_length is {BIG}"]),
    ("sample_size '64'", set_keys(MI, sample_size="64"), ['sample_size is "64"', "an integer"]),
    ("sample_size off the grid", set_keys(MI, sample_size=60), ["sample_size is 60", "multiple of 8"]),
    ("is_distilled 'no'", set_keys(MI, is_distilled="no"), ['is_distilled is "no"', "true or false"]),
    ("is_distilled 0", set_keys(MI, is_distilled=0), ["is_distilled is 0", "true or false"]),
    # transformer/config.json
    ("transformer config a list", replace(TR, "[]"), ["transformer/config.json", "a list"]),
    ("1e9 heads", set_keys(TR, num_attention_heads=BIG), ["transformer/config.json", "num_attention_heads"]),
    ("1e9 head size", set_keys(TR, attention_head_dim=BIG), ["attention_head_dim"]),
    ("heads as a string", set_keys(TR, num_attention_heads="6"), ['num_attention_heads is "6"', "an integer"]),
    ("layers as a float", set_keys(TR, num_layers=3.0), ["num_layers is 3.0", "an integer"]),
    ("mlp_ratio as a string", set_keys(TR, mlp_ratio="3.0"), ['mlp_ratio is "3.0"', "finite number"]),
    ("eps infinite", replace(TR, json.dumps(read_json(default_model.FOLDER / TR)).replace('"eps": 1e-06',
                                                                                       '"eps": 1e999')),
     ["eps is Infinity", "finite number"]),
    ("guidance_embeds 'false'", set_keys(TR, guidance_embeds="false"), ["guidance_embeds", "true or false"]),
    ("0 heads", set_keys(TR, num_attention_heads=0), ["num_attention_heads is 0"]),
    ("negative mlp_ratio", set_keys(TR, mlp_ratio=-3.0), ["mlp_ratio is -3.0", "> 0"]),
    ("width over the cap", set_keys(TR, num_attention_heads=1000, attention_head_dim=1000,
                                    axes_dims_rope=[250, 250, 250, 250]), [f"at most {MAX_WIDTH}"]),
    ("rope axes off the head", set_keys(TR, axes_dims_rope=[8, 8, 8, 6]), ["axes_dims_rope", "summing to"]),
    ("config nested too deeply", replace(TR, "[" * 100000 + "]" * 100000), ["transformer/config.json", "nested"]),
    ("a 5000-digit integer", replace(TR, '{"num_layers": ' + "9" * 5000 + "}"), ["transformer/config.json"]),
    ("scheduler config a list", replace("scheduler/scheduler_config.json", "[]"), ["scheduler_config.json"]),
    ("scheduler shift a string", set_keys("scheduler/scheduler_config.json", shift="3"),
     ["scheduler_config.json", 'shift is "3"']),
    # vae/config.json
    ("VAE without levels", set_keys(VA, block_out_channels=[]), ["vae/config.json", "block_out_channels is []"]),
    ("VAE 1e9 latent channels", set_keys(VA, latent_channels=BIG), ["vae/config.json", "latent_channels"]),
    ("VAE latents do not fit", set_keys(VA, latent_channels=16), ["in_channels 32", "latent_channels 16"]),
    ("VAE channels off the groups", set_keys(VA, block_out_channels=[32, 64, 60]), ["norm_num_groups 16"]),
    # text_encoder/config.json
    ("vocab_size -5", set_keys(TE, vocab_size=-5), ["text_encoder/config.json", "vocab_size is -5"]),
    ("layers as a string", set_keys(TE, num_hidden_layers="3"), ['num_hidden_layers is "3"']),
    ("text config a list", replace(TE, "[3]"), ["text_encoder/config.json", "a list"]),
    ("kv heads do not divide", set_keys(TE, num_key_value_heads=3), ["num_key_value_heads is 3"]),
    ("head_dim missing", set_keys(TE, head_dim=DELETE), ["head_dim is missing"]),
    # tokenizer
    ("tokenizer.json a list", replace("tokenizer/tokenizer.json", "[]"), ["tokenizer.json", "JSON object"]),
    ("tokenizer.json wrong model", set_keys("tokenizer/tokenizer.json", model=5), ["tokenizer.json", '"model"']),
    ("tokenizer.json wrong added_tokens", set_keys("tokenizer/tokenizer.json", added_tokens=3), ["added_tokens"]),
    # paths stay inside the model
    ("transformer folder links out", symlink_out("transformer"), ["leads outside the model folder"]),
    ("tokenizer folder links out", symlink_out("tokenizer"), ["leads outside the model folder"]),
    ("tokenizer file links out", symlink_out("tokenizer/tokenizer.json"), ["leads outside the model folder"]),
    ("config links out", symlink_out("vae/config.json"), ["vae/config.json", "leads outside"]),
    ("weights link out", symlink_out("text_encoder/model.safetensors"), ["model.safetensors", "leads outside"]),
    ("model_index links out", symlink_out(MI), ["model_index.json", "leads outside"]),
]

SD3_CASES = [
    ("caption dim is not heads x head size", set_keys(TR, caption_projection_dim=25),
     ["caption_projection_dim is 25", "= 24"]),
    ("dual attention past the blocks", set_keys(TR, dual_attention_layers=[5]), ["dual_attention_layers is [5]"]),
    ("CLIP 0 heads", set_keys("text_encoder/config.json", num_attention_heads=0),
     ["text_encoder/config.json", "num_attention_heads is 0"]),
    ("CLIP width off the heads", set_keys("text_encoder_2/config.json", hidden_size=42),
     ["text_encoder_2/config.json", "hidden_size is 42", "multiple of num_attention_heads 5"]),
    ("CLIP vocab -5", set_keys("text_encoder/config.json", vocab_size=-5), ["vocab_size is -5"]),
    ("T5 head size a string", set_keys("text_encoder_3/config.json", d_kv="8"), ['d_kv is "8"']),
    ("T5 bad activation", set_keys("text_encoder_3/config.json", feed_forward_proj="gated-swoosh"),
     ["dense_act_fn"]),
    ("VAE level types short", set_keys(VA, up_block_types=["UpDecoderBlock2D"]), ["up_block_types"]),
    ("text_encoder names a tokenizer class", set_keys(MI, text_encoder=["transformers", "CLIPTokenizer"]),
     ["'text_encoder'", "CLIPTextModelWithProjection"]),
]


def cli(folder, out, *extra):
    return {"cli": "mlxdiff.generate", "argv": ["--model", str(folder), "--steps", "1", "--output", str(out),
                                                "--no-progress", *extra]}


def test_bad_folders_and_files_are_refused_in_one_line(tmp_path):
    klein = Folders(default_model.FOLDER, tmp_path)
    sd3 = Folders(sd3_config_folder(tmp_path / "sd3"), tmp_path / "sd3-variants")
    cases, expected = [], []
    for group, table in ((klein, KLEIN_CASES), (sd3, SD3_CASES)):
        for name, edit, fragments in table:
            out = tmp_path / "out" / f"{len(cases)}.png"
            cases.append(cli(group.make(edit), out))
            expected.append((name, fragments, out))

    # files: transformers of impossible shapes, a FLUX.1 file, a folder given as the file
    shapes = flux2_bfl_shapes()
    files = {
        "1-D img_in (GGUF)": (write_gguf(tmp_path / "flat.gguf", {**shapes, "img_in.weight": (192,)}),
                              ["flat.gguf", "'img_in.weight'", "[192]"]),
        "zero-length norm (safetensors)": (
            write_safetensors(tmp_path / "zero.safetensors",
                              {**shapes, "double_blocks.0.img_attn.norm.query_norm.scale": (0,)}),
            ["zero.safetensors", "query_norm.scale"]),
        "FLUX.1 GGUF": (write_gguf(tmp_path / "flux1.gguf", {**flux2_bfl_shapes(dim=512, heads=4),
                                                             "vector_in.in_layer.weight": (512, 64),
                                                             "double_blocks.0.img_mod.lin.weight": (3072, 512)}),
                        ["flux1.gguf", "FLUX.1"]),
        "head size off the folder's rope": (write_gguf(tmp_path / "wide.gguf", flux2_bfl_shapes(dim=512, heads=4)),
                                            ["wide.gguf", "transformer/config.json", "axes_dims_rope"]),
        "a folder as the file": (str(tmp_path / "variants"), ["variants", "is a folder"]),
    }
    for name, (path, fragments) in files.items():
        out = tmp_path / "out" / f"{len(cases)}.png"
        cases.append(cli(default_model.FOLDER, out, "--transformer", path))
        expected.append((name, fragments, out))

    # the API: the same one line from load() (generate never runs)
    for name, edit, fragments in [("API: is_distilled 'no'", set_keys(MI, is_distilled="no"), ["is_distilled"]),
                                  ("API: 0 heads", set_keys(TR, num_attention_heads=0), ["num_attention_heads"])]:
        folder = klein.make(edit)
        cases.append({"api": f"import mlxdiff\nmlxdiff.load({str(folder)!r}).generate('a red circle', steps=1)"})
        expected.append((name, fragments, None))
    cases.append({"api": f"import mlxdiff\nmlxdiff.load({str(default_model.FOLDER)!r}, "
                         f"transformer={files['FLUX.1 GGUF'][0]!r})"})
    expected.append(("API: FLUX.1 transformer", ["FLUX.1"], None))

    # the control: the unmodified default, copied, still draws
    (tmp_path / "out").mkdir()
    good_out = tmp_path / "out" / "good.png"
    outcomes = run_cases(cases + [cli(klein.make(lambda folder: None), good_out)], tmp_path)
    control = outcomes.pop()
    assert control.rc == 0 and good_out.exists(), control.describe()

    failures = []
    for (name, fragments, out), outcome in zip(expected, outcomes):
        line = outcome.stderr.strip()
        if not refused(outcome) or not all(f in line for f in fragments) or (out is not None and out.exists()):
            failures.append(f"{name}: expected {fragments}\n  {outcome.describe()}")
    assert not failures, "\n".join(failures)


# -- in process: the real configs pass, the table's types come from the annotations ---------------------------------

DIFFUSERS = {"_class_name": "X", "_diffusers_version": "0.35.0", "_name_or_path": "some/where"}
REAL = {
    "SD3.5 Large transformer": (mmdit, {**DIFFUSERS, "attention_head_dim": 64, "caption_projection_dim": 2432,
                                        "dual_attention_layers": [], "in_channels": 16, "joint_attention_dim": 4096,
                                        "num_attention_heads": 38, "num_layers": 38, "out_channels": 16,
                                        "patch_size": 2, "pooled_projection_dim": 2048, "pos_embed_max_size": 192,
                                        "qk_norm": "rms_norm", "sample_size": 128}),
    "SD3.5 Medium transformer": (mmdit, {**DIFFUSERS, "attention_head_dim": 64, "caption_projection_dim": 1536,
                                         "dual_attention_layers": list(range(13)), "in_channels": 16,
                                         "joint_attention_dim": 4096, "num_attention_heads": 24, "num_layers": 24,
                                         "out_channels": 16, "patch_size": 2, "pooled_projection_dim": 2048,
                                         "pos_embed_max_size": 384, "qk_norm": "rms_norm", "sample_size": 128}),
    "SD3 Medium transformer": (mmdit, {**DIFFUSERS, "attention_head_dim": 64, "caption_projection_dim": 1536,
                                       "in_channels": 16, "joint_attention_dim": 4096, "num_attention_heads": 24,
                                       "num_layers": 24, "out_channels": 16, "patch_size": 2,
                                       "pooled_projection_dim": 2048, "pos_embed_max_size": 192,
                                       "sample_size": 128}),
    "SD3.5 VAE": (vae, {**DIFFUSERS, "act_fn": "silu", "block_out_channels": [128, 256, 512, 512],
                        "down_block_types": ["DownEncoderBlock2D"] * 4, "force_upcast": True, "in_channels": 3,
                        "latent_channels": 16, "latents_mean": None, "latents_std": None, "layers_per_block": 2,
                        "mid_block_add_attention": True, "norm_num_groups": 32, "out_channels": 3,
                        "sample_size": 1024, "scaling_factor": 1.5305, "shift_factor": 0.0609,
                        "up_block_types": ["UpDecoderBlock2D"] * 4, "use_post_quant_conv": False,
                        "use_quant_conv": False}),
    "CLIP-L": (clip, {"architectures": ["CLIPTextModelWithProjection"], "attention_dropout": 0.0, "bos_token_id": 0,
                      "dropout": 0.0, "eos_token_id": 2, "hidden_act": "quick_gelu", "hidden_size": 768,
                      "initializer_factor": 1.0, "initializer_range": 0.02, "intermediate_size": 3072,
                      "layer_norm_eps": 1e-05, "max_position_embeddings": 77, "model_type": "clip_text_model",
                      "num_attention_heads": 12, "num_hidden_layers": 12, "pad_token_id": 1, "projection_dim": 768,
                      "torch_dtype": "float16", "transformers_version": "4.41.2", "vocab_size": 49408}),
    "CLIP-G": (clip, {"architectures": ["CLIPTextModelWithProjection"], "bos_token_id": 0, "eos_token_id": 2,
                      "hidden_act": "gelu", "hidden_size": 1280, "intermediate_size": 5120, "layer_norm_eps": 1e-05,
                      "max_position_embeddings": 77, "model_type": "clip_text_model", "num_attention_heads": 20,
                      "num_hidden_layers": 32, "pad_token_id": 1, "projection_dim": 1280, "vocab_size": 49408}),
    "T5-XXL": (t5, {"architectures": ["T5EncoderModel"], "classifier_dropout": 0.0, "d_ff": 10240, "d_kv": 64,
                    "d_model": 4096, "decoder_start_token_id": 0, "dense_act_fn": "gelu_new", "dropout_rate": 0.1,
                    "eos_token_id": 1, "feed_forward_proj": "gated-gelu", "initializer_factor": 1.0,
                    "is_encoder_decoder": True, "is_gated_act": True, "layer_norm_epsilon": 1e-06,
                    "model_type": "t5", "num_decoder_layers": 24, "num_heads": 64, "num_layers": 24,
                    "output_past": True, "pad_token_id": 0, "relative_attention_max_distance": 128,
                    "relative_attention_num_buckets": 32, "tie_word_embeddings": False, "use_cache": True,
                    "vocab_size": 32128}),
    "FLUX.2-dev transformer": (flux2, {**DIFFUSERS, "attention_head_dim": 128, "axes_dims_rope": [32, 32, 32, 32],
                                       "eps": 1e-06, "guidance_embeds": True, "in_channels": 128,
                                       "joint_attention_dim": 15360, "mlp_ratio": 3.0, "num_attention_heads": 48,
                                       "num_layers": 8, "num_single_layers": 48, "out_channels": None,
                                       "patch_size": 1, "rope_theta": 2000, "timestep_guidance_channels": 256}),
    "FLUX.2-klein-4B transformer": (flux2, {**DIFFUSERS, "attention_head_dim": 128, "axes_dims_rope": [32] * 4,
                                            "eps": 1e-06, "guidance_embeds": False, "in_channels": 128,
                                            "joint_attention_dim": 7680, "mlp_ratio": 3.0,
                                            "num_attention_heads": 24, "num_layers": 5, "num_single_layers": 20,
                                            "out_channels": None, "patch_size": 1, "rope_theta": 2000,
                                            "timestep_guidance_channels": 256}),
    "FLUX.2 VAE": (vae_flux2, {**DIFFUSERS, "act_fn": "silu", "batch_norm_eps": 0.0001, "batch_norm_momentum": 0.1,
                               "block_out_channels": [128, 256, 512, 512], "decoder_block_out_channels": None,
                               "down_block_types": ["DownEncoderBlock2D"] * 4, "force_upcast": True,
                               "in_channels": 3, "latent_channels": 32, "layers_per_block": 2,
                               "mid_block_add_attention": True, "norm_num_groups": 32, "out_channels": 3,
                               "patch_size": [2, 2], "sample_size": 1024, "up_block_types": ["UpDecoderBlock2D"] * 4,
                               "use_post_quant_conv": True, "use_quant_conv": True}),
    "Qwen3-4B": (text_llm, {"architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
                            "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
                            "hidden_size": 2560, "initializer_range": 0.02, "intermediate_size": 9728,
                            "layer_types": ["full_attention"] * 36, "max_position_embeddings": 40960,
                            "max_window_layers": 36, "model_type": "qwen3", "num_attention_heads": 32,
                            "num_hidden_layers": 36, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
                            "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None,
                            "tie_word_embeddings": True, "torch_dtype": "bfloat16", "transformers_version": "4.57.0",
                            "use_cache": True, "use_sliding_window": False, "vocab_size": 151936}),
    "Mistral-Small-3.2": (text_llm, {
        "architectures": ["Mistral3ForConditionalGeneration"], "image_token_index": 10, "model_type": "mistral3",
        "multimodal_projector_bias": False, "projector_hidden_act": "gelu", "spatial_merge_size": 2,
        "text_config": {"attention_dropout": 0.0, "head_dim": 128, "hidden_act": "silu", "hidden_size": 5120,
                        "initializer_range": 0.02, "intermediate_size": 32768, "max_position_embeddings": 131072,
                        "model_type": "mistral", "num_attention_heads": 32, "num_hidden_layers": 40,
                        "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 1000000000.0,
                        "sliding_window": None, "use_cache": True, "vocab_size": 131072},
        "torch_dtype": "bfloat16", "vision_config": {"hidden_size": 1024, "model_type": "pixtral"},
        "vision_feature_layer": -1}),
}


REAL_SCHEDULERS = {
    "SD3.5": {"_class_name": "FlowMatchEulerDiscreteScheduler", "_diffusers_version": "0.29.0.dev0",
              "num_train_timesteps": 1000, "shift": 3.0},
    "FLUX.2": {"_class_name": "FlowMatchEulerDiscreteScheduler", "_diffusers_version": "0.36.0.dev0",
               "base_image_seq_len": 256, "base_shift": 0.5, "invert_sigmas": False, "max_image_seq_len": 4096,
               "max_shift": 1.15, "num_train_timesteps": 1000, "shift": 3.0, "shift_terminal": None,
               "stochastic_sampling": False, "time_shift_type": "exponential", "use_beta_sigmas": False,
               "use_dynamic_shifting": True, "use_exponential_sigmas": False, "use_karras_sigmas": False},
}


@pytest.mark.parametrize("name", list(REAL_SCHEDULERS))
def test_real_scheduler_configs_pass(name):
    SchedulerArgs.from_dict(REAL_SCHEDULERS[name], f"{name} scheduler_config.json")


@pytest.mark.parametrize("name", list(REAL))
def test_real_configs_pass(name):
    arch, config = REAL[name]
    args = arch.ModelArgs.from_dict(config, f"{name} config.json")
    if arch is text_llm:
        text_llm.check_config(config, name, taps=True)
    # the keys the class has are read as given (no value changed by the checks)
    for key, value in config.items():
        if hasattr(args, key) and key not in ("text_config", "out_channels", "eos_token_id"):
            got = getattr(args, key)
            assert (list(got) if isinstance(got, tuple) else got) == value, key


def test_the_default_folder_options_pass():
    index = read_json(default_model.FOLDER / MI)
    options = Flux2FolderOptions.from_dict(index, "model_index.json")
    assert (options.is_distilled, options.sample_size, options.max_sequence_length) == (False, 64, 64)
    assert Flux2FolderOptions.from_dict({"_class_name": "Flux2KleinPipeline"}).max_sequence_length == 512


@pytest.mark.parametrize("value, shown", [(True, "true"), (2.5, "2.5"), ("4", '"4"'), (0, "0"), (None, "null")])
def test_int_fields_take_json_integers_only(value, shown):
    """A bool is not an int, nor is a float, a string or null; 0 heads is out of range."""
    with pytest.raises(MlxdiffError) as err:
        flux2.ModelArgs.from_dict({"num_attention_heads": value}, "cfg.json")
    assert str(err.value) == f"cfg.json: num_attention_heads is {shown}; expected an integer 1 to 1024"


def test_unknown_keys_are_ignored_and_rules_see_the_defaults():
    args = vae.ModelArgs.from_dict({"whatever": [1, {"x": None}], "_class_name": 5}, "vae/config.json")
    assert args.block_out_channels == (128, 256, 512, 512)
    # given channels for 2 levels against the default 4 block types: the rule names the key that disagrees
    with pytest.raises(MlxdiffError, match=r"down_block_types is .*; expected one per block_out_channels entry \(2\)"):
        vae.ModelArgs.from_dict({"block_out_channels": [32, 64]}, "vae/config.json")


def test_hub_cache_links_stay_inside_their_repo(tmp_path):
    """A Hugging Face cache snapshot's files are links into the repo's blobs/: inside the model; a link out of the
    repo is not."""
    from mlxdiff.loading.sources import inside
    repo = tmp_path / "models--org--name"
    (repo / "blobs").mkdir(parents=True)
    (repo / "blobs" / "abc").write_text("{}")
    snapshot = repo / "snapshots" / "0123"
    (snapshot / "vae").mkdir(parents=True)
    (snapshot / "vae" / "config.json").symlink_to("../../../blobs/abc")
    assert inside(snapshot, snapshot / "vae" / "config.json", "the vae config") == snapshot / "vae" / "config.json"
    (tmp_path / "elsewhere").write_text("{}")
    (snapshot / "vae" / "other.json").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(MlxdiffError, match="leads outside the model folder"):
        inside(snapshot, snapshot / "vae" / "other.json", "a file")
