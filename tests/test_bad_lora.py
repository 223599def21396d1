"""Bad LoRA files, second round (issue 30), on the embedded default model (weights/klein-shapes): each run through
`mlxdiff.generate --lora FILE` in a forked child (tests/adversarial.py) must end as a user mistake ends (exit 2,
one `mlxdiff: error:` line naming the file and the key, no image, no traceback, no hang):

- non-finite numbers: NaN / inf in lora_A, lora_B, lora_down, lora_up or an .alpha tensor, a NaN lora_alpha in the
  metadata, an alpha whose scale makes the weight change overflow float32, float32 factors beyond float16's range
  under --dtype float16;
- one layer named twice in one file: diffusers/PEFT and kohya names, BFL and diffusers names, bare and prefixed;
- malformed metadata: PEFT's lora_adapter_metadata of the wrong shape or types, ranks or layers that disagree with
  the tensors, patterns that are not patterns (or take exponential time), .alpha tensors of the wrong shape or
  dtype, alpha given both ways;
- --lora naming a character device, a FIFO or a .gguf file: what it is, in one line.

And valid files still load with the same numbers: a PEFT file (rank_pattern, alpha_pattern, rsLoRA), its kohya and
BFL forms, each giving exactly the weight change diffusers' own loading gives (tests/lora_helpers.py).
"""

import copy
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
import lora_helpers as H  # noqa: E402
from adversarial import refused, run_cases  # noqa: E402

from mlxdiff import default_model  # noqa: E402

MODEL = str(default_model.FOLDER)
CHEAP = ["--model", MODEL, "--prompt", "a red circle", "--steps", "1", "--width", "16", "--height", "16",
         "--no-progress"]
Q = "transformer.transformer_blocks.0.attn.to_q"
KQKV = "lora_unet_double_blocks_0_img_attn_qkv"
L1 = "single_transformer_blocks.0.attn.to_qkv_mlp_proj"
BQKV = "double_blocks.0.img_attn.qkv"


@pytest.fixture(scope="module")
def base():
    cfg = H.shapes_config()
    model = H.twin(cfg)
    shapes = H.linear_shapes(model)
    layers = H.targeted(shapes)
    return model, shapes, layers, H.shared_a(H.peft_tensors(shapes, layers, seed=30))


