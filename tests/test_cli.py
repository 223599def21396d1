"""The CLI: a successful run writes a PNG with metadata; several images in one command (prompts file x seeds) are
each the image its single run draws; each user mistake is one line, exit code 2, no PNG. The real process's exit
code and line are checked where the mistake is caught before a model loads (test_missing_*, test_unwritable_output);
mistakes found while loading the tiny SD3 folder run main in this process (the same code from argv to exit code)."""

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

import mlxdiff
from mlxdiff.generate import main


def run_cli(*args, cwd=None):
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    return subprocess.run([sys.executable, "-m", "mlxdiff.generate", "--no-progress", *args], capture_output=True,
                          text=True, cwd=cwd, env=env, timeout=300)


def run_in_process(capfd, *args):
    """mlxdiff.generate's main in this process (no interpreter start-up, no second import of MLX and the family's
    modules), as run_cli's result: its exit code and what reached the stdout / stderr file descriptors (capfd: lines
    written below Python too). The real process's exit code and its one line are run_cli's tests' (test_missing_*)."""
    from types import SimpleNamespace
    code = main(["--no-progress", *args])
    out, err = capfd.readouterr()
    return SimpleNamespace(returncode=code, stdout=out, stderr=err)


def assert_clean_failure(proc, out_path, *needles):
    assert proc.returncode == 2, proc.stderr
    lines = [l for l in proc.stderr.strip().splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("mlxdiff: error:"), proc.stderr
    assert "Traceback" not in proc.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])
    assert not os.path.exists(out_path)
    parent = os.path.dirname(out_path) or "."
    if os.path.isdir(parent):
        assert not [p for p in os.listdir(parent) if p.startswith(".mlxdiff-")]


def test_generate_writes_png_with_metadata(sd3_tiny, tmp_path):
    folder, _ = sd3_tiny
    out = tmp_path / "img.png"
    proc = run_cli("--model", str(folder), "--prompt", "a cat", "--width", "24", "--height", "40", "--steps", "2",
                   "--guidance", "3", "--seed", "5", "--output", str(out))
    assert proc.returncode == 0, proc.stderr
    img = Image.open(out)
    assert img.size == (24, 40)
    assert img.text["mlxdiff:prompt"] == "a cat" and img.text["mlxdiff:seed"] == "5"
    assert "encode" in proc.stdout and "denoise" in proc.stdout and "decode" in proc.stdout


def _copy(folder, tmp_path):
    dst = tmp_path / "model"
    shutil.copytree(folder, dst)
    return dst


def _transformer_file(model):
    return next((model / "transformer").glob("*.safetensors"))


def test_missing_folder(tmp_path):
    out = tmp_path / "o.png"
    assert_clean_failure(run_cli("--model", str(tmp_path / "nope"), "--output", str(out)), out, "nope")


def test_missing_component(sd3_tiny, tmp_path):
    model = _copy(sd3_tiny[0], tmp_path)
    shutil.rmtree(model / "vae")
    out = tmp_path / "o.png"
    assert_clean_failure(run_cli("--model", str(model), "--output", str(out)), out, "vae")


def test_truncated_weights(sd3_tiny, tmp_path, capfd):
    model = _copy(sd3_tiny[0], tmp_path)
    f = _transformer_file(model)
    f.write_bytes(f.read_bytes()[:-100])
    out = tmp_path / "o.png"
    assert_clean_failure(run_in_process(capfd, "--model", str(model), "--width", "24", "--height", "40",
                                        "--steps", "1", "--output", str(out)), out, f.name, "truncated")


def test_misshaped_tensor(sd3_tiny, tmp_path, capfd):
    model = _copy(sd3_tiny[0], tmp_path)
    f = _transformer_file(model)
    from safetensors.torch import load_file as tload, save_file as tsave
    weights = tload(str(f))
    weights["proj_out.weight"] = weights["proj_out.weight"][:, :-1].contiguous()
    tsave(weights, str(f))
    out = tmp_path / "o.png"
    assert_clean_failure(run_in_process(capfd, "--model", str(model), "--width", "24", "--height", "40",
                                        "--steps", "1", "--output", str(out)), out, "proj_out.weight", "mis-shaped")


def test_bad_width(sd3_tiny, tmp_path, capfd):
    out = tmp_path / "o.png"
    assert_clean_failure(run_in_process(capfd, "--model", str(sd3_tiny[0]), "--width", "30", "--height", "40",
                                        "--output", str(out)), out, "multiple")


def test_unwritable_output(sd3_tiny, tmp_path):
    out = tmp_path / "no_such_dir" / "o.png"
    assert_clean_failure(run_cli("--model", str(sd3_tiny[0]), "--output", str(out)), out, "does not exist")
    assert_clean_failure(run_cli("--model", str(sd3_tiny[0]), "--output", str(tmp_path)), str(tmp_path / "x.png"),
                         "folder")


