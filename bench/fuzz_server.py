"""Seeded fuzzing of the server's requests (issue 45: the server's requests; issue 43: every bad request a 4xx
naming its field, the server never dies from a request).

    python bench/fuzz_server.py --n 2000 --seed 1 [--json result.json]

Starts python -m mlxdiff.serve's app over the embedded default model (keep="auto", one LoRA offered, uploads capped
at 2 MB) under a real uvicorn on 127.0.0.1, in a thread of this process (tests/serve_helpers.running_server), and
sends it mutants of valid requests, one after another. Mutant i of a seed is a function of (seed, i) alone
(`--only i` replays it, printing what was sent and answered). The bases are cheap valid requests (32x32 and
smaller, 1 or 2 steps): the generations and jobs JSON bodies, the edits and job-edits multipart forms (an image,
with or without a mask, a LoRA, a strength), and the job routes (status, cancel, events, image). The mutations, 1
to 3 stacked: a field dropped, retyped (null, bool, numbers past every bound, NaN and infinities as Python's JSON
writes them, strings, lists, objects, deep nesting) or renamed to an unknown one; the family's options added with
random values; sizes, LoRA lists, seeds and counts from tables of edge values; the JSON text itself cut, bit-flipped,
nested 100,000 deep, made invalid UTF-8 or sent under another content type; an upload's bytes cut, flipped or
replaced (a PNG declaring 60000x60000 pixels, an empty file, text), a mask of another size or aspect ratio, all
black or transparent, a form field or file dropped or doubled, the multipart boundary broken; random job ids and
image indices. Costly valid requests are not generated (a size past 64 pixels a side, more than 2 steps, more than 2
images: those are refused, or are the cheap ones).

Outcome classes. Acceptable: `served` (200 or 202, the images decodable PNGs; a job followed to its end: done,
cancelled or an error of the request's own, 4xx), `refused, field named` (a 4xx with a JSON error naming the field),
`refused, no field` (a 4xx with a JSON error message that names no field: route-level answers such as a 404 for
a random job id, listed). Not: `5xx` (a bug's 500, or a job that ended in a 5xx), `traceback` (a body with a Python
traceback or exception repr), `not JSON` (an error that is no JSON error object), `dead` (no answer, or the server
not answering GET /v1/models right after), `hang` (no answer within --timeout seconds).
"""

import argparse
import base64
import io
import json
import random
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path

from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))   # serve_helpers: the server in a thread, multipart bodies, LoRA file

import mlxdiff  # noqa: E402
from mlxdiff import default_model  # noqa: E402
from serve_helpers import events, multipart, running_server, shapes_lora  # noqa: E402

PROMPT = "a small green triangle at the top on a black background"
UPLOAD_MB = 2
ROUTES_JSON = ("/v1/images/generations", "/v1/jobs")
ROUTES_FORM = ("/v1/images/edits", "/v1/jobs/edits")
SIZES = ["32x32", "16x16", "8x8", "auto", "24x40", "0x0", "60x64", "64x60", "100000x64", "64x100000", "abc", "",
         "32x", "x32", "-8x8", "8x8x8", " 32x32", "32X32", "32x32 ", "1e2x32", "０x32", "4097x8", "65x65",
         "32.0x32", "999999999999x1"]
NUMBERS = [None, True, False, 0, 1, 2, 3, -1, 17, 1001, 2 ** 31, 2 ** 63, 2 ** 64, 2 ** 64 - 1, 2 ** 70, -2 ** 70,
           0.5, 1.5, -0.0, 1e308, 1e-320, float("nan"), float("inf"), float("-inf"), "1", "abc", "", [], [1], {},
           {"a": 1}, "\u0000", "9" * 400]
STRINGS = [None, "", " ", "\u0000", "\u200b", "a" * 5000, "é🦊", "\\", "%s%n", "<script>",
           "../../etc/passwd", "/etc/passwd", 1, 1.5, True, [], ["a"], {"a": "b"}]
