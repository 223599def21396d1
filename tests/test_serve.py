"""python -m mlxdiff.serve against the embedded default model, under a real uvicorn on 127.0.0.1: OpenAI's images API
through the `openai` package (its images equal the CLI's pixel for pixel), the job API and its event stream, cancel,
uploads, LoRAs chosen per request, the size caps (413), every bad request a 4xx naming its field with the server
still serving, the API key, and a load test."""

import base64
import io
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import openai
import pytest
from PIL import Image

import mlxdiff
from mlxdiff import default_model
from mlxdiff.errors import MlxdiffError
from mlxdiff.generate import main as generate_main
from mlxdiff.serve.__main__ import check_binding, main as serve_main
from mlxdiff.serve.app import JSON_BYTES
from mlxdiff.serve.jobs import FINISHED, KEEP_FINISHED
from serve_helpers import call, chunked, declared, events, multipart, running_server, shapes_lora

PROMPT = "a small green triangle at the top on a black background"
UPLOAD_MB = 1         # the module's server caps uploads here, so that a test can pass the cap cheaply
GOOD = {"prompt": PROMPT, "steps": 1, "seed": 1, "size": "16x16"}


@pytest.fixture(scope="module")
def lora_file(tmp_path_factory):
    return shapes_lora(tmp_path_factory.mktemp("lora") / "shapes-style.safetensors")


@pytest.fixture(scope="module")
def served(lora_file):
    pipe = mlxdiff.load(str(default_model.folder()), keep="auto")
    with running_server(pipe, loras={"shapes-style": str(lora_file)}, max_upload_mb=UPLOAD_MB) as (base, app):
        yield base, pipe


@pytest.fixture(scope="module")
def server(served):
    return served[0]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="not-needed", max_retries=0)


def pixels(png: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))


def png_of(image_size=(64, 64), colour=(200, 30, 30), alpha=None) -> bytes:
    image = Image.new("RGBA" if alpha is not None else "RGB", image_size, colour + ((alpha,) if alpha is not None
                                                                                    else ()))
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def still_serving(server):
    status, answer = call(server, "/v1/images/generations", GOOD)
    assert status == 200 and len(answer["data"]) == 1


def test_models(server):
    """The model and what its family takes, from the pipeline (FLUX.2: references / init image, a mask; the
    server's LoRAs; its generate() options), as the page reads them."""
    status, body = call(server, "/v1/models")
    assert status == 200 and body["data"][0]["id"] == "klein-shapes" and body["data"][0]["family"] == "FLUX.2"
    takes = body["data"][0]["takes"]
    assert takes["image"] is True and takes["mask"] is True and takes["loras"] == ["shapes-style"]
    assert {"scheduler", "max_sequence_length", "mask_blur", "outpaint"} <= set(takes["options"])
    assert "mask" not in takes["options"]           # an upload, not a JSON field
    assert call(server, "/v1/page-config")[1]["takes"] == takes


def test_openai_client_equals_cli(client, server, tmp_path):
    """n=2 from seed 5: seeds 5 and 6, as --num-images 2 --seed 5 makes them; the same pixels as the CLI's PNGs."""
    response = client.images.generate(prompt=PROMPT, n=2, size="64x64", response_format="b64_json",
                                      extra_body={"seed": 5, "steps": 2})
    served = [pixels(base64.b64decode(d.b64_json)) for d in response.data]
    out = tmp_path / "cli.png"
    assert generate_main(["--prompt", PROMPT, "--seed", "5", "--num-images", "2", "--steps", "2", "--output",
                          str(out), "--no-progress"]) == 0
    made = [pixels((tmp_path / f"cli-{k}.png").read_bytes()) for k in range(2)]
    assert served[0].shape == (64, 64, 3)
    assert np.array_equal(served[0], made[0]) and np.array_equal(served[1], made[1])
    assert not np.array_equal(served[0], served[1])           # two seeds, two images
    urls = client.images.generate(prompt=PROMPT, size="64x64", response_format="url", extra_body={"seed": 5,
                                                                                                   "steps": 2})
    status, png = call(server, urls.data[0].url)
    assert status == 200 and np.array_equal(pixels(png), made[0])
    assert Image.open(io.BytesIO(png)).text["mlxdiff:generator"] == "mlxdiff server"


