"""Bad input, second round (issue 30): the kinds found in what landed after the first round, each refused in one
line (exit 2; Ctrl-C: 130) naming the file, key or value and what to do, with nothing partial left:

1. special files (a FIFO, a character device) where a small file is read: refused before anything opens them;
2. a footprint.json of the wrong types, shapes or depth: its structure checked before `footprint show` uses it;
3. forged metadata in a text-encoder GGUF: typed, bounded reads naming the key (plus the gguf-text fuzzer);
4. a transformer file whose fused projections do not fit its width: refused naming the key and the shape;
5. a tokenizer of the other family (or none) given with --tokenizer: refused when the pipeline is resolved;
6. Ctrl-C in the moment a command ends: one line and 130, or (during the interpreter's shutdown) ignored; a reader
   of the output that goes away (`| head`): the output is dropped, the work goes on;
7. empty or degenerate values: convert's empty DEST, a 0-pixel image, a numpy array as an image;
8. folders written by convert get the umask's mode, not mkdtemp's 0700.

CLI and API cases run in forked children under a timeout and a memory cap (tests/adversarial.py), of one fork
server that the module's tests share."""

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import PIL.Image
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from adversarial import CaseServer  # noqa: E402

from mlxdiff.errors import MlxdiffError  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import fuzz_gguf_text  # noqa: E402  (the GGUF text-encoder writer and base files the fuzzer mutates)
from bad_input_helpers import CHEAP, FAST, MODEL, assert_refused, gen, lines  # noqa: E402


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """One fork server for the module's cases (its imports paid once, not once a test)."""
    cases = CaseServer(tmp_path_factory.mktemp("round2-server"))
    yield cases
    cases.close()


def copy_model(dest) -> Path:
    """The embedded default model copied (its files are never edited in place)."""
    return Path(shutil.copytree(MODEL, dest))


# -- 1. special files -----------------------------------------------------------------------------------------------

def test_special_files_are_refused_before_they_are_opened(server, tmp_path):
    """A FIFO would block open() forever and a character device be read without end: every small file mlxdiff
    reads (input images, the prompts file, footprint.json, a model folder's configs, a tokenizer folder's files)
    and every weights file named on the command line is stat'ed first and refused in one line that says what it
    is."""
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    model = copy_model(tmp_path / "model")
    (model / "transformer" / "config.json").unlink()
    os.mkfifo(model / "transformer" / "config.json")
    tokenizer = Path(shutil.copytree(Path(MODEL) / "tokenizer", tmp_path / "tokenizer"))
    (tokenizer / "tokenizer_config.json").unlink()
    os.mkfifo(tokenizer / "tokenizer_config.json")
    weights_fifo = tmp_path / "transformer.safetensors"
    os.mkfifo(weights_fifo)
    out = tmp_path / "out.png"
    api = f"import mlxdiff\nmlxdiff.load({MODEL!r}).generate('a', steps=1, width=16, height=16, progress_bar=False, "
    cases = {
        "--image FIFO": (gen(out, "--image", str(fifo)), [str(fifo), "a FIFO", "regular file"]),
        "--image /dev/zero": (gen(out, "--image", "/dev/zero"), ["/dev/zero", "a character device"]),
        "--prompts-file FIFO": (gen(out, "--prompts-file", str(fifo)), ["--prompts-file", "a FIFO"]),
        "--prompts-file /dev/urandom": (gen(out, "--prompts-file", "/dev/urandom"), ["a character device"]),
        "footprint show FIFO": ({"cli": "mlxdiff.footprint", "argv": ["show", str(fifo)], "timeout": FAST},
                                [str(fifo), "not a footprint.json", "a FIFO"]),
        "footprint show /dev/zero": ({"cli": "mlxdiff.footprint", "argv": ["show", "/dev/zero"], "timeout": FAST},
                                     ["/dev/zero", "a character device"]),
        "config.json a FIFO": ({"cli": "mlxdiff.generate", "argv": ["--model", str(model), "--steps", "1",
                                                                  "--output", str(out), "--no-progress"],
                                "timeout": FAST}, ["transformer/config.json", "a FIFO"]),
        "tokenizer file a FIFO": (gen(out, "--tokenizer", str(tokenizer)),
                                  ["tokenizer_config.json", "a FIFO", "tokenizer folder"]),
        "API image=FIFO": ({"api": api + f"image={str(fifo)!r})", "timeout": FAST}, [str(fifo), "a FIFO"]),
        "--transformer FIFO": (gen(out, "--transformer", str(weights_fifo)),
                               [str(weights_fifo), "a FIFO", "not a regular file"]),
    }
    outcomes = server.run([case for case, _ in cases.values()])
    for (name, (_, needles)), outcome in zip(cases.items(), outcomes):
        assert_refused(outcome, *needles)
    assert not out.exists()
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)   # nothing replaced it