def _bad_files(root, base):
    """name -> (file, what the one line must say besides the file's name)."""
    _, shapes, layers, t = base
    config = H.peft_config()
    kohya = H.to_kohya(t, 8.0)
    bfl = H.to_bfl(t)
    small = {k: v for k, v in t.items() if k.startswith(Q + ".")}
    small_config = H.peft_config(targets=["transformer_blocks.0.attn.to_q"])
    files = {}

    def peft(name, tensors=t, cfg=config, needle=""):
        files[name] = (H.peft_file(root / f"{len(files)}.safetensors", tensors, cfg), needle)

    def raw(name, tensors, needle, metadata=None):
        files[name] = (H.save(root / f"{len(files)}.safetensors", tensors, metadata), needle)

    def edited(tensors, key, fn):
        out = dict(tensors)
        out[key] = fn(np.array(tensors[key]))
        return out

    def meta(text):
        return {"format": "pt", "lora_adapter_metadata": text}

    def at(value, index=(0, 0)):
        def put(a):
            a[index] = value
            return a
        return put

    # 1. non-finite numbers
    peft("NaN in lora_B", edited(t, f"{Q}.lora_B.weight", at(np.nan)), needle=f"{Q}.lora_B.weight")
    peft("inf in lora_A", edited(t, f"{Q}.lora_A.weight", at(np.inf)), needle=f"{Q}.lora_A.weight")
    raw("-inf in lora_down", edited(kohya, f"{KQKV}.lora_down.weight", at(-np.inf)), f"{KQKV}.lora_down.weight")
    raw("NaN in lora_up", edited(kohya, f"{KQKV}.lora_up.weight", at(np.nan, (3, 1))), f"{KQKV}.lora_up.weight")
    raw("NaN in a fused lora_up's last part", edited(kohya, f"{KQKV}.lora_up.weight", at(np.nan, (-1, 2))),
        f"{KQKV}.lora_up.weight")
    raw("inf .alpha", edited(kohya, f"{KQKV}.alpha", lambda a: np.array(np.inf, np.float32)), f"{KQKV}.alpha")
    raw("NaN lora_alpha in the metadata", small, "transformer.lora_alpha = nan",
        meta(H.packed({**small_config, "lora_alpha": float("nan")})))
    peft("alpha whose scale overflows", cfg={**config, "lora_alpha": 1e300}, needle="beyond float32's range")
    peft("alpha beyond float16", cfg={**config, "lora_alpha": 1e7})
    raw("zero .alpha", edited(kohya, f"{KQKV}.alpha", lambda a: np.array(0.0, np.float32)),
        (f"{KQKV}.alpha", "not a positive number"))
    # (a layer of a block this model does not have, in original names the model's rules map: no traceback)
    k7 = "lora_unet_double_blocks_7_img_attn_qkv"
    raw("kohya layer of a missing block", {**kohya, f"{k7}.lora_down.weight": kohya[f"{KQKV}.lora_down.weight"],
                                           f"{k7}.lora_up.weight": kohya[f"{KQKV}.lora_up.weight"]},
        (f"'{k7}.lora_down.weight'", "has no layer 'double_blocks_7_img_attn_qkv'"))
    b7 = "diffusion_model.double_blocks.7.img_attn.qkv"
    raw("BFL layer of a missing block", {**bfl, f"{b7}.lora_A.weight": bfl[f"diffusion_model.{BQKV}.lora_A.weight"],
                                         f"{b7}.lora_B.weight": bfl[f"diffusion_model.{BQKV}.lora_B.weight"]},
        (f"'{b7}.lora_A.weight'", "has no layer 'double_blocks.7.img_attn.qkv'"))
    # 2. one layer named twice
    raw("PEFT and kohya names", {**small, f"{KQKV}.lora_down.weight": kohya[f"{KQKV}.lora_down.weight"],
                                 f"{KQKV}.lora_up.weight": kohya[f"{KQKV}.lora_up.weight"]},
        (f"'{Q}.lora_A.weight'", f"'{KQKV}.lora_down.weight'", "are both LoRAs of layer"))
    raw("BFL and diffusers names", {**bfl, f"transformer.{L1}.lora_A.weight": t[f"transformer.{L1}.lora_A.weight"],
                                    f"transformer.{L1}.lora_B.weight": t[f"transformer.{L1}.lora_B.weight"]},
        ("'diffusion_model.single_blocks.0.linear1.lora_A.weight'", f"'transformer.{L1}.lora_A.weight'",
         "one layer named twice"))
    bare = "transformer_blocks.0.attn.to_q"
    raw("bare and prefixed names", {**small, f"{bare}.lora_A.weight": small[f"{Q}.lora_A.weight"],
                                    f"{bare}.lora_B.weight": small[f"{Q}.lora_B.weight"]},
        (f"'{Q}.lora_", "'transformer_blocks.0.attn.to_q.lora_", "in two namings"))
    raw("prefixed and bare names of two layers",
        {**small, **{f"transformer_blocks.1.attn.to_q.lora_{r}.weight":
                     t[f"transformer.transformer_blocks.1.attn.to_q.lora_{r}.weight"] for r in "AB"}},
        "names its transformer LoRA layers two ways")
    # 3. malformed metadata
    peft("metadata r of another rank", cfg={**config, "r": 8}, needle="says rank 8")
    peft("metadata r a string", cfg={**config, "r": "4"}, needle="transformer.r = '4'")
    peft("metadata lora_alpha a string", cfg={**config, "lora_alpha": "8"}, needle="transformer.lora_alpha")
    peft("metadata alpha_pattern a list", cfg={**config, "alpha_pattern": [["to_q", 4]]},
         needle="transformer.alpha_pattern")
    peft("metadata alpha_pattern of strings", cfg={**config, "alpha_pattern": {"to_q": "4"}},
         needle="transformer.alpha_pattern")
    peft("metadata rank_pattern not a pattern", cfg={**config, "rank_pattern": {"to_q(": 4}}, needle="not a pattern")
    peft("metadata pattern of exponential time", cfg={**config, "alpha_pattern": {"(t+)+x": 4}},
         needle="a repeat inside a repeat")
    peft("metadata use_rslora a string", cfg={**config, "use_rslora": "yes"}, needle="transformer.use_rslora")
    peft("metadata target_modules a number", cfg={**config, "target_modules": 5}, needle="transformer.target_modules")
    peft("metadata target_modules short of the tensors", cfg={**config, "target_modules": H.TARGETS[1:]},
         needle="which its lora_adapter_metadata does not name")
    peft("metadata target_modules beyond the tensors", cfg={**config, "target_modules": H.TARGETS + ["proj_out"]},
         needle="for which the file has no tensors")
    peft("metadata init that changes the base", cfg={**config, "init_lora_weights": "pissa"},
         needle="transformer.init_lora_weights")
    raw("metadata a list", small, "not a JSON object", meta("[4, 8]"))
    raw("metadata not JSON", small, "not valid JSON", meta('{"transformer.r": 4'))
    raw("metadata for another component", small, "no 'transformer.' entries",
        meta(H.packed(small_config, "text_encoder")))
    raw(".alpha of two numbers", edited(kohya, f"{KQKV}.alpha", lambda a: np.array([8.0, 8.0], np.float32)),
        "must be one number, got shape (2,)")
    raw(".alpha of bools", edited(kohya, f"{KQKV}.alpha", lambda a: np.array(True)), "is BOOL; an alpha is one number")
    raw(".alpha and metadata", {**small, f"{Q}.alpha": np.array(4.0, np.float32)}, "keep one",
        meta(H.packed(small_config)))
    import torch
    raw("float8 factors", {k: torch.from_numpy(v).to(torch.float8_e4m3fn) if k.endswith("lora_A.weight") else v
                           for k, v in small.items()}, "is F8_E4M3; LoRA factors are float32, float16 or bfloat16")
    return files


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory, base):
    tmp = tmp_path_factory.mktemp("bad-lora")
    files = _bad_files(tmp, base)
    fifo = tmp / "fifo.safetensors"
    os.mkfifo(fifo)
    (tmp / "style.gguf").write_bytes(b"GGUF" + b"\0" * 60)
    files["a character device"] = ("/dev/null", "/dev/null: is a character device, not a regular file")
    files["a FIFO"] = (str(fifo), "is a FIFO (named pipe), not a regular file")
    files["a GGUF file"] = (str(tmp / "style.gguf"), "expected a .safetensors LoRA file")
    cases = [{"cli": "mlxdiff.generate", "argv": [*CHEAP, "--lora", str(f), "--output", str(tmp / f"{i}.png")]}
             for i, (f, _) in enumerate(files.values())]
    for dtype in ("float16", "float32"):
        cases.append({"cli": "mlxdiff.generate", "argv": [*CHEAP, "--dtype", dtype, "--lora",
                                                          str(files["alpha beyond float16"][0]),
                                                          "--output", str(tmp / f"{dtype}.png")]})
    results = dict(zip([*files, "float16", "float32"], run_cases(cases, tmp)))
    return tmp, files, results