OPTION_VALUES = {"scheduler": ["euler", "dpmpp_2m", "nope", "", 1, None, ["euler"]],
                 "max_sequence_length": [1, 8, 0, -1, 512, 513, 10 ** 9, "8", 1.5, None],
                 "text_encoder_out_layers": [[1], [0, 1], [], [-1], [99], "1", 1, [1.5], None],
                 "mask_blur": [0, 1, 2.5, -1, 1e9, "1", None, float("nan")],
                 "outpaint": [[1, 1, 1, 1], [0, 0, 0, 0], [-1, 0, 0, 0], [10 ** 6, 0, 0, 0], [1, 2], "8", 8, None],
                 "cache": ["first-block", "first-block:0.1", "taylorseer", "taylorseer:2:1", "first-block:x",
                           "nope", "", 1, None],
                 "negative_prompt": STRINGS, "guidance": NUMBERS, "mask": ["/etc/passwd", "x.png", 1, None],
                 "image_noise": [[1, 2], "x", None], "response_format": ["b64_json", "url", "jpeg", "", 1, None],
                 "model": ["klein-shapes", "dall-e-3", "", 1, None], "user": STRINGS, "quality": STRINGS,
                 "style": STRINGS}
ODD_NAMES = ["extras", "__class__", "__dict__", "model_config", "model_extra", "fields", "body", "width", "height",
             "image", "strength", "latents", "conditioning", "on_step", "callback", "progress_bar", "seed ", "Prompt",
             "", " ", "\u0000", "a" * 300, "loras.0", "prompt\u0000"]
LORA_LISTS = [[], [{"name": "shapes-style"}], [{"name": "shapes-style", "scale": 0.5}],
              [{"name": "shapes-style", "scale": 1e9}], [{"name": "shapes-style", "scale": float("nan")}],
              [{"name": "nope"}], [{"name": ""}], [{}], [{"scale": 1}], ["shapes-style"], "shapes-style", 1, None,
              [{"name": "shapes-style", "alpha": 1}], [{"name": "shapes-style"}] * 9,
              [{"name": "shapes-style", "scale": "x"}], [{"name": ["shapes-style"]}]]


def png(size=(32, 32), colour=(200, 30, 30), mode="RGB") -> bytes:
    out = io.BytesIO()
    Image.new(mode, size, colour if mode == "RGB" else colour + (0,) if mode == "RGBA" else colour[0]).save(out, "PNG")
    return out.getvalue()