def test_default_model_draws_its_default_prompt(tmp_path):
    """No --model, no --prompt: the embedded klein-shapes model draws its default prompt (a red shape on the left,
    a blue one on the right), says which model it used, and prints where the image went."""
    from mlxdiff import default_model
    from tools.train_klein_shapes import dataset
    out = tmp_path / "default.png"
    proc = run_cli("--output", str(out))
    assert proc.returncode == 0, proc.stderr
    assert str(default_model.FOLDER) in proc.stdout and str(out.resolve()) in proc.stdout
    assert default_model.PROMPT in proc.stdout
    image = Image.open(out)
    assert image.size == (64, 64)
    assert "red circle on the left" in default_model.PROMPT and "blue square on the right" in default_model.PROMPT
    assert dataset.colour_in_region(image, "red", "left") and dataset.colour_in_region(image, "blue", "right")


# -- SD3.5-only arguments (beside the tiny SD3 folder this module builds anyway) -------------------------------------

def _refused_in_process(capsys, argv, needle, out):
    """mlxdiff.generate's main in this process (no interpreter start-up): exit 2, one line naming `needle`."""
    assert main(["--no-progress", *argv, "--output", str(out)]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("mlxdiff: error: ") and needle in lines[0], lines
    assert not out.exists()


def test_sd3_skip_layers_bounded(sd3_tiny, tmp_path, capsys):
    folder = str(sd3_tiny[0])
    pipe = mlxdiff.load(folder)
    kw = dict(width=24, height=40, steps=1, progress_bar=False)
    for layers, needle in (([3], "from 0 to 2"), ([1, 1], "distinct"), ([], "layer indices"), ([True], "True")):
        with pytest.raises(mlxdiff.MlxdiffError, match=needle):
            pipe.generate("a cat", skip_guidance_layers=layers, **kw)
    with pytest.raises(mlxdiff.MlxdiffError, match="an option of FLUX.2 and FLUX 3 models only; this is an SD3.5 model"):
        pipe.generate("a cat", text_encoder_out_layers=[1], **kw)
    with pytest.raises(mlxdiff.MlxdiffError, match="max_sequence_length=513"):
        pipe.generate("a cat", max_sequence_length=513, **kw)
    _refused_in_process(capsys, ["--model", folder, "--skip-guidance-layers", "0,3", "--steps", "1"], "from 0 to 2",
                        tmp_path / "o.png")


# -- several images in one command (issue 12, point 4) --------------------------------------------------------------

def _pixels(path):
    return np.asarray(Image.open(path).convert("RGB"))


def test_several_images_match_single_runs(tmp_path, capsys):
    """A prompts file of 2 x --seed 7 8: four PNGs named from --output (prompt-major), each with its own metadata and
    pixel-identical to the single-image run of its prompt and seed, under one progress bar (no per-phase bars);
    --num-images 2 from --seed 7 draws the first prompt's two again."""
    prompts = ["a small green triangle at the top on a black background",
               "a large blue square on the left on a white background"]
    (tmp_path / "prompts.txt").write_text(f"{prompts[0]}\n\n{prompts[1]}\n", encoding="utf-8")
    assert main(["--prompts-file", str(tmp_path / "prompts.txt"), "--seed", "7", "8", "--steps", "1",
                 "--output", str(tmp_path / "job.png")]) == 0
    err = capsys.readouterr().err
    assert "image 4/4" in err and "denoise" not in err
    names = [tmp_path / f"job-{i}.png" for i in range(4)]
    assert sorted(p.name for p in tmp_path.glob("job*.png")) == [p.name for p in names]
    for k, (path, (prompt, seed)) in enumerate(zip(names, [(p, s) for p in prompts for s in (7, 8)])):
        image = Image.open(path)
        assert image.text["mlxdiff:prompt"] == prompt and image.text["mlxdiff:seed"] == str(seed)
        single = tmp_path / f"single-{k}.png"
        assert main(["--prompt", prompt, "--seed", str(seed), "--steps", "1", "--no-progress",
                     "--output", str(single)]) == 0
        assert np.array_equal(_pixels(path), _pixels(single)), path
    assert main(["--prompt", prompts[0], "--seed", "7", "--num-images", "2", "--steps", "1", "--no-progress",
                 "--keep", "all", "--output", str(tmp_path / "n.png")]) == 0
    assert [Image.open(tmp_path / f"n-{i}.png").text["mlxdiff:seed"] for i in range(2)] == ["7", "8"]
    for i in range(2):
        assert np.array_equal(_pixels(tmp_path / f"n-{i}.png"), _pixels(names[i]))
    assert not (tmp_path / "job.png").exists() and not (tmp_path / "n.png").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_bad_prompts_file(tmp_path, capsys):
    (tmp_path / "blank.txt").write_text("\n  \n\n")
    (tmp_path / "latin1.txt").write_bytes("a caf\xe9 on a white background\n".encode("latin-1"))
    # tmp_path / "/dev/zero" is /dev/zero: endless bytes, refused after a bounded read
    for name, needle in (("missing.txt", "cannot read"), ("blank.txt", "no prompts"), ("latin1.txt", "UTF-8"),
                         (".", "cannot read"), ("/dev/zero", "larger than")):
        _refused_in_process(capsys, ["--prompts-file", str(tmp_path / name)], needle, tmp_path / "o.png")
        assert not list(tmp_path.glob("o-*.png"))