KINDS = ["NaN in lora_B", "inf in lora_A", "-inf in lora_down", "NaN in lora_up", "NaN in a fused lora_up's last part",
         "inf .alpha", "zero .alpha", "kohya layer of a missing block", "BFL layer of a missing block",
         "NaN lora_alpha in the metadata", "alpha whose scale overflows",
         "PEFT and kohya names", "BFL and diffusers names", "bare and prefixed names",
         "prefixed and bare names of two layers", "float8 factors",
         "metadata r of another rank", "metadata r a string", "metadata lora_alpha a string",
         "metadata alpha_pattern a list", "metadata alpha_pattern of strings", "metadata rank_pattern not a pattern",
         "metadata pattern of exponential time", "metadata use_rslora a string", "metadata target_modules a number",
         "metadata target_modules short of the tensors", "metadata target_modules beyond the tensors",
         "metadata init that changes the base", "metadata a list", "metadata not JSON",
         "metadata for another component", ".alpha of two numbers", ".alpha of bools", ".alpha and metadata",
         "a character device", "a FIFO", "a GGUF file"]


@pytest.mark.parametrize("name", KINDS)
def test_bad_lora_is_refused_in_one_line(outcomes, name):
    tmp, files, results = outcomes
    file, needle = files[name]
    outcome = results[name]
    assert refused(outcome), outcome.describe()
    line = outcome.stderr.strip()
    assert line.startswith(f"mlxdiff: error: {file}:"), line
    for n in (needle,) if isinstance(needle, str) else needle:
        assert n in line, (n, line)
    if name == "a GGUF file":   # the file-type message names only what loads
        assert "gguf LoRA" not in line and ".gguf or" not in line and "or .gguf" not in line, line
    assert not (tmp / f"{list(files).index(name)}.png").exists(), "an image was written"


