"""Seeded LoRA mutants (issue 30, bench/fuzz_lora.py through bench/fuzz_readers.py --format lora): each read by
mlxdiff as a pipeline's --lora reads it, in a forked child under a memory cap and an alarm, and each refused in one
MlxdiffError line naming the file, or loaded with the weight change diffusers' own loading gives the same file
(Flux2KleinPipeline.load_lora_weights on the diffusers twin of the default model's transformer); never a load of a
file diffusers refuses, of non-finite values, or with other numbers (and none hangs or is pathologically slow:
fuzz_helpers.fuzzed's load-proof time guards). Seed 13's first 24 mutants draw every kind of mutation the fuzzer
knows (each whole-file conversion and each operator: fuzz_lora.KINDS, asserted by fuzzed); the 10,000-mutant run is
the bench's."""

from fuzz_helpers import fuzzed

N = 24


def test_lora_mutants_are_refused_or_read_as_diffusers(tmp_path):
    result = fuzzed(tmp_path, "lora", N)
    counts = result["counts"]
    # the mutants reach every path: refusals diffusers shares, stricter ones, and loads equal to diffusers'
    assert counts.get("refused (reference refuses too)", 0) > N // 4, counts
    assert counts.get("refused (reference accepts)", 0) > N // 10, counts
    assert counts.get("loaded = reference", 0) > N // 20, counts
