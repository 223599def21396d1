"""The CLI: a successful run writes a PNG with metadata; each user mistake is one line, exit code 2, no PNG."""

import os
import shutil
import subprocess
import sys

from PIL import Image


def run_cli(*args, cwd=None):
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    return subprocess.run([sys.executable, "-m", "mlxdiff.generate", "--no-progress", *args], capture_output=True,
                          text=True, cwd=cwd, env=env, timeout=300)


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


def test_truncated_weights(sd3_tiny, tmp_path):
    model = _copy(sd3_tiny[0], tmp_path)
    f = _transformer_file(model)
    f.write_bytes(f.read_bytes()[:-100])
    out = tmp_path / "o.png"
    assert_clean_failure(run_cli("--model", str(model), "--width", "24", "--height", "40", "--steps", "1",
                                 "--output", str(out)), out, f.name, "truncated")


def test_misshaped_tensor(sd3_tiny, tmp_path):
    model = _copy(sd3_tiny[0], tmp_path)
    f = _transformer_file(model)
    from safetensors.torch import load_file as tload, save_file as tsave
    weights = tload(str(f))
    weights["proj_out.weight"] = weights["proj_out.weight"][:, :-1].contiguous()
    tsave(weights, str(f))
    out = tmp_path / "o.png"
    assert_clean_failure(run_cli("--model", str(model), "--width", "24", "--height", "40", "--steps", "1",
                                 "--output", str(out)), out, "proj_out.weight", "mis-shaped")


def test_bad_width(sd3_tiny, tmp_path):
    out = tmp_path / "o.png"
    assert_clean_failure(run_cli("--model", str(sd3_tiny[0]), "--width", "30", "--height", "40",
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