# -- 2. footprint show -------------------------------------------------------------------------------------------

def _saved(**run):
    base = {"samples": [[0.1, 1000], [0.3, 3000]], "phases": [["encode", 0.0, 0.2], ["denoise", 0.2, 0.4]],
            "stdout": "", "rss_peaks": {"encode": 2000}, "gpu": {}}
    return {"measured": "memory: RSS", "runs": {"mlxdiff": {**base, **run}}}


FOOTPRINTS = {
    "runs a list": ({"runs": []}, "runs is list"),
    "no mlxdiff run": ({"runs": {"other": _saved()["runs"]["mlxdiff"]}}, 'no "mlxdiff" run'),
    "samples a string": (_saved(samples="many"), "runs['mlxdiff'].samples is str"),
    "a sample of three": (_saved(samples=[[0.1, 2, 3]]), "samples[0] is not a [seconds, bytes] pair"),
    "a sample of text": (_saved(samples=[[0.1, "5 GB"]]), "samples[0][1] is str"),
    "a NaN sample": (_saved(samples=[[0.1, float("nan")]]), "samples[0][1] is nan"),
    "an infinite time": ('{"runs": {"mlxdiff": {"samples": [[1e999, 1]], "phases": [], "stdout": ""}}}',
                         "samples[0][0] is inf"),
    "a boolean sample": (_saved(samples=[[0.1, True]]), "samples[0][1] is bool"),
    "a phase of two": (_saved(phases=[["encode", 0.0]]), "phases[0] is not a [name, start, end] triple"),
    "a phase named 5": (_saved(phases=[[5, 0.0, 1.0]]), "phases[0][0]"),
    "stdout a number": (_saved(stdout=5), "runs['mlxdiff'].stdout is int"),
    "gpu without reserved": (_saved(gpu={"denoise": {"allocated": 5}}), "has no 'reserved'"),
    "rss peak a string": (_saved(rss_peaks={"encode": "big"}), "rss_peaks['encode'] is str"),
    "a label with a newline": ({"runs": {**_saved()["runs"], "a\nb": _saved()["runs"]["mlxdiff"]}},
                               "not a one-line name"),
    "nested 100000 deep": ("[" * 100000 + "]" * 100000, "nested too deeply"),
    "nested 40 deep in a key show ignores": ({**_saved(), "summaries": json.loads("[" * 40 + "]" * 40)},
                                             "nested more than 12 levels"),
    "a 5000-digit integer": ('{"runs": ' + "9" * 5000 + "}", "not valid JSON"),
    "not JSON": ("this is not JSON", "not valid JSON"),
}


def test_footprint_show_checks_the_file_it_reads(server, tmp_path, capsys):
    """`footprint show` reads a file the user may have edited or damaged: every structure it uses is checked
    whole first, each mistake one line naming where in the file; a well-formed file still prints its table."""
    from mlxdiff import footprint
    good = tmp_path / "good.json"
    good.write_text(json.dumps(_saved(stdout="no table here")))
    assert footprint.main(["show", str(good)]) == 0
    shown = capsys.readouterr().out.splitlines()
    assert shown[0] == "memory: RSS" and any(line.startswith("| encode |") for line in shown), shown
    cases = []
    for i, (value, _) in enumerate(FOOTPRINTS.values()):
        path = tmp_path / f"case-{i}.json"
        path.write_text(value if isinstance(value, str) else json.dumps(value))
        cases.append({"cli": "mlxdiff.footprint", "argv": ["show", str(path)], "timeout": FAST})
    for (name, (_, needle)), outcome, i in zip(FOOTPRINTS.items(), server.run(cases), range(len(cases))):
        assert_refused(outcome, f"case-{i}.json", "not a footprint.json", needle)


