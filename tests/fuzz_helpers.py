"""The readers' fuzzer (bench/fuzz_readers.py) run from the tests, with the checks every format shares; shared by
tests/test_reader_fuzz.py and tests/test_lora_fuzz.py (no test module imports another)."""

import json
import subprocess
import sys
from pathlib import Path

FUZZER = Path(__file__).resolve().parents[1] / "bench" / "fuzz_readers.py"
# Time guards that a loaded machine (2 cores shared by several suites: every mutant several times slower) cannot
# trip, keeping what they protect against: a mutant that never ends is still the fuzzer's `hang` class (its alarm,
# here MUTANT_ALARM_S wall-clock seconds instead of the bench's 10) and so unacceptable; one that is merely
# pathologically slow (a hostile count walked entry by entry) is caught by SLOWEST_VS_MEAN: the slowest mutant
# against the run's own mean time per mutant, which load slows alike (the bench's 3,000- and 10,000-mutant runs:
# slowest 1.5x to 28x the mean, bench/logs-2026-12-0*/fuzz), with a floor for runs whose mean is a few ms.
MUTANT_ALARM_S = 120
SLOWEST_VS_MEAN = 100
SLOWEST_FLOOR_S = 2.0


def fuzzed(tmp_path, fmt, n):
    """bench/fuzz_readers.py's result for `n` seeded mutants of `fmt`, after the checks every format shares (all ran,
    none unacceptable, every kind of mutation the fuzzer knows drawn at least once: the seeded share is small, the
    bench's runs are the long ones). A process of its own: the fuzzer forks a child per mutant, safe only in a
    process that has run no MLX work."""
    out = tmp_path / "result.json"
    proc = subprocess.run([sys.executable, str(FUZZER), "--format", fmt, "--n", str(n), "--seed", "13",
                           "--timeout", str(MUTANT_ALARM_S), "--json", str(out)], capture_output=True, text=True,
                          timeout=3600)     # only against a fuzzer that stops answering: each mutant has its alarm
    assert out.exists(), f"rc {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    result = json.loads(out.read_text())
    assert result["n"] == n
    assert result["unacceptable"] == 0, proc.stdout[-6000:]
    kinds = result["kinds"]
    assert kinds and min(kinds.values()) >= 1, {k: c for k, c in kinds.items() if not c}
    mean = result["wall_s"] / n
    assert result["slowest_s"] < max(SLOWEST_FLOOR_S, SLOWEST_VS_MEAN * mean), (result["slowest_s"], mean)
    return result