def test_float16_overflow_is_refused(outcomes):
    """An alpha whose weight change float32 holds but float16 does not: drawn under --dtype float32, refused in one
    line under --dtype float16 (not drawn black)."""
    tmp, files, results = outcomes
    assert results["float32"].rc == 0 and (tmp / "float32.png").exists(), results["float32"].describe()
    outcome = results["float16"]
    assert refused(outcome), outcome.describe()
    assert outcome.stderr.startswith(f"mlxdiff: error: {files['alpha beyond float16'][0]}: layer "), outcome.stderr
    assert "beyond float16's range" in outcome.stderr, outcome.stderr
    assert not (tmp / "float16.png").exists()


def test_float16_range_of_factors(tmp_path, base):
    """float32 factors beyond float16's range: refused when applied in float16 (one MlxdiffError), applied in
    float32; the model is left as it was."""
    import mlx.core as mx
    from mlxdiff import lora
    from mlxdiff.errors import MlxdiffError
    from mlxdiff.models import flux2
    _, _, _, t = base
    small = {k: v for k, v in t.items() if k.startswith(Q + ".")}
    small[f"{Q}.lora_B.weight"] = small[f"{Q}.lora_B.weight"] * 1e6
    path = H.save(tmp_path / "big.safetensors", small)
    model = flux2.Model(flux2.ModelArgs.from_dict(H.shapes_config()))
    model.compute_dtype = mx.float16     # as a float16 build sets it (loading/build.py)
    with pytest.raises(MlxdiffError, match=r"lora_B.weight' has values beyond float16's range"):
        lora.apply_loras(model, flux2, [(path, 1.0)])
    assert not any(isinstance(m, lora.LoRALinear) for _, m in model.named_modules())
    model.compute_dtype = mx.float32
    lora.apply_loras(model, flux2, [(path, 1.0)])
    assert sum(isinstance(m, lora.LoRALinear) for _, m in model.named_modules()) == 1


def test_api_refuses_as_the_cli(outcomes):
    """mlxdiff.load(loras=...) raises the CLI's message as MlxdiffError."""
    import mlxdiff
    from mlxdiff.errors import MlxdiffError
    _, files, results = outcomes
    for name in ("NaN in lora_B", "PEFT and kohya names", "metadata alpha_pattern a list", "a character device"):
        with pytest.raises(MlxdiffError) as e:
            mlxdiff.load(MODEL, loras=[files[name][0]])
        assert f"mlxdiff: error: {e.value}" == results[name].stderr.strip()


@pytest.mark.parametrize("form", ["peft", "peft patterns", "peft rslora", "kohya", "bfl", "no metadata"])
def test_valid_lora_gives_diffusers_weight_change(tmp_path, base, form):
    """A valid file still loads, with the numbers diffusers' own loading gives: every layer's scale x B @ A within
    1e-5 of diffusers' (float32 factors)."""
    model, shapes, layers, t = base
    path = tmp_path / "lora.safetensors"
    if form == "peft":
        H.peft_file(path, t, H.peft_config())
    elif form == "peft patterns":   # PEFT's own per-layer ranks and alphas, matched as PEFT matches them
        ranks = {layer: 2 for layer in layers if layer.endswith("ff.linear_in")}
        tensors = H.peft_tensors(shapes, layers, seed=31, ranks=ranks)
        H.peft_file(path, tensors, H.peft_config(rank_pattern={"ff.linear_in": 2},
                                                 alpha_pattern={r"transformer_blocks\.1\..*": 3, "to_k": 16.0}))
    elif form == "peft rslora":
        H.peft_file(path, t, H.peft_config(alpha=6, use_rslora=True))
    elif form == "kohya":
        H.save(path, H.to_kohya(t, 6.0))
    elif form == "bfl":
        H.save(path, H.to_bfl(t, {layer: 0.5 for layer in layers}))
    else:
        H.peft_file(path, t, None)
    ours = H.ours_delta(path)
    ref = H.diffusers_delta(path, copy.deepcopy(model))
    assert len(ref) == len(layers)
    assert H.same_delta(ours, ref) is None, H.same_delta(ours, ref)
    assert all(np.abs(d).max() > 0 for d in ours.values())


def test_every_bad_file_is_checked(outcomes):
    """Each file the fixture writes is asserted on by one of the tests above."""
    _, files, _ = outcomes
    assert set(files) == set(KINDS) | {"alpha beyond float16"}
