"""The server as its tests run it: mlxdiff.serve's app under a real uvicorn on 127.0.0.1 at a free port, in a thread
of the test process (so that the tests can read its memory), and stdlib HTTP calls to it."""

import json
import socket
import threading
import time
import urllib.error
import urllib.request
from contextlib import contextmanager

import uvicorn

from mlxdiff.serve.app import create_app


@contextmanager
def running_server(pipe, model_name="klein-shapes", api_key=None):
    """Yields (base URL, app); the server stops on leaving."""
    app = create_app(pipe, model_name, api_key)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
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
        thread.join(10)
        sock.close()


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
