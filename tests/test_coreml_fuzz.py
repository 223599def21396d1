"""The Core ML package fuzzer's seeded share (issue 45; bench/fuzz_coreml.py, whose long runs fork a child per mutant
through bench/fuzz_readers.py --format coreml over a tiny UNet read as `--transformer X.mlpackage`): 60 mutants of a
small palettized package (two Linears and a conv), each refused in one MlxdiffError line naming a path of the
package, or read with every weight equal to coremltools' own decompression of the same package, bit for bit; every
kind of edit (Manifest.json, model.mlmodel's bytes and its protobuf fields, weight.bin, the folder) made."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import fuzz_coreml  # noqa: E402  (the Core ML package fuzzer: its mutations, ours and coremltools' reading)


def test_coreml_fuzzer_finds_nothing_unacceptable(tmp_path):
    result = fuzz_coreml.run(60, seed=7, workdir=tmp_path)
    summary = json.dumps({k: result[k] for k in ("counts", "kinds", "failures")}, indent=1)[:6000]
    assert result["base"] == ("loaded = reference", ""), result["base"]     # the unmutated package reads exactly
    assert result["n"] == 60 and result["unacceptable"] == 0, summary
    assert set(result["kinds"]) == set(fuzz_coreml.KINDS) and min(result["kinds"].values()) >= 5, summary
    assert result["counts"].get("refused (reference refuses too)", 0) >= 30, summary
    assert result["counts"].get("loaded = reference", 0) >= 3, summary
