"""User-mistake cases for the CLI, run by adversarial.run_cases, shared by tests/test_bad_input_round2.py and
tests/test_step_cache.py (no test module imports another)."""

from adversarial import refused
from mlxdiff import default_model


MODEL = str(default_model.FOLDER)
CHEAP = ["--model", MODEL, "--steps", "1", "--width", "16", "--height", "16", "--no-progress"]
FAST = 30   # seconds a case may take: a hang is a failure, not a stalled suite


def gen(out, *argv):
    return {"cli": "mlxdiff.generate", "argv": [*CHEAP, "--output", str(out), *argv], "timeout": FAST}


def lines(outcome):
    return [line for line in outcome.stderr.splitlines() if line.strip()]


def assert_refused(outcome, *needles):
    assert refused(outcome), outcome.describe()
    line = lines(outcome)[0]
    assert line.startswith("mlxdiff: error: "), outcome.describe()
    for needle in needles:
        assert needle in line, (needle, outcome.describe())