def test_report_peaks_reads_no_size_from_forged_digits():
    """The mlxdiff run's --report-memory table is text in the file: a size such as "1.2.3 MB" or a 400-digit one
    is no size (it used to be a float() traceback), so that row is not read."""
    from mlxdiff import footprint
    from mlxdiff.pipelines.report import MEMORY_COLUMNS
    row = "encode 1.0 " + " ".join(["1.2.3 MB"] + ["9" * 400 + " GB"] + ["1.00 GB"] * (len(MEMORY_COLUMNS) - 2))
    assert footprint.report_peaks(row) == {"mlx": {}, "process": {}}


# -- 3. forged metadata in text-encoder GGUFs -------------------------------------------------------------------

V = fuzz_gguf_text.V


def _forged(tmp_path, kind, edit):
    """The fuzzer's base GGUF of `kind` with `edit` ({key: (type, value, item type) | None to delete}) applied."""
    metadata, tensors = fuzz_gguf_text.base(kind)
    metadata = [(k, *edit[k]) if k in edit and edit[k] is not None else (k, t, v, i)
                for k, t, v, i in metadata if not (k in edit and edit[k] is None)]
    return fuzz_gguf_text.write(tmp_path / f"{kind}-{len(list(tmp_path.iterdir()))}.gguf", metadata, tensors)


GGUF_CASES = [
    ("head count as a string", "mistral", {"llama.attention.head_count": (V.STRING, "4", None)},
     ["llama.attention.head_count", "a string ('4')", "expected an integer"]),
    ("head count as a float", "qwen3", {"qwen3.attention.head_count": (V.FLOAT32, 4.0, None)},
     ["qwen3.attention.head_count", "a float (4.0)"]),
    ("head count as a bool", "mistral", {"llama.attention.head_count": (V.BOOL, True, None)},
     ["llama.attention.head_count", "a boolean (true)"]),
    ("key length as an array", "mistral", {"llama.attention.key_length": (V.ARRAY, [16, 16], V.UINT32)},
     ["llama.attention.key_length", "an array of 2 items"]),
    ("negative context length", "qwen3", {"qwen3.context_length": (V.INT32, -1, None)},
     ["qwen3.context_length is -1", "from 1 up to"]),
    ("rope base as an integer", "mistral", {"llama.rope.freq_base": (V.UINT32, 1000000, None)},
     ["llama.rope.freq_base", "an integer (1000000)", "float32"]),
    ("rope base 1e30", "qwen3", {"qwen3.rope.freq_base": (V.FLOAT32, 1e30, None)},
     ["qwen3.rope.freq_base", "1e+30"]),
    ("rms epsilon 0", "mistral", {"llama.attention.layer_norm_rms_epsilon": (V.FLOAT32, 0.0, None)},
     ["llama.attention.layer_norm_rms_epsilon", "above 0"]),
    ("rms epsilon NaN", "qwen3", {"qwen3.attention.layer_norm_rms_epsilon": (V.FLOAT32, float("nan"), None)},
     ["qwen3.attention.layer_norm_rms_epsilon", "nan"]),
    ("heads not dividing the width", "mistral", {"llama.attention.key_length": None,
                                                 "llama.attention.head_count": (V.UINT32, 3, None)},
     ["llama.attention.head_count is 3", "does not divide q_proj's 64 rows"]),
    ("heads that disagree with the shapes", "mistral", {"llama.attention.head_count": (V.UINT32, 8, None)},
     ["llama.attention.head_count is 8", "are 4"]),
    ("an odd head size", "mistral", {"llama.attention.key_length": (V.UINT32, 7, None)},
     ["head_dim 7", "llama.attention.key_length"]),
    ("a key length off the q norm", "qwen3", {"qwen3.attention.key_length": (V.UINT32, 32, None)},
     ["qwen3.attention.key_length is 32", "q_norm"]),
    ("per-layer heads that differ", "qwen3", {"qwen3.attention.head_count": (V.ARRAY, [4, 2], V.UINT32)},
     ["qwen3.attention.head_count differs between layers"]),
    ("the other family's architecture", "mistral", {"general.architecture": (V.STRING, "qwen3", None)},
     ["general.architecture is 'qwen3'", "Mistral"]),
    ("no rope base", "mistral", {"llama.rope.freq_base": None}, ["has no llama.rope.freq_base"]),
    ("context length 2^64-1", "mistral", {"llama.context_length": (V.UINT64, 2 ** 64 - 1, None)},
     ["llama.context_length is 18446744073709551615"]),
]


