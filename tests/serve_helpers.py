"""The server as its tests run it: mlxdiff.serve's app under a real uvicorn on 127.0.0.1 at a free port, in a thread
of the test process (so that the tests can read its memory), and stdlib HTTP calls to it."""

import gc
import glob
import http.client
import json
import socket
import threading
import time
import urllib.error
import urllib.request
from contextlib import contextmanager

import uvicorn
from safetensors import safe_open

from lora_helpers import ROOT, peft_tensors, save, targeted
from mlxdiff.serve.app import create_app


@contextmanager
def running_server(pipe, model_name="klein-shapes", api_key=None, **options):
    """Yields (base URL, app); the server stops on leaving. `options`: create_app's (loras, max_upload_mb)."""
    app = create_app(pipe, model_name, api_key, **options)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", app
    finally:
        server.should_exit = True
        thread.join(40)
        sock.close()
        # the next test in this process measures MLX memory: no server, worker or job of this one may outlive it
        assert not thread.is_alive() and not app.state.queue.worker.is_alive(), "the server did not stop"
        gc.collect()


def call(base, path, body=None, method=None, headers=None, raw=None, timeout=60):
    """(status, parsed JSON or bytes) of one request; an HTTP error status is returned, not raised."""
    data = raw if raw is not None else None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(base + path, data=data, method=method or ("POST" if data else "GET"),
                                     headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            status, payload, kind = response.status, response.read(), response.headers.get("content-type", "")
    except urllib.error.HTTPError as e:
        status, payload, kind = e.code, e.read(), e.headers.get("content-type", "")
    return status, json.loads(payload) if "json" in kind else payload


def events(base, job_id, timeout=60) -> list:
    """A job's server-sent events, (name, data) in order, until the stream ends."""
    out, name = [], None
    with urllib.request.urlopen(f"{base}/v1/jobs/{job_id}/events", timeout=timeout) as response:
        for line in response:
            line = line.decode().rstrip("\n")
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                out.append((name, json.loads(line[len("data: "):])))
    return out


def shapes_lora(path, seed=0):
    """A PEFT LoRA (diffusers' names, no metadata) on the embedded default model's attention and MLP layers, its
    layers' shapes read from the transformer's own file (no torch), seeded: enough to move its images."""
    (weights,) = glob.glob(str(ROOT / "weights" / "klein-shapes" / "transformer" / "*.safetensors"))
    with safe_open(weights, "np") as f:
        shapes = {k[:-len(".weight")]: tuple(f.get_slice(k).get_shape()) for k in f.keys()
                  if k.endswith(".weight") and len(f.get_slice(k).get_shape()) == 2}
    return save(path, peft_tensors(shapes, targeted(shapes), seed))


def multipart(fields: dict, files: dict) -> tuple:
    """(body bytes, content type) of a multipart/form-data request: text `fields`, `files` {name: (filename,
    bytes)}; hand-made so that the tests (and bench/fuzz_server.py) can send what no client would."""
    boundary = "mlxdiff-test-boundary-7d1f"
    parts = []
    for name, value in fields.items():
        parts.append(f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n{value}\r\n'.encode())
    for name, (filename, data) in files.items():
        parts.append(f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"; filename="{filename}"\r\n'
                     f"Content-Type: image/png\r\n\r\n".encode() + data + b"\r\n")
    return b"".join(parts) + f"--{boundary}--\r\n".encode(), f"multipart/form-data; boundary={boundary}"


def chunked(base, path, chunks, content_type="application/json", timeout=60):
    """(status, parsed JSON) of a POST whose body is sent chunked (no Content-Length: the server counts it)."""
    host, port = base.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        connection.request("POST", path, body=iter(chunks), headers={"Content-Type": content_type},
                           encode_chunked=True)
        response = connection.getresponse()
        payload = response.read()
        return response.status, json.loads(payload) if "json" in response.headers.get("content-type", "") else payload
    finally:
        connection.close()


def declared(base, path, body: bytes, content_type="application/json", timeout=60):
    """(status, parsed JSON) of a POST that declares its length and waits for the server's go-ahead before sending
    the body (Expect: 100-continue, as curl does for large bodies): one the server refuses on its length is answered
    without the body being sent. Only for requests the server refuses (this sends no body)."""
    host, port = base.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        connection.putrequest("POST", path)
        for name, value in (("Content-Type", content_type), ("Content-Length", str(len(body))),
                            ("Expect", "100-continue")):
            connection.putheader(name, value)
        connection.endheaders()
        response = connection.getresponse()
        payload = response.read()
        return response.status, json.loads(payload) if "json" in response.headers.get("content-type", "") else payload
    finally:
        connection.close()