BAD = [({"size": "64x64"}, "prompt"),                         # missing prompt
       ({"prompt": PROMPT, "size": "abc"}, "size"),
       ({"prompt": PROMPT, "size": "100000x64"}, "size"),     # huge: past mlxdiff's 4096
       ({"prompt": PROMPT, "size": "60x64"}, "size"),         # not a multiple of the model's 8
       ({"prompt": PROMPT, "n": 0}, "n"),
       ({"prompt": PROMPT, "n": 1000}, "n"),
       ({"prompt": PROMPT, "steps": -1}, "steps"),
       ({"prompt": PROMPT, "steps": "abc"}, "steps"),         # a field of the wrong type
       ({"prompt": PROMPT, "guidance": [1]}, "guidance"),
       ({"prompt": PROMPT, "seed": -3}, "seed"),
       ({"prompt": PROMPT, "response_format": "jpeg"}, "response_format"),
       ({"prompt": PROMPT, "no_such_option": 1}, "no_such_option"),    # not an option of this family
       ({"prompt": PROMPT, "true_cfg_scale": 2.0}, "true_cfg_scale"),  # FLUX.1's option
       ({"prompt": PROMPT, "mask": "/etc/passwd"}, "mask"),            # no server-side paths through JSON
       ({"prompt": PROMPT, "scheduler": "nope"}, "scheduler"),
       ({"prompt": PROMPT, "max_sequence_length": 0}, "max_sequence_length"),
       ({"prompt": PROMPT, "cache": "first-block:x"}, "cache"),
       ({"prompt": ["a", "b"]}, "prompt"),                             # the wrong type
       ({"prompt": PROMPT, "model": "dall-e-3"}, "model"),             # an unknown model
       ({"prompt": PROMPT, "loras": [{"name": "nope"}]}, "loras"),     # a LoRA the server does not offer
       ({"prompt": PROMPT, "loras": [{"name": "shapes-style", "scale": 1e9}]}, "loras"),
       ({"prompt": PROMPT, "loras": "shapes-style"}, "loras"),
       ({"prompt": PROMPT, "loras": [{"name": "shapes-style", "alpha": 1}]}, "loras"),
       ({"prompt": PROMPT, "size": "64x64x3"}, "size"),
       ({"prompt": PROMPT, "extras": {"steps": 1}}, "extras"),       # a name the server uses inside
       ({"prompt": PROMPT, "__class__": 1}, "__class__"),
       ({"prompt": PROMPT, "": 1}, "")]                                 # a field named "" is named too
# refused by the pipeline once the run starts (the family's own check of the option): the generations route waits
# and names the option; a job ends in an error event with the pipeline's line
AT_RUN = [({**GOOD, "text_encoder_out_layers": []}, "text_encoder_out_layers"),
          ({**GOOD, "text_encoder_out_layers": [1]}, "text_encoder_out_layers")]     # 64 features, 192 wanted


def test_bad_requests_name_their_field(server):
    """Each bad request a 400 naming its field, on both JSON routes, and a good request served right after it."""
    for body, field in BAD:
        for route in ("/v1/images/generations", "/v1/jobs"):
            status, answer = call(server, route, body)
            assert status == 400 and answer["error"]["field"] == field, (route, body, answer)
            assert answer["error"]["message"] and "Traceback" not in answer["error"]["message"]
        still_serving(server)
    for body, field in AT_RUN:
        status, answer = call(server, "/v1/images/generations", body)
        assert status == 400 and answer["error"]["field"] == field, (body, answer)
        status, job = call(server, "/v1/jobs", body)
        assert status == 202
        last = events(server, job["id"])[-1]
        assert last[0] == "error" and last[1]["status"] == 400 and last[1]["message"] == answer["error"]["message"]
        assert last[1]["field"] == field and call(server, f"/v1/jobs/{job['id']}")[1]["error"]["field"] == field
        still_serving(server)
    status, answer = call(server, "/v1/images/generations", raw=b"{not json")
    assert status == 400 and answer["error"]["field"] == "body"
    assert call(server, "/v1/jobs/nope")[0] == 404
    still_serving(server)


