"""A refusal with two family options given names its option (issue 43's leftover, bench/logs-2026-12-07/fuzz_server:
mutant 1623 of seed 1, max_sequence_length=1 with text_encoder_out_layers="1", whose line named neither, so the
server's error had no field): the FLUX pipelines check text_encoder_out_layers under its own name when a run starts,
so the server's field is found in the line on both routes, and the API's line says which option."""

import pytest

import mlxdiff
from mlxdiff import default_model
from mlxdiff.errors import MlxdiffError
from serve_helpers import call, events, running_server

GOOD = {"prompt": "a small green triangle at the top on a black background", "steps": 1, "seed": 1, "size": "16x16"}
# two family options each; the taps wrong by type, by count and by depth (the default model's encoder has 2 layers)
PAIRS = [{"max_sequence_length": 1, "text_encoder_out_layers": "1"},
         {"max_sequence_length": 8, "text_encoder_out_layers": [99]},
         {"scheduler": "euler", "text_encoder_out_layers": []}]


@pytest.fixture(scope="module")
def served():
    pipe = mlxdiff.load(str(default_model.folder()), keep="auto")
    with running_server(pipe) as (base, _):
        yield base, pipe


@pytest.mark.parametrize("options", PAIRS, ids=[repr(p["text_encoder_out_layers"]) for p in PAIRS])
def test_pair_refusal_names_its_option(served, options):
    base, pipe = served
    status, answer = call(base, "/v1/images/generations", {**GOOD, **options})
    assert status == 400 and answer["error"]["field"] == "text_encoder_out_layers", answer
    line = answer["error"]["message"]
    assert line.startswith("text_encoder_out_layers=") and "\n" not in line and "Traceback" not in line, line
    status, job = call(base, "/v1/jobs", {**GOOD, **options})
    assert status == 202
    last = events(base, job["id"])[-1]
    assert last[0] == "error" and last[1]["field"] == "text_encoder_out_layers" and last[1]["message"] == line
    with pytest.raises(MlxdiffError, match="^text_encoder_out_layers="):
        pipe.generate(GOOD["prompt"], steps=1, width=16, height=16, progress_bar=False, **options)


def test_too_few_taps_names_its_option(served):
    """Taps the encoder takes (its deepest layer, 2, included) but too few for the transformer: the features' line
    starts with the option too, given beside another."""
    base, _ = served
    status, answer = call(base, "/v1/images/generations", {**GOOD, "text_encoder_out_layers": [1, 2],
                                                           "max_sequence_length": 8})
    assert status == 400 and answer["error"]["field"] == "text_encoder_out_layers"   # 2 taps: 128 features, not 192
    assert "192" in answer["error"]["message"]     # the features given and wanted
