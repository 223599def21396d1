"""The Core ML package fuzzer's seeded share (issue 45; bench/fuzz_coreml.py, whose long runs fork a child per mutant
through bench/fuzz_readers.py --format coreml over a tiny UNet read as `--transformer X.mlpackage`): 60 mutants of a
small palettized package (two Linears and a conv), each refused in one MlxdiffError line naming a path of the
package, or read with every weight equal to coremltools' own decompression of the same package, bit for bit; every
kind of edit (Manifest.json, model.mlmodel's bytes and its protobuf fields, weight.bin, the folder) made. The base
package is the same bytes when built in another process, so mutant i of seed 7 is too."""

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))
import fuzz_coreml  # noqa: E402  (the Core ML package fuzzer: its mutations, ours and coremltools' reading)


def test_coreml_fuzzer_finds_nothing_unacceptable(tmp_path):
    result = fuzz_coreml.run(60, seed=7, workdir=tmp_path)
    summary = json.dumps({k: result[k] for k in ("counts", "kinds", "failures")}, indent=1)[:6000]
    assert result["base"] == ("loaded = reference", ""), result["base"]     # the unmutated package reads exactly
    assert result["n"] == 60 and result["unacceptable"] == 0, summary
    assert set(result["kinds"]) == set(fuzz_coreml.KINDS) and min(result["kinds"].values()) >= 5, summary
    assert result["counts"].get("refused (reference refuses too)", 0) >= 30, summary
    assert result["counts"].get("loaded = reference", 0) >= 3, summary
    # the base and its mutants made again in a fresh process (protobuf's map order and Manifest.json's UUIDs were its
    # own there): the same bytes, mutant by mutant
    code = (f"import sys, json; sys.path.insert(0, {str(BENCH)!r}); import fuzz_coreml; "
            f"print(json.dumps(fuzz_coreml.digests(60, 7, {str(tmp_path / 'other')!r})))")
    proc = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, timeout=600)
    there = json.loads(proc.stdout.splitlines()[-1])
    assert len(there) == len(result["digests"]) == 61
    differ = [i - 1 for i, (a, b) in enumerate(zip(result["digests"], there)) if a != b]
    assert differ == [], f"mutants {differ} differ from one process to another (-1: the base)"