@pytest.mark.parametrize("name,kind,edit,needles", GGUF_CASES, ids=[c[0] for c in GGUF_CASES])
def test_forged_gguf_metadata_is_one_line_naming_the_key(tmp_path, name, kind, edit, needles):
    """A text-encoder GGUF's hyperparameters read as llama.cpp types them and within a config's limits: a value of
    the wrong type, out of range, or not what the tensors say is one line naming the file and the key (it used to
    reach float()/int() or the arithmetic, or be coerced: True heads, 32.0 heads)."""
    from mlxdiff.loading.sources import text_encoder_from_file
    path = _forged(tmp_path, kind, edit)
    with pytest.raises(MlxdiffError) as e:
        text_encoder_from_file(path, (1, 2))
    message = str(e.value)
    assert "\n" not in message and message.startswith(f"{path}: "), message
    for needle in needles:
        assert needle in message, (needle, message)


def test_valid_gguf_metadata_reads_as_written(tmp_path):
    """The control: the unforged files, one with per-layer head counts (as llama.cpp also writes them), give the
    config their metadata says; a Mistral is read with llama.cpp's q/k order undone, a Qwen3 as written."""
    from mlxdiff.loading.sources import text_encoder_from_file
    mistral = text_encoder_from_file(_forged(tmp_path, "mistral", {}), (1, 2))
    text = mistral.args.text_config
    assert (text["head_dim"], text["num_attention_heads"], text["num_key_value_heads"]) == (16, 4, 2)
    assert (text["rope_theta"], text["max_position_embeddings"]) == (1e6, 128) and mistral.keymap is not None
    assert abs(text["rms_norm_eps"] - 1e-5) < 1e-12
    per_layer = {"qwen3.attention.head_count": (V.ARRAY, [4, 4], V.UINT32)}
    qwen = text_encoder_from_file(_forged(tmp_path, "qwen3", per_layer), (1, 2))
    assert qwen.args.text_config["num_attention_heads"] == 4 and qwen.keymap is None


def test_forged_gguf_on_the_command_line(server, tmp_path):
    """The same through generate --text-encoder: exit 2, one line naming the file and the key, no image."""
    path = _forged(tmp_path, "qwen3", {"qwen3.attention.head_count_kv": (V.STRING, "2", None)})
    out = tmp_path / "out.png"
    (outcome,) = server.run([gen(out, "--text-encoder", str(path))])
    assert_refused(outcome, str(path), "qwen3.attention.head_count_kv")
    assert not out.exists()