def test_size_caps(server):
    """A JSON body past JSON_BYTES, an upload past --max-upload-mb: a 413 naming the limit, on the declared length
    before any of the body is read (a client that waits for 100 Continue sends none), or, sent chunked without a
    length, once the bytes read pass the cap; the server serves on."""
    status, answer = declared(server, "/v1/images/generations", b"x" * (JSON_BYTES + 1))
    assert status == 413 and answer["error"]["field"] == "body" and "limit of 1 MB" in answer["error"]["message"]
    status, answer = chunked(server, "/v1/jobs", [b'{"prompt": "', b"y" * JSON_BYTES, b'"}'])
    assert status == 413 and "limit of 1 MB" in answer["error"]["message"], answer
    still_serving(server)
    image = png_of((700, 700))
    big = image + os.urandom((UPLOAD_MB << 20) - len(image))    # a PNG with junk after it, just past the cap
    body, kind = multipart({"prompt": PROMPT}, {"image": ("big.png", big)})
    for route in ("/v1/images/edits", "/v1/jobs/edits"):
        status, answer = declared(server, route, body, kind)
        assert status == 413 and f"limit of {UPLOAD_MB} MB" in answer["error"]["message"], answer
        assert "--max-upload-mb" in answer["error"]["message"]
        still_serving(server)
    status, answer = chunked(server, "/v1/images/edits", [body[:len(body) // 2], body[len(body) // 2:]], kind)
    assert status == 413 and answer["error"]["field"] == "body"
    still_serving(server)
    small, kind = multipart({"prompt": PROMPT, "steps": "1"}, {"image": ("small.png", png_of())})
    status, job = call(server, "/v1/jobs/edits", raw=small, headers={"Content-Type": kind})
    assert status == 202 and events(server, job["id"])[-1][0] == "done"       # under the cap: served


def test_loras_per_request(server):
    """A request's LoRA (one the server offers, at its scale) moves the image; the next request without it is the
    plain image again (the LoRA taken off); the PNG records it."""
    plain = call(server, "/v1/images/generations", GOOD)[1]["data"][0]["b64_json"]
    styled = call(server, "/v1/images/generations", {**GOOD, "loras": [{"name": "shapes-style", "scale": 1.0}],
                                                     "response_format": "url"})[1]["data"][0]["url"]
    png = call(server, styled)[1]
    assert not np.array_equal(pixels(png), pixels(base64.b64decode(plain)))
    assert Image.open(io.BytesIO(png)).text["mlxdiff:loras"] == "shapes-style:1"
    half = call(server, "/v1/images/generations", {**GOOD, "loras": [{"name": "shapes-style", "scale": 0.5}]})
    assert not np.array_equal(pixels(base64.b64decode(half[1]["data"][0]["b64_json"])), pixels(png))
    again = call(server, "/v1/images/generations", GOOD)[1]["data"][0]["b64_json"]
    assert np.array_equal(pixels(base64.b64decode(again)), pixels(base64.b64decode(plain)))


def test_job_events_and_cancel(server):
    status, job = call(server, "/v1/jobs", {"prompt": PROMPT, "steps": 3, "seed": 2})
    assert status == 202 and job["status"] in ("queued", "running")
    stream = events(server, job["id"])
    names = [name for name, _ in stream]
    assert names[-1] == "done" and "started" in names
    progress = [data for name, data in stream if name == "progress"]
    assert [p["step"] for p in progress] == [1, 2, 3] and {p["steps"] for p in progress} == {3}
    assert Image.open(io.BytesIO(base64.b64decode(progress[-1]["preview"]))).size == (64, 64)
    status, png = call(server, stream[-1][1]["images"][0])
    assert status == 200 and pixels(png).shape == (64, 64, 3)

    _, long = call(server, "/v1/jobs", {"prompt": PROMPT, "steps": 1000, "seed": 2})
    _, queued = call(server, "/v1/jobs", {"prompt": PROMPT, "steps": 2, "seed": 2})
    deadline = time.monotonic() + 30
    while call(server, f"/v1/jobs/{long['id']}")[1]["progress"]["step"] < 1:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert call(server, f"/v1/jobs/{queued['id']}/cancel", method="POST")[1]["status"] == "cancelled"
    call(server, f"/v1/jobs/{long['id']}/cancel", method="POST")
    last = events(server, long["id"])[-1]
    assert last[0] == "cancelled"
    status, final = call(server, f"/v1/jobs/{long['id']}")
    assert final["status"] == "cancelled" and final["images"] == [] and final["progress"]["step"] < 1000
    listed = {j["id"]: j["status"] for j in call(server, "/v1/jobs")[1]["data"]}
    assert listed[long["id"]] == listed[queued["id"]] == "cancelled" and listed[job["id"]] == "done"


def test_edits(client, server):
    """FLUX.2 edits from a reference image (multipart, through the openai client). OpenAI's mask (transparent:
    edit there) becomes mlxdiff's (white: repaint); an opaque mask leaves nothing to repaint, refused by name, as is
    an upload that is no image."""
    response = client.images.edit(image=("red.png", png_of(), "image/png"), prompt=PROMPT, size="64x64",
                                  response_format="b64_json", extra_body={"steps": 1, "seed": 4})
    plain = client.images.generate(prompt=PROMPT, size="64x64", extra_body={"steps": 1, "seed": 4})
    edited = pixels(base64.b64decode(response.data[0].b64_json))
    assert edited.shape == (64, 64, 3)
    assert not np.array_equal(edited, pixels(base64.b64decode(plain.data[0].b64_json)))   # the reference counts
    status, family = call(server, "/v1/page-config")
    inpaints = family["inpaints"]
    if inpaints:
        repainted = client.images.edit(image=("red.png", png_of(), "image/png"), prompt=PROMPT,
                                       mask=("m.png", png_of(alpha=0), "image/png"), extra_body={"steps": 2})
        assert pixels(base64.b64decode(repainted.data[0].b64_json)).shape == (64, 64, 3)
    with pytest.raises(openai.BadRequestError) as refused:
        client.images.edit(image=("red.png", png_of(), "image/png"), mask=("m.png", png_of(alpha=255), "image/png"),
                           prompt=PROMPT, extra_body={"steps": 1})
    assert refused.value.body["field"] == "mask"
    with pytest.raises(openai.BadRequestError) as refused:
        client.images.edit(image=("x.png", b"not a png", "image/png"), prompt=PROMPT, extra_body={"steps": 1})
    assert refused.value.body["field"] == "image"
    with pytest.raises(openai.BadRequestError) as refused:      # OpenAI's API: a mask of the image's dimensions
        client.images.edit(image=("red.png", png_of(), "image/png"), prompt=PROMPT, extra_body={"steps": 1},
                           mask=("wide.png", png_of((128, 64), alpha=0), "image/png"))
    assert refused.value.body["field"] == "mask" and "another aspect ratio" in refused.value.body["message"]
    for fields, field in (({"loras": "[{"}, "loras"), ({"loras": '[{"name": "nope"}]'}, "loras"),
                          ({"n": "many"}, "n"), ({"strength": "2"}, "strength"), ({"model": "dall-e-2"}, "model"),
                          ({"size": "64"}, "size")):
        body, kind = multipart({"prompt": PROMPT, "steps": "1", **fields}, {"image": ("red.png", png_of())})
        status, answer = call(server, "/v1/images/edits", raw=body, headers={"Content-Type": kind})
        assert status == 400 and answer["error"]["field"] == field, (fields, answer)
    body, kind = multipart({"steps": "1"}, {"image": ("red.png", png_of())})
    status, answer = call(server, "/v1/images/edits", raw=body, headers={"Content-Type": kind})
    assert status == 400 and answer["error"]["field"] == "prompt"
    still_serving(server)


def test_api_key_and_binding(capsys):
    with pytest.raises(MlxdiffError, match="needs --api-key"):
        check_binding("0.0.0.0", 8188, None)
    check_binding("0.0.0.0", 8188, "key")
    assert serve_main(["--host", "0.0.0.0", "--port", "1"]) == 2
    assert "needs --api-key" in capsys.readouterr().err
    with running_server(mlxdiff.load(str(default_model.folder())), api_key="sesame") as (base, _):
        status, answer = call(base, "/v1/models")
        assert status == 401 and answer["error"]["field"] == "authorization"
        assert call(base, "/v1/models", headers={"Authorization": "Bearer wrong"})[0] == 401
        assert call(base, "/v1/models", headers={"Authorization": "Bearer sesame"})[0] == 200
        assert call(base, "/")[0] == 200            # the page itself holds nothing to protect


def test_serve_options_refused_in_one_line(capsys, tmp_path):
    """--max-upload-mb out of range, and a --lora that does not fit the model, refused before serving (exit 2)."""
    assert serve_main(["--max-upload-mb", "0"]) == 2
    assert "--max-upload-mb 0: give a size in MB" in capsys.readouterr().err
    assert serve_main(["--lora", str(tmp_path / "missing.safetensors")]) == 2
    err = capsys.readouterr().err
    assert "missing.safetensors" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_runs_that_fail_are_answered(capsys):
    """A run that does not fit (MemoryError) is a 507 and a bug in a run a 500, each JSON naming what happened; the
    server goes on serving. (Its own pipeline object, whose generate is replaced: no shared fixture is touched.)"""
    pipe = mlxdiff.load(str(default_model.folder()))
    failures = iter([MemoryError("could not allocate 96 GB"), RuntimeError("a bug")])

    def failing(*args, **kwargs):
        raise next(failures)

    pipe.generate = failing
    with running_server(pipe) as (base, _):
        status, answer = call(base, "/v1/images/generations", {"prompt": PROMPT})
        assert status == 507 and "out of memory (could not allocate 96 GB)" in answer["error"]["message"]
        status, answer = call(base, "/v1/images/generations", {"prompt": PROMPT})
        assert status == 500 and answer["error"]["message"] == "RuntimeError: a bug"
        assert call(base, "/v1/models")[0] == 200


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


# The bound on RSS growth over the 50 requests, from the model's size: its components' loaded bytes (15.2 MB for the
# embedded default model: one more copy of the model, as a reload per request that something kept alive would
# leave) plus ARENA_SLACK for glibc's malloc arenas (the 4 client threads here and uvicorn's request handling each
# allocate in an arena of their own, which keeps the pages it touched: responses of a few kB, JSON, urllib buffers) and
# the finished jobs kept (KEEP_FINISHED: a PNG and one preview each, under 20 kB). Measured: about 3 MiB.
ARENA_SLACK = 16 << 20


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="RSS from /proc (Linux, as CI)")
def test_load_50_requests_from_4_clients(served):
    server, pipe = served
    assert call(server, "/v1/images/generations", {"prompt": PROMPT, "steps": 1, "seed": 0, "size": "16x16"})[0] == 200
    first = rss_bytes()
    bad = [b for b, _ in BAD[:5]]

    def request(k):
        body = bad[k // 5 % len(bad)] if k % 5 == 4 else {"prompt": PROMPT, "steps": 1, "seed": k, "size": "16x16"}
        return k, body, call(server, "/v1/images/generations", body, timeout=120)

    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(request, range(50)))
    assert len(answers) == 50
    for k, body, (status, answer) in answers:
        if k % 5 == 4:
            assert status == 400 and answer["error"]["field"], (body, answer)
        else:
            assert status == 200 and len(answer["data"]) == 1 and answer["data"][0]["seed"] == k
            assert pixels(base64.b64decode(answer["data"][0]["b64_json"])).shape == (16, 16, 3)
    assert sum(1 for _, _, (s, _) in answers if s == 200) == 40
    listed = call(server, "/v1/jobs")[1]["data"]
    assert len(listed) <= KEEP_FINISHED and all(j["status"] in FINISHED for j in listed)
    grown = rss_bytes() - first
    bound = sum(pipe._loaded_nbytes(s) for s in pipe.components.values() if s is not None) + ARENA_SLACK
    print(f"RSS after the first request {first / 2**20:.1f} MiB, grown {grown / 2**20:.1f} MiB over 50 more "
          f"(bound {bound / 2**20:.1f} MiB)")
    assert grown <= bound, f"RSS grew {grown / 2**20:.1f} MiB over 50 requests, past {bound / 2**20:.1f} MiB"
    assert threading.active_count() < 40
    # keep="auto": the model stayed loaded between requests (nothing reloaded per request)
    assert {key[0] for key in pipe.residency.models} == {"text_encoder", "transformer", "vae"}
