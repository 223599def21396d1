"""Seeded LoRA mutants (issue 30, bench/fuzz_lora.py through bench/fuzz_readers.py --format lora): each read by
mlxdiff as a pipeline's --lora reads it, in a forked child under a memory cap and an alarm, and each refused in one
MlxdiffError line naming the file, or loaded with the weight change diffusers' own loading gives the same file
(Flux2KleinPipeline.load_lora_weights on the diffusers twin of the default model's transformer); never a load of a
file diffusers refuses, of non-finite values, or with other numbers. The 10,000-mutant run is the bench's."""

import json
import subprocess
import sys
from pathlib import Path

FUZZER = Path(__file__).resolve().parents[1] / "bench" / "fuzz_readers.py"
N = 80


def test_lora_mutants_are_refused_or_read_as_diffusers(tmp_path):
    # a process of its own: the fuzzer forks a child per mutant, safe only in a process that has run no MLX work
    out = tmp_path / "result.json"
    proc = subprocess.run([sys.executable, str(FUZZER), "--format", "lora", "--n", str(N), "--seed", "13",
                           "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert out.exists(), f"rc {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    result = json.loads(out.read_text())
    assert result["n"] == N
    assert result["unacceptable"] == 0, proc.stdout[-6000:]
    counts = result["counts"]
    # the mutants reach every path: refusals diffusers shares, stricter ones, and loads equal to diffusers'
    assert counts.get("refused (reference refuses too)", 0) > N // 4, counts
    assert counts.get("refused (reference accepts)", 0) > N // 10, counts
    assert counts.get("loaded = reference", 0) > N // 20, counts
    assert result["slowest_s"] < 3.0, result