def test_gguf_text_fuzzer_finds_nothing_unacceptable(tmp_path):
    """bench/fuzz_readers.py --format gguf-text: 150 metadata mutants (the bench run has the rest), each refused in
    one line naming a key that gguf-py's reading (with the rules written out in bench/fuzz_gguf_text.py) finds bad,
    or loaded with the config the reference derives and run to a finite output; both outcomes reached (the same
    shares as 300 mutants gave: over half refused, over a tenth loaded)."""
    out = tmp_path / "result.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "fuzz_readers.py"), "--format", "gguf-text", "--n",
                           "150", "--seed", "13", "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert out.exists(), f"rc {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    result = json.loads(out.read_text())
    assert result["n"] == 150 and result["unacceptable"] == 0, proc.stdout[-6000:]
    assert result["counts"].get("refused (reference refuses too)", 0) > 75, result["counts"]
    assert result["counts"].get("loaded = reference", 0) > 15, result["counts"]


# -- 4. fused projections against the width ----------------------------------------------------------------------

def header_only_safetensors(path, shapes):
    """A safetensors file of these shapes whose data is a hole (only shapes matter before anything is read)."""
    import struct
    header, offset = {}, 0
    for name, shape in shapes.items():
        n = int(np.prod(shape)) * 2
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        f.truncate(8 + len(text) + offset)
    return path


D, M = 192, 576   # klein-shapes' width and MLP width (mlp_ratio 3)
FLUX2 = {"img_in.weight": (D, 32), "txt_in.weight": (D, 192), "time_in.in_layer.weight": (D, 64),
         "time_in.out_layer.weight": (D, D), "double_blocks.0.img_attn.norm.query_norm.scale": (32,),
         "double_blocks.0.img_mlp.0.weight": (2 * M, D), "final_layer.linear.weight": (32, D),
         "double_blocks.0.img_attn.qkv.weight": (3 * D, D), "double_blocks.0.txt_attn.qkv.weight": (3 * D, D),
         "single_blocks.0.norm.query_norm.scale": (32,), "single_blocks.0.linear1.weight": (3 * D + 2 * M, D),
         "single_blocks.0.linear2.weight": (D, D + M)}
FUSED = {"img qkv rows": ("double_blocks.0.img_attn.qkv.weight", (3 * D + 3, D), [3 * D, D]),
         "txt qkv rows": ("double_blocks.0.txt_attn.qkv.weight", (3 * D - 6, D), [3 * D, D]),
         "linear1 rows": ("single_blocks.0.linear1.weight", (3 * D + 2 * M - 1, D), [3 * D + 2 * M, D]),
         "linear2 columns": ("single_blocks.0.linear2.weight", (D, D + M + 2), [D, D + M]),
         "final modulation rows": ("final_layer.adaLN_modulation.1.weight", (2 * D + 1, D), [2 * D, D])}


def test_fused_projections_must_fit_the_width(server, tmp_path):
    """BFL's fused qkv (3 x D rows) and single-block linear1 (3 x D + 2 x M rows) / linear2 (D + M columns) are
    split at offsets the config sets: a file whose rows do not fit is refused when its config is read (it used to
    fail deep in the row split), one line naming the key and the expected shape; SD3.5's qkv likewise."""
    out = tmp_path / "out.png"
    cases, files = [], []
    for i, (key, shape, _) in enumerate(FUSED.values()):
        files.append(header_only_safetensors(tmp_path / f"flux2-{i}.safetensors",
                                             {"model.diffusion_model." + k: v for k, v in {**FLUX2, key: shape}.items()}))
        cases.append(gen(out, "--transformer", str(files[-1])))
    for (name, (key, _, expected)), outcome, path in zip(FUSED.items(), server.run(cases), files):
        assert_refused(outcome, str(path), repr(key), f"expected {expected}")
    assert not out.exists()

    from mlxdiff.loading.sources import transformer_from_file
    from mlxdiff.models import mmdit
    d = 64
    sd3 = {"x_embedder.proj.weight": (d, 16, 2, 2), "context_embedder.weight": (d, 32), "pos_embed": (1, 64, d),
           "y_embedder.mlp.0.weight": (d, 48), "final_layer.linear.weight": (64, d),
           "final_layer.adaLN_modulation.1.weight": (2 * d, d), "joint_blocks.0.x_block.attn.qkv.weight": (3 * d, d),
           "joint_blocks.0.context_block.adaLN_modulation.1.weight": (2 * d, d)}
    for key, shape, expected in (("joint_blocks.0.x_block.attn.qkv.weight", (3 * d + 2, d), [3 * d, d]),
                                 ("joint_blocks.0.context_block.attn.qkv.bias", (3 * d - 1,), [3 * d]),
                                 ("joint_blocks.0.context_block.adaLN_modulation.1.weight", (2 * d + 1, d),
                                  [2 * d, d])):
        path = header_only_safetensors(tmp_path / "sd3.safetensors", {**sd3, key: shape})
        with pytest.raises(MlxdiffError) as e:
            transformer_from_file(path, mmdit)
        message = str(e.value)
        assert "\n" not in message and str(path) in message and repr(key) in message, message
        assert f"expected {expected}" in message, message
    header_only_safetensors(tmp_path / "sd3.safetensors", sd3)
    assert transformer_from_file(tmp_path / "sd3.safetensors", mmdit).config["num_attention_heads"] == 1


# -- 5. a tokenizer of the other family --------------------------------------------------------------------------

def test_tokenizer_of_another_family_is_refused(server, tmp_path):
    """--tokenizer DIR for klein's Qwen3 encoder: a Mistral chat tokenizer (FLUX.2-dev's family) or a CLIP one is
    refused when the pipeline is resolved, naming the folder, what it is and what to give (it used to fail inside
    the chat template, or feed the encoder another vocabulary's ids); the model's own folder still loads."""
    from twins import MISTRAL_TEMPLATE, build_tokenizer
    from mlxdiff.tokenizers import bundled_clip_tokenizer, check_chat_family, load_chat_tokenizer
    mistral = build_tokenizer(tmp_path / "mistral-tokenizer", ["<unk>", "<s>", "</s>", "[INST]", "[/INST]",
                                                                "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "<pad>"],
                              MISTRAL_TEMPLATE, "left", "<pad>", "<s>", "</s>", add_bos=True)
    clip = tmp_path / "clip-tokenizer"
    bundled_clip_tokenizer("<|endoftext|>").save_pretrained(str(clip))
    out = tmp_path / "out.png"
    cases = {"Mistral for Qwen3": (gen(out, "--tokenizer", str(mistral)),
                                   [str(mistral), "a Mistral tokenizer", "Qwen3", "--tokenizer DIR"]),
             "CLIP for Qwen3": (gen(out, "--tokenizer", str(clip)), [str(clip), "not an LLM text encoder's chat tokenizer"])}
    for (needles, outcome) in zip([n for _, n in cases.values()], server.run([c for c, _ in cases.values()])):
        assert_refused(outcome, *needles)
    assert not out.exists()
    own = load_chat_tokenizer(Path(MODEL) / "tokenizer", "qwen3", "the encoder")   # passes
    with pytest.raises(MlxdiffError) as e:   # and the other way round: a Qwen3 tokenizer for a Mistral encoder
        check_chat_family(own, "mistral3", "qwen-folder", "mistral.safetensors")
    assert "a Qwen3 tokenizer" in str(e.value) and "FLUX.2-dev's" in str(e.value)


# -- 6. Ctrl-C as a command ends -----------------------------------------------------------------------------------

def test_ctrl_c_as_the_command_ends(server, tmp_path):
    """A Ctrl-C while the finished command flushes its output is one line and 130 that says the work was done
    (the image is whole); one during the rename that ends a conversion says the folder was written whole; one during
    the interpreter's shutdown (an atexit hook) is ignored: exit 0, no traceback."""
    out = tmp_path / "flushed.png"
    cut_flush = (f"import os, signal, sys\nclass Cut:\n    def __init__(self, f):\n        self.f, self.armed = f, True\n"
                 f"    def write(self, s):\n        return self.f.write(s)\n    def flush(self):\n        self.f.flush()\n"
                 f"        if self.armed and os.path.exists({str(out)!r}):\n            self.armed = False\n"
                 f"            signal.raise_signal(signal.SIGINT)\n    def __getattr__(self, name):\n"
                 f"        return getattr(self.f, name)\nsys.stdout = Cut(sys.stdout)\n")
    dest = tmp_path / "renamed-native"
    cut_rename = ("import signal, pathlib\nrename = pathlib.Path.rename\ndef cut(self, target):\n"
                  "    done = rename(self, target)\n    signal.raise_signal(signal.SIGINT)\n    return done\n"
                  "pathlib.Path.rename = cut\n")
    run = "import importlib, os, sys\nrc = importlib.import_module({0!r}).main({1!r})\nos._exit(rc)\n"
    cases = [{"api": cut_flush + run.format("mlxdiff.generate", CHEAP + ["--output", str(out)])},
             {"api": cut_rename + run.format("mlxdiff.convert", [MODEL, str(dest)])}]
    flushed, renamed = server.run(cases)
    for outcome, needle in ((flushed, "its work was done (1 image written)"), (renamed, f"{dest} was written whole")):
        assert outcome.rc == 130 and len(lines(outcome)) == 1, outcome.describe()
        assert lines(outcome)[0].startswith("mlxdiff: interrupted") and needle in lines(outcome)[0], \
            outcome.describe()
        assert "Traceback" not in outcome.stderr
    assert PIL.Image.open(out).size == (16, 16)
    assert (dest / "model_index.json").is_file() and not list(tmp_path.glob(".renamed-native.partial-*"))

    late = tmp_path / "late.png"
    code = ("import atexit, runpy, signal, sys\nsignal.signal(signal.SIGINT, signal.default_int_handler)\n"
            "atexit.register(signal.raise_signal, signal.SIGINT)\n"
            f"sys.argv = ['generate'] + {CHEAP + ['--output', str(late)]!r}\n"
            "runpy.run_module('mlxdiff.generate', run_name='__main__', alter_sys=True)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr, \
        (proc.returncode, proc.stderr[-3000:])
    assert PIL.Image.open(late).size == (16, 16)


def test_a_reader_that_goes_away(tmp_path):
    """`mlxdiff.generate ... | head -c 10`: once the reader of stdout (or stderr) has gone, what the command prints is
    dropped and the work goes on: the image is written whole, exit 0, no BrokenPipeError traceback."""
    for stream in ("stdout", "stderr"):
        out = tmp_path / f"{stream}.png"
        argv = [sys.executable, "-m", "mlxdiff.generate", *CHEAP, "--output", str(out)]
        read, write = os.pipe()
        os.close(read)   # nobody reads: the first write of the stream meets a broken pipe
        pipes = {"stdout": write, "stderr": subprocess.PIPE} if stream == "stdout" else \
            {"stdout": subprocess.PIPE, "stderr": write}
        proc = subprocess.run(argv, cwd=ROOT, timeout=300, text=True, **pipes)
        os.close(write)
        other = proc.stderr if stream == "stdout" else proc.stdout
        assert proc.returncode == 0, (stream, proc.returncode, other[-2000:])
        assert "Traceback" not in (other or "") and "BrokenPipe" not in (other or ""), other[-2000:]
        assert PIL.Image.open(out).size == (16, 16)


# -- 7. empty or degenerate values ---------------------------------------------------------------------------------

def test_empty_and_degenerate_values(server, tmp_path):
    """convert's DEST "" (it named the weights store itself), a 0x0 or 0xN PIL image for img2img, and a numpy
    array given as an image (its repr spanned lines) are each one line; nothing is written."""
    store = tmp_path / "store"
    api = ("import numpy as np, PIL.Image, mlxdiff\n"
           f"pipe = mlxdiff.load({MODEL!r})\nKW = dict(steps=1, width=64, height=64, progress_bar=False)\n")
    cases = {
        "convert DEST ''": ({"cli": "mlxdiff.convert", "argv": [MODEL, ""], "env": {"MLXDIFF_WEIGHTS": str(store)}},
                            ["DEST ''", "names no new folder"]),
        "convert DEST '.'": ({"cli": "mlxdiff.convert", "argv": [MODEL, "."], "env": {"MLXDIFF_WEIGHTS": str(store)}},
                             ["DEST '.'"]),
        "0x0 image": ({"api": api + "pipe.generate('a', image=PIL.Image.new('RGB', (0, 0)), strength=0.5, **KW)"},
                      ["has no pixels (0x0)"]),
        "0x16 image": ({"api": api + "pipe.generate('a', image=PIL.Image.new('RGB', (0, 16)), strength=0.5, **KW)"},
                       ["has no pixels (0x16)"]),
        "numpy image": ({"api": api + "pipe.generate('a', image=np.zeros((64, 64, 3), np.uint8), **KW)"},
                        ["image=<numpy.ndarray of shape (64, 64, 3), uint8>", "PIL.Image.fromarray"]),
        "numpy images": ({"api": api + "pipe.generate('a', image=[np.zeros((8, 8))], **KW)"},
                         ["numpy.ndarray of shape (8, 8)"]),
        "numpy steps": ({"api": api + "pipe.generate('a', steps=np.arange(12), width=64, height=64)"},
                        ["steps=<numpy.ndarray of shape (12,)"]),
    }
    for (name, (_, needles)), outcome in zip(cases.items(), server.run([c for c, _ in cases.values()])):
        assert_refused(outcome, *needles)
    assert not store.exists()


# -- 8. the mode of converted folders ------------------------------------------------------------------------------

def test_converted_folder_has_the_umask_mode(tmp_path):
    """A converted folder is made under a temporary name (tempfile.mkdtemp: 0700) and renamed; it gets the mode
    a mkdir would give it, 0777 & ~umask, as its sub-folders do."""
    from mlxdiff.convert import convert
    old = os.umask(0o027)
    try:
        dest = convert(MODEL, tmp_path / "klein-native", progress=lambda *_: None)
    finally:
        os.umask(old)
    assert stat.S_IMODE(dest.stat().st_mode) == 0o750
    assert stat.S_IMODE((dest / "transformer").stat().st_mode) == 0o750
    assert stat.S_IMODE((dest / "model_index.json").stat().st_mode) == 0o640
