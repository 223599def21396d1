"""The server's routes (FastAPI: the request bodies are pydantic models, so that every field is validated, and a bad
one named, before a job exists, and /docs shows the OpenAPI schema for free; uvicorn serves it).

  POST /v1/images/generations   OpenAI's images API: prompt, n, size "WxH", response_format b64_json | url, seed,
                                and mlxdiff's own fields (negative_prompt, steps, guidance, cache, the family's
                                generate() options); waits for the images
  POST /v1/images/edits         multipart: image, mask (inpainting families), prompt, strength, ...
  GET  /v1/models               the loaded model
  POST /v1/jobs, GET /v1/jobs, GET /v1/jobs/{id}, POST /v1/jobs/{id}/cancel, GET /v1/jobs/{id}/events (server-sent
                                events), GET /v1/jobs/{id}/images/{k}.png
  GET  /                        the web page (static/)

Every error is JSON: {"error": {"message", "field", "param" (OpenAI's name for the field), "type"}}, 4xx for the
request's fault (an MlxdiffError from the pipeline: 400 with its line), 5xx for the server's.
"""

import asyncio
import base64
import json
import secrets
import tempfile
import time
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Literal

from fastapi import Depends, FastAPI, File, Form, HTTPException, Request, UploadFile
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel, ConfigDict, Field

from ..arguments import MAX_SEED, check_generate, check_images
from ..errors import MlxdiffError
from .jobs import Job, JobQueue, QueueFull

STATIC = Path(__file__).parent / "static"
MAX_N = 16                      # images in one request (OpenAI's API allows 10)
UPLOAD_BYTES = 32 << 20         # an uploaded image or mask at most
NOT_JSON_OPTIONS = ("mask", "image_noise")    # a file or an array: the edits endpoint uploads a mask; no noise
EVENT_POLL = 0.05               # seconds between looks at a job's events


class FieldError(Exception):
    def __init__(self, field, message, status=400):
        super().__init__(message)
        self.field, self.status = field, status


class GenerationRequest(BaseModel):
    """OpenAI's CreateImageRequest with mlxdiff's fields; any other field is one of the family's generate() options
    (checked against the pipeline's OPTIONS)."""
    model_config = ConfigDict(extra="allow")
    prompt: str = Field(min_length=1)
    n: int = Field(1, ge=1, le=MAX_N)
    size: str | None = Field(None, pattern=r"^(auto|\d{1,6}x\d{1,6})$", description="WxH, e.g. 64x64")
    response_format: Literal["b64_json", "url"] = "b64_json"
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    negative_prompt: str | None = None
    steps: int | None = None
    guidance: float | None = None
    cache: str | None = None
    model: str | None = None      # accepted as OpenAI clients send it; the server has one model
    user: str | None = None
    quality: str | None = None
    style: str | None = None


def error_body(message, field=None, kind="invalid_request_error") -> dict:
    return {"error": {"message": message, "field": field, "param": field, "type": kind}}