def mask_png(size=(32, 32), alpha=False) -> bytes:
    mask = Image.new("RGBA" if alpha else "RGB", size, (0, 0, 0, 255) if alpha else (0, 0, 0))
    mask.paste((255, 255, 255, 0) if alpha else (255, 255, 255), (size[0] // 4, size[1] // 4, size[0] * 3 // 4,
                                                                  size[1] * 3 // 4))
    out = io.BytesIO()
    mask.save(out, "PNG")
    return out.getvalue()


def bomb_png(width=60000, height=60000) -> bytes:
    """A valid PNG header declaring a huge image (its data cut short): the decoded size must be refused."""
    data = png((8, 8))
    return data[:16] + width.to_bytes(4, "big") + height.to_bytes(4, "big") + data[24:]


def flip(data: bytes, rng) -> bytes:
    if not data:
        return b"\xff"
    b = bytearray(data)
    for _ in range(rng.randint(1, 8)):
        b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
    return bytes(b)


def cut(data: bytes, rng) -> bytes:
    return data[:rng.randrange(len(data) + 1)]


# -- the mutants ----------------------------------------------------------------------------------------------------
def json_mutant(rng, k) -> dict:
    """(route, body bytes, content type, what was done) for a generations / jobs request."""
    body = {"prompt": PROMPT, "size": "32x32", "steps": 1, "seed": k}
    if rng.random() < 0.3:
        body["n"] = rng.choice([1, 2])
    if rng.random() < 0.2:
        body["loras"] = [{"name": "shapes-style", "scale": 0.5}]
    done = []
    for _ in range(rng.randint(1, 3)):
        kind = rng.choice(["drop", "retype", "rename", "option", "size", "loras", "seed", "n", "steps", "prompt",
                           "name"])
        if kind == "drop" and body:
            name = rng.choice(sorted(body))
            body.pop(name)
            done.append(f"drop {name}")
        elif kind == "retype" and body:
            name = rng.choice(sorted(body))
            body[name] = rng.choice(NUMBERS + STRINGS)
            done.append(f"retype {name}={body[name]!r:.40}")
        elif kind == "rename" and body:
            name = rng.choice(sorted(body))
            body[name + rng.choice(["_", "s", "X", "\u0000"])] = body.pop(name)
            done.append(f"rename {name}")
        elif kind == "name":       # a field named as the server's own names inside, or oddly
            name = rng.choice(ODD_NAMES)
            body[name] = rng.choice(NUMBERS + STRINGS)
            done.append(f"field {name!r}")
        elif kind == "option":
            name = rng.choice(sorted(OPTION_VALUES))
            body[name] = rng.choice(OPTION_VALUES[name])
            done.append(f"{name}={body[name]!r:.40}")
        elif kind == "size":
            body["size"] = rng.choice(SIZES)
            done.append(f"size={body['size']!r}")
        elif kind == "loras":
            body["loras"] = rng.choice(LORA_LISTS)
            done.append(f"loras={body['loras']!r:.60}")
        elif kind == "seed":
            body["seed"] = rng.choice([0, 2 ** 64 - 1, 2 ** 64 - 2, 2 ** 64, -1, 1.5, "3", None])
            done.append(f"seed={body['seed']!r}")
        elif kind == "n":
            body["n"] = rng.choice([0, 1, 2, 17, -1, "2", 2.0, 1.5, None, 10 ** 6])
            done.append(f"n={body['n']!r}")
        elif kind == "steps":
            body["steps"] = rng.choice([0, 1, 2, -1, 1001, 10 ** 9, 1.5, "1", None, True])
            done.append(f"steps={body['steps']!r}")
        elif kind == "prompt":
            body["prompt"] = rng.choice(STRINGS)
            done.append(f"prompt={body['prompt']!r:.40}")
    cheap(body)
    text = json.dumps(body).encode()
    kind = "application/json"
    r = rng.random()
    if r < 0.06:
        text, what = cut(text, rng), "cut"
    elif r < 0.12:
        text, what = flip(text, rng), "flipped"
    elif r < 0.14:
        text, what = b"[" * 100000 + b"]" * 100000, "nested 100000 deep"
    elif r < 0.16:
        text, what = text.replace(b"triangle", b"tri\xff\xfengle"), "invalid UTF-8"
    elif r < 0.19:
        kind, what = rng.choice(["text/plain", "application/x-www-form-urlencoded", "multipart/form-data", ""]), "type"
    elif r < 0.21:
        text, what = rng.choice([b"", b"null", b"[]", b"1", b'"prompt"', b"{}", b'{"prompt": "a", "prompt": 1}']), "raw"
    else:
        what = None
    if what:
        done.append(f"body {what}: {kind}")
    return {"route": rng.choice(ROUTES_JSON), "body": text, "type": kind, "done": done}


def cheap(body):
    """No costly valid request: sizes past 64 a side, steps past 2 and n past 2 are left as they are only when
    invalid (the server refuses them); a valid costly value is made cheap."""
    if isinstance(body.get("steps"), int) and not isinstance(body["steps"], bool) and 2 < body["steps"] <= 1000:
        body["steps"] = 2
    if isinstance(body.get("n"), int) and not isinstance(body["n"], bool) and 2 < body["n"] <= 16:
        body["n"] = 2
    size = body.get("size")
    if isinstance(size, str) and "x" in size:
        parts = size.split("x")
        if len(parts) == 2 and all(p.isdigit() and p.isascii() for p in parts):
            w, h = int(parts[0]), int(parts[1])
            if (w > 64 or h > 64) and w <= 4096 and h <= 4096:
                body["size"] = "32x32"
    if "size" not in body or body.get("size") in (None, "auto"):
        body["size"] = "auto"      # the model's default: 64x64, the most a valid mutant costs
    if "steps" not in body or body["steps"] is None:
        body["steps"] = 1          # the model's default is 4 steps: cheap enough, but keep the run short


def form_mutant(rng, k) -> dict:
    """(route, multipart body, content type, what was done) for an edits / job-edits request."""
    fields = {"prompt": PROMPT, "steps": "1", "size": "32x32", "seed": str(k)}
    files = {"image": ("red.png", png())}
    if rng.random() < 0.5:
        files["mask"] = ("mask.png", mask_png(alpha=rng.random() < 0.5))
    if rng.random() < 0.2:
        fields["loras"] = json.dumps([{"name": "shapes-style", "scale": 0.5}])
    if rng.random() < 0.3:
        fields["strength"] = rng.choice(["0.5", "1", "0.9"])
    done = []
    for _ in range(rng.randint(1, 3)):
        kind = rng.choice(["drop", "field", "image", "mask", "loras", "strength", "unknown", "size"])
        if kind == "drop":
            pool = sorted(fields) + sorted(files)
            name = rng.choice(pool)
            fields.pop(name, None)
            files.pop(name, None)
            done.append(f"drop {name}")
        elif kind == "field" and fields:
            name = rng.choice(sorted(fields))
            fields[name] = str(rng.choice(NUMBERS + STRINGS))
            done.append(f"{name}={fields[name]!r:.40}")
        elif kind in ("image", "mask"):
            data = files.get(kind, (f"{kind}.png", png()))[1]
            how = rng.choice(["cut", "flip", "bomb", "empty", "text", "wide", "tall", "tiny", "black", "gray",
                              "rgba", "same aspect", "jpeg"])
            data = {"cut": lambda: cut(data, rng), "flip": lambda: flip(data, rng), "bomb": bomb_png,
                    "empty": lambda: b"", "text": lambda: b"not an image at all",
                    "wide": lambda: mask_png((64, 32)), "tall": lambda: mask_png((16, 64)),
                    "tiny": lambda: png((1, 1)), "black": lambda: png((32, 32), (0, 0, 0)),
                    "gray": lambda: png((32, 32), (128, 128, 128), "L"), "rgba": lambda: png((32, 32), mode="RGBA"),
                    "same aspect": lambda: mask_png((64, 64)), "jpeg": lambda: jpeg()}[how]()
            files[kind] = (rng.choice([f"{kind}.png", "", "../x.png", "a\u0000b.png"]), data)
            done.append(f"{kind} {how}")
        elif kind == "loras":
            choice = rng.choice(LORA_LISTS)
            fields["loras"] = rng.choice([json.dumps(choice), str(choice), "[{", ""])
            done.append(f"loras={fields['loras']!r:.60}")
        elif kind == "strength":
            fields["strength"] = rng.choice(["0", "1", "0.5", "2", "-1", "nan", "inf", "abc", ""])
            done.append(f"strength={fields['strength']!r}")
        elif kind == "unknown":
            fields[rng.choice(["scheduler", "nope", "mask_blur", "guidance", "negative_prompt", "n", "model",
                               "response_format"])] = str(rng.choice(NUMBERS + STRINGS))
            done.append("a field added")
        elif kind == "size":
            fields["size"] = rng.choice(SIZES)
            done.append(f"size={fields['size']!r}")
    cheap_form(fields)
    body, kind = multipart(fields, files)
    r = rng.random()
    if r < 0.05:
        body, what = cut(body, rng), "cut"
    elif r < 0.1:
        body, what = flip(body, rng), "flipped"
    elif r < 0.13:
        kind, what = "multipart/form-data; boundary=other", "another boundary"
    elif r < 0.15:
        kind, what = "multipart/form-data", "no boundary"
    else:
        what = None
    if what:
        done.append(f"body {what}")
    return {"route": rng.choice(ROUTES_FORM), "body": body, "type": kind, "done": done}


def cheap_form(fields):
    steps, n = fields.get("steps"), fields.get("n")
    if steps is not None and steps.isdigit() and 2 < int(steps) <= 1000:
        fields["steps"] = "2"
    if n is not None and n.isdigit() and 2 < int(n) <= 16:
        fields["n"] = "2"
    size = fields.get("size", "auto")
    parts = size.split("x")
    if len(parts) == 2 and all(p.isdigit() and p.isascii() for p in parts) and max(map(int, parts)) > 64:
        fields["size"] = "32x32"
    if "steps" not in fields:
        fields["steps"] = "1"


def jpeg() -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (32, 32), (10, 200, 10)).save(out, "JPEG")
    return out.getvalue()


def route_mutant(rng, k, known) -> dict:
    """A job route with a random or known id, index, method."""
    job = rng.choice(known) if known and rng.random() < 0.6 else rng.choice(
        ["nope", "", "0" * 16, "%00", "..", "a" * 5000, "../../etc/passwd", "%2e%2e"])
    path = rng.choice([f"/v1/jobs/{job}", f"/v1/jobs/{job}/cancel", f"/v1/jobs/{job}/events",
                       f"/v1/jobs/{job}/images/{rng.choice(['0', '1', '-1', '99', 'x', '1e9', '00'])}.png",
                       "/v1/models", "/v1/jobs", "/v1/page-config", "/", "/static/app.js", "/static/../app.py",
                       "/v1/nope"])
    method = rng.choice(["GET", "GET", "POST", "DELETE", "PUT"])
    return {"route": path, "body": b"" if method in ("POST", "PUT") else None, "type": "application/json",
            "method": method, "done": [f"{method} {path[:60]}"]}


def mutant(seed, k, known):
    rng = random.Random(seed * 1_000_003 + k)
    r = rng.random()
    if r < 0.5:
        return json_mutant(rng, k)
    if r < 0.85:
        return form_mutant(rng, k)
    return route_mutant(rng, k, known)


# -- sending and judging --------------------------------------------------------------------------------------------
def send(base, m, timeout):
    """(status, content type, body bytes); status None for no answer (the reason as the body)."""
    request = urllib.request.Request(base + m["route"], data=m["body"], method=m.get("method", "POST"),
                                     headers={"Content-Type": m["type"]} if m["type"] else {})
    if not m["type"]:
        request.remove_header("Content-type")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            if "event-stream" in response.headers.get("content-type", ""):
                return response.status, "text/event-stream", response.read(1 << 16)
            return response.status, response.headers.get("content-type", ""), response.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("content-type", ""), e.read()
    except TimeoutError as e:
        return "hang", "", repr(e).encode()
    except (urllib.error.URLError, ConnectionError, OSError) as e:
        return None, "", repr(e).encode()


def judge(base, m, status, kind, body, timeout, known) -> str:
    if status == "hang":
        return "hang"
    if status is None:
        return "dead"
    text = body.decode("utf-8", "replace")
    if "Traceback (most recent call last)" in text or 'File "/' in text:
        return "traceback"
    if status >= 500:
        return "5xx"
    if status >= 400:
        if "json" not in kind:
            return "not JSON"
        try:
            error = json.loads(body)["error"]
            assert isinstance(error["message"], str) and error["message"]
        except (ValueError, KeyError, TypeError, AssertionError):
            return "not JSON"
        return "refused, field named" if error.get("field") is not None else "refused, no field"
    if "json" in kind and m["route"] in ROUTES_JSON + ROUTES_FORM:
        answer = json.loads(body)
        if status == 202:                       # a job: followed to its end
            known.append(answer["id"])
            last = events(base, answer["id"], timeout=timeout)[-1]
            if last[0] == "error" and last[1].get("status", 500) >= 500:
                return "5xx"
            if last[0] not in ("done", "error", "cancelled"):
                return "hang"
        else:
            for item in answer["data"]:
                if "b64_json" in item:
                    Image.open(io.BytesIO(base64.b64decode(item["b64_json"]))).verify()
    return "served"


def alive(base, timeout) -> bool:
    try:
        with urllib.request.urlopen(base + "/v1/models", timeout=timeout) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def fuzz(base, n, seed, timeout=120, only=None, log=None) -> dict:
    """Mutants 0..n-1 of `seed` (or the one `only`) sent to the server at `base`; the classes counted."""
    counts, bad, known, slowest, unnamed = Counter(), [], [], 0.0, Counter()
    start = time.monotonic()
    for k in ([only] if only is not None else range(n)):
        m = mutant(seed, k, known)
        t = time.monotonic()
        status, kind, body = send(base, m, timeout)
        outcome = judge(base, m, status, kind, body, timeout, known)
        if outcome not in ("dead", "hang") and not alive(base, timeout):
            outcome = "dead"
        slowest = max(slowest, time.monotonic() - t)
        counts[outcome] += 1
        if outcome == "refused, no field":      # which answers name no field: the route's, by status and kind
            unnamed[f"{status} {m.get('method', 'POST')} {route_kind(m['route'])}"] += 1
        if outcome in UNACCEPTABLE:
            bad.append({"k": k, "outcome": outcome, "done": m["done"], "route": m["route"], "status": status,
                        "answer": body[:500].decode("utf-8", "replace")})
        if only is not None or (log and outcome in UNACCEPTABLE):
            print(f"mutant {k}: {m.get('method', 'POST')} {m['route']} {m['done']} -> {status} {outcome}: "
                  f"{body[:300]!r}", file=log or sys.stdout, flush=True)
        if outcome == "dead":
            break
    return {"n": sum(counts.values()), "seed": seed, "counts": dict(counts),
            "unacceptable": sum(counts[c] for c in UNACCEPTABLE), "failures": bad, "no_field": dict(unnamed),
            "wall_s": round(time.monotonic() - start, 1), "slowest_s": round(slowest, 2)}


UNACCEPTABLE = ("5xx", "traceback", "not JSON", "dead", "hang")


def route_kind(path) -> str:
    """A path with its job id and image index left out: /v1/jobs/{id}/images/{k}.png."""
    parts = path.split("/")
    if len(parts) > 3 and parts[2] == "jobs" and parts[3] not in ("edits", ""):
        parts[3] = "{id}"
        if len(parts) > 5 and parts[4] == "images":
            parts[5] = "{k}.png"
    return "/".join(parts)[:40]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=2000)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--only", type=int, default=None, help="replay mutant ONLY of the seed, printing it")
    p.add_argument("--timeout", type=float, default=120, help="seconds a request may take")
    p.add_argument("--json", default=None, help="write the result here")
    args = p.parse_args(argv)
    pipe = mlxdiff.load(str(default_model.folder()), keep="auto")
    lora = shapes_lora(Path(tempfile.mkdtemp(prefix="fuzz-server-")) / "shapes-style.safetensors")
    with running_server(pipe, loras={"shapes-style": str(lora)}, max_upload_mb=UPLOAD_MB) as (base, _):
        result = fuzz(base, args.n, args.seed, args.timeout, args.only, log=sys.stdout)
    print(json.dumps({k: v for k, v in result.items() if k != "failures"}, indent=1))
    for failure in result["failures"][:20]:
        print(failure)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0 if result["unacceptable"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
