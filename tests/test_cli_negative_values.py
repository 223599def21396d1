"""Option values that start with '-' (issue 45): `--outpaint -8,0,0,0` reaches mlxdiff's own check of the value and
is refused in its one line (exit 2), not by argparse's "expected one argument"; the parser takes any '-<digit>' value
as a value, for every option, while a mistyped option is still refused."""

import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from adversarial import Outcome, refused  # noqa: E402

from mlxdiff import default_model  # noqa: E402
from mlxdiff.cli import ArgumentParser  # noqa: E402

CHEAP = ["--model", str(default_model.FOLDER), "--steps", "1", "--width", "16", "--height", "16", "--no-progress"]


def test_negative_outpaint_refused_by_mlxdiff(tmp_path):
    """Each a real `python -m mlxdiff.generate` (the refusal comes before any model work: half a second of imports,
    not a fork server's)."""
    out = str(tmp_path / "x.png")
    argvs = [[*CHEAP, "--output", out, "--outpaint", value] for value in ("-8,0,0,0", "-0.5,0,0,0")]
    argvs.append([*CHEAP, "--output", out, "--outpaint=-8,0,0,0"])
    for argv in argvs:
        p = subprocess.run([sys.executable, "-m", "mlxdiff.generate", *argv], capture_output=True, text=True,
                           timeout=300)
        outcome = Outcome({"argv": argv}, p.returncode, None, p.stdout, p.stderr)
        assert refused(outcome), outcome.describe()
        line = outcome.stderr.strip()
        assert "outpaint=" in line and ("-8,0,0,0" in line or "-0.5,0,0,0" in line), line
        assert "expected one argument" not in line and "from 0 to" in line, line
    assert not os.path.exists(out)


def test_parser_takes_values_that_look_negative():
    p = ArgumentParser(prog="t")
    p.add_argument("--edges")
    p.add_argument("--scale", type=float)
    for value in ("-8,0,0,0", "-1e3", "-.5", "-2.5", "-7"):
        assert p.parse_args(["--edges", value]).edges == value
    assert p.parse_args(["--scale", "-1e3"]).scale == -1000.0
    with pytest.raises(SystemExit) as e:     # an option that is not one is still argparse's one-line refusal
        p.parse_args(["--edges", "-x"])
    assert e.value.code == 2
