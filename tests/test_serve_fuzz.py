"""A seeded share of bench/fuzz_server.py (issue 45, the server's requests): mutants of valid generations, jobs and
edits requests and of the job routes, sent to the server over the embedded default model; none may be answered
with a 5xx, a traceback or a non-JSON error, or leave the server dead or hung (the long run: bench/RESULTS.md)."""

import importlib.util
import sys
import tempfile
from pathlib import Path

import pytest

import mlxdiff
from mlxdiff import default_model
from serve_helpers import running_server, shapes_lora

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("fuzz_server", ROOT / "bench" / "fuzz_server.py")
fuzz_server = importlib.util.module_from_spec(spec)
sys.modules.setdefault("fuzz_server", fuzz_server)
spec.loader.exec_module(fuzz_server)

MUTANTS = 60
SEED = 7


@pytest.fixture(scope="module")
def server():
    pipe = mlxdiff.load(str(default_model.folder()), keep="auto")
    with tempfile.TemporaryDirectory() as folder:
        lora = shapes_lora(Path(folder) / "shapes-style.safetensors")
        with running_server(pipe, loras={"shapes-style": str(lora)}, max_upload_mb=fuzz_server.UPLOAD_MB) as (
                base, _):
            yield base


def test_fuzzed_requests_answered_cleanly(server):
    result = fuzz_server.fuzz(server, MUTANTS, SEED)
    assert result["n"] == MUTANTS                      # none lost: every mutant answered (a dead server stops it)
    assert result["unacceptable"] == 0, result["failures"]
    counts = result["counts"]
    # the share reaches each kind of answer: images made, requests refused by field, route-level refusals
    assert counts["served"] >= 5 and counts["refused, field named"] >= 20 and counts.get("refused, no field", 0) >= 1


def test_mutants_are_a_function_of_seed_and_index():
    a, b = fuzz_server.mutant(SEED, 11, []), fuzz_server.mutant(SEED, 11, [])
    assert a == b and a != fuzz_server.mutant(SEED, 12, [])