def create_app(pipe, model_name: str, api_key: str | None = None) -> FastAPI:
    """The app over a loaded pipeline (kept loaded between requests as its `keep` says) and its job queue."""
    queue = JobQueue(pipe, model_name)

    @asynccontextmanager
    async def lifespan(app):
        yield
        queue.stop()

    app = FastAPI(title="mlxdiff", description="MLX-native image generation: OpenAI's images API and a job API",
                  lifespan=lifespan)
    app.state.queue = queue

    def authorized(request: Request):
        if api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not secrets.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            raise FieldError("authorization", "missing or wrong API key: send 'Authorization: Bearer KEY'", 401)

    v1 = [Depends(authorized)]

    @app.exception_handler(RequestValidationError)
    async def invalid(request, exc):
        first = exc.errors()[0]
        names = [p for p in first.get("loc", ()) if isinstance(p, str) and p not in ("body", "query", "path")]
        field = names[0] if names else "body"
        return JSONResponse(error_body(f"{field}: {first.get('msg', 'invalid')}", field), status_code=400)

    @app.exception_handler(FieldError)
    async def field_error(request, exc):
        return JSONResponse(error_body(str(exc), exc.field), status_code=exc.status)

    @app.exception_handler(HTTPException)
    async def http_error(request, exc):
        return JSONResponse(error_body(str(exc.detail)), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def server_error(request, exc):
        return JSONResponse(error_body(f"{type(exc).__name__}: {exc}", kind="server_error"), status_code=500)

    def make_job(body: dict, images=None, mask=None, strength=None) -> Job:
        """A checked job from a request's fields: each one against mlxdiff's own rules (arguments.RULES, the
        family's OPTIONS and sizes), so that a bad one is refused with its name before it is queued."""
        extras = {k: v for k, v in body.pop("extras").items()}
        width, height = parse_size(body["size"])
        fields = {"prompt": body["prompt"], "negative_prompt": body["negative_prompt"], "steps": body["steps"],
                  "guidance": body["guidance"], "seed": body["seed"], "width": width, "height": height}
        for name, value in {**fields, **extras}.items():
            try:
                check_generate(**{name: value})
            except MlxdiffError as e:
                raise FieldError("size" if name in ("width", "height") else name, str(e)) from None
        for name in extras:
            if name not in pipe.OPTIONS or name in NOT_JSON_OPTIONS:
                raise FieldError(name, f"{name}: not a field of this API for {pipe.title} models (its options: "
                                       f"{', '.join(o for o in pipe.OPTIONS if o not in NOT_JSON_OPTIONS)})")
        try:
            width, height, steps, guidance = pipe.request(width, height, body["steps"], body["guidance"])
        except MlxdiffError as e:
            raise FieldError("size", str(e)) from None
        try:
            pipe.family_options(dict(extras))      # the sampler's name, against the family's kind
        except MlxdiffError as e:
            raise FieldError("scheduler", str(e)) from None
        if body["cache"] is not None:
            try:
                pipe.new_step_cache(body["cache"])
            except MlxdiffError as e:
                raise FieldError("cache", str(e)) from None
        seed = secrets.randbelow(1 << 32) if body["seed"] is None else body["seed"]
        if seed + body["n"] - 1 > MAX_SEED:
            raise FieldError("seed", f"seed {seed} with n={body['n']}: the seeds S..S+n-1 pass {MAX_SEED}")
        options = dict(negative_prompt=body["negative_prompt"], width=width, height=height, steps=steps,
                       guidance=guidance, **extras, **({"cache": body["cache"]} if body["cache"] else {}))
        if images:
            options.update(image=images, strength=strength, **({"mask": mask} if mask is not None else {}))
            if strength is None or mask is not None or pipe.SIZE_OF_IMAGE:   # the image sets the size (as the CLI)
                options.update(width=None if body["size"] in (None, "auto") else width,
                               height=None if body["size"] in (None, "auto") else height)
        parameters = {"negative_prompt": body["negative_prompt"] or "", "model": model_name, "steps": steps,
                      "guidance": guidance, **{k: v for k, v in extras.items()}, "generator": "mlxdiff server"}
        return Job(body["prompt"], [seed + k for k in range(body["n"])], options, parameters)

    def submit(job: Job) -> Job:
        try:
            return queue.submit(job)
        except QueueFull as e:
            raise FieldError(None, str(e), 503) from None

    def job_or_404(job_id) -> Job:
        job = queue.get(job_id)
        if job is None:
            raise FieldError("id", f"no job {job_id!r} (finished jobs are kept for the last {64} only)", 404)
        return job

    async def images_response(job: Job, response_format) -> dict:
        await asyncio.wrap_future(job.finished)
        if job.status != "done":
            error = job.error or {"message": f"job {job.id} was cancelled", "status": 409}
            named = [n for n in ("prompt", "negative_prompt", "image", "mask", "strength", *job.options)
                     if error["message"].startswith(n)]      # a pipeline's line starts with what it refuses
            raise FieldError(error.get("field") or (named[0] if named else None), error["message"], error["status"])
        data = [{"b64_json": base64.b64encode(png).decode()} if response_format == "b64_json" else
                {"url": f"/v1/jobs/{job.id}/images/{k}.png"} for k, png in enumerate(job.images)]
        for item, seed in zip(data, job.seeds):
            item["seed"] = seed
        return {"created": int(job.created), "data": data}

    def request_fields(req: GenerationRequest) -> dict:
        body = req.model_dump(exclude={"model", "user", "quality", "style"})
        body["extras"] = dict(req.model_extra or {})
        for name in list(body["extras"]):
            body.pop(name, None)
        return body

    @app.post("/v1/images/generations", dependencies=v1)
    async def generations(req: GenerationRequest):
        job = submit(make_job(request_fields(req)))
        return await images_response(job, req.response_format)

    @app.post("/v1/images/edits", dependencies=v1)
    async def edits(image: UploadFile = File(...), prompt: str = Form(..., min_length=1),
                    mask: UploadFile | None = File(None), n: int = Form(1, ge=1, le=MAX_N),
                    size: str | None = Form(None, pattern=r"^(auto|\d{1,6}x\d{1,6})$"),
                    response_format: Literal["b64_json", "url"] = Form("b64_json"),
                    seed: int | None = Form(None, ge=0, le=MAX_SEED), negative_prompt: str | None = Form(None),
                    steps: int | None = Form(None), guidance: float | None = Form(None),
                    strength: float | None = Form(None), model: str | None = Form(None)):
        with tempfile.TemporaryDirectory(prefix="mlxdiff-serve-") as folder:
            images = await uploaded("image", image, folder, strength)
            masks = await uploaded("mask", mask, folder, None, alpha_mask=True) if mask is not None else None
        if masks is not None and "mask" not in pipe.OPTIONS:
            raise FieldError("mask", f"mask: {pipe.title} models do not inpaint; leave the mask out")
        try:
            pipe.check_images(["image"], images, strength)
        except MlxdiffError as e:
            raise FieldError("image", str(e)) from None
        body = {"prompt": prompt, "n": n, "size": size, "seed": seed, "negative_prompt": negative_prompt,
                "steps": steps, "guidance": guidance, "cache": None, "extras": {}}
        if strength is None and images:
            strength = pipe.default_strength({"mask": masks[0]} if masks else {})
        job = submit(make_job(body, images, masks[0] if masks else None, strength))
        return await images_response(job, response_format)

    @app.get("/v1/models", dependencies=v1)
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": int(time.time()),
                                            "owned_by": "mlxdiff", "family": pipe.title}]}

    @app.post("/v1/jobs", dependencies=v1, status_code=202)
    async def create_job(req: GenerationRequest):
        return submit(make_job(request_fields(req))).public()

    @app.get("/v1/jobs", dependencies=v1)
    async def list_jobs():
        return {"object": "list", "data": [job.public() for job in queue.list()]}

    @app.get("/v1/jobs/{job_id}", dependencies=v1)
    async def get_job(job_id: str):
        return job_or_404(job_id).public()

    @app.post("/v1/jobs/{job_id}/cancel", dependencies=v1)
    async def cancel_job(job_id: str):
        return queue.cancel(job_or_404(job_id)).public()

    @app.get("/v1/jobs/{job_id}/images/{index}.png", dependencies=v1)
    async def job_image(job_id: str, index: int):
        job = job_or_404(job_id)
        if not 0 <= index < len(job.images):
            raise FieldError("index", f"job {job_id} has {len(job.images)} images", 404)
        return Response(job.images[index], media_type="image/png")

    @app.get("/v1/jobs/{job_id}/events", dependencies=v1)
    async def job_events(job_id: str):
        job = job_or_404(job_id)

        async def stream():
            sent = 0
            while True:
                events = job.events[sent:]
                for name, data in events:
                    yield f"event: {name}\ndata: {json.dumps(data)}\n\n"
                sent += len(events)
                if not events and job.status in ("done", "error", "cancelled") and sent == len(job.events):
                    return
                await asyncio.sleep(EVENT_POLL)
        return StreamingResponse(stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    @app.get("/", include_in_schema=False)
    async def page():
        return FileResponse(STATIC / "index.html")

    @app.get("/v1/page-config", include_in_schema=False)
    async def page_config():
        """What the page fills its form with (no key needed: it says nothing the API would not)."""
        steps_guidance = pipe.defaults()
        return {"model": model_name, "family": pipe.title, "size": pipe.default_size(),
                "steps": steps_guidance["steps"], "guidance": steps_guidance["guidance"],
                "api_key": api_key is not None, "inpaints": "mask" in pipe.OPTIONS}

    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    return app


def parse_size(size):
    """"WxH" -> (W, H); None or "auto" -> (None, None): the model's default (or the image's, for edits)."""
    if size in (None, "auto"):
        return None, None
    width, height = size.split("x")
    return int(width), int(height)


async def uploaded(name, upload: UploadFile, folder, strength, alpha_mask=False) -> list:
    """An uploaded image, through mlxdiff's own image checks (arguments.check_images: a bounded read, the decoded
    size bounded); an OpenAI mask's transparent pixels (where to edit) become white (mlxdiff's: repaint)."""
    data = await upload.read(UPLOAD_BYTES + 1)
    if len(data) > UPLOAD_BYTES:
        raise FieldError(name, f"{name}: more than {UPLOAD_BYTES >> 20} MB")
    path = Path(folder) / f"{name}.upload"
    path.write_bytes(data)
    try:
        _, images = check_images([str(path)], strength)
    except MlxdiffError as e:
        raise FieldError(name, f"{name}: {str(e).replace(str(path), upload.filename or name)}") from None
    image = images[0]
    if alpha_mask and image.mode in ("RGBA", "LA"):
        image = image.getchannel("A").point(lambda a: 255 if a == 0 else 0).convert("RGB")
    return [image.copy()]
