"""Seeded mutants of a safetensors and a GGUF file (issue 13): each read in a forked child under a 4 GiB memory
cap and an alarm, and each refused in one MlxdiffError line or read exactly as the reference reads the same bytes
(safetensors' Rust parser; gguf-py). bench/fuzz_readers.py holds the operators and the outcome classes, and runs
the 10,000-mutant version. Seed 13's first 120 mutants of each format draw every kind of mutation it knows
(fuzz_readers.ST_KINDS, GGUF_KINDS: asserted by fuzz_helpers.fuzzed)."""

import pytest

from fuzz_helpers import fuzzed

N = 120


@pytest.mark.parametrize("fmt", ["safetensors", "gguf"])
def test_mutants_are_refused_or_read_as_the_reference(tmp_path, fmt):
    result = fuzzed(tmp_path, fmt, N)
    counts = result["counts"]
    # the mutants reach both paths: most are refused, some load (and match the reference)
    assert sum(c for k, c in counts.items() if k.startswith("refused")) > N // 2, counts
    assert counts.get("loaded = reference", 0) > N // 20, counts
