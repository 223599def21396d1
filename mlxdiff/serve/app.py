"""The server's routes (FastAPI: the request bodies are pydantic models, so that every field is validated, and a bad
one named, before a job exists, and /docs shows the OpenAPI schema for free; uvicorn serves it).

  POST /v1/images/generations   OpenAI's images API: prompt, n, size "WxH", response_format b64_json | url, seed,
                                and mlxdiff's own fields (negative_prompt, steps, guidance, cache, the family's
                                generate() options); waits for the images
  POST /v1/images/edits         multipart: image, mask (inpainting families), prompt, strength, ...
  GET  /v1/models               the loaded model, with what its family takes (image, mask, LoRAs, options)
  POST /v1/jobs, POST /v1/jobs/edits (multipart, as /v1/images/edits), GET /v1/jobs, GET /v1/jobs/{id},
                                POST /v1/jobs/{id}/cancel, GET /v1/jobs/{id}/events (server-sent events),
                                GET /v1/jobs/{id}/images/{k}.png
  GET  /                        the web page (static/)

Every error is JSON: {"error": {"message", "field", "param" (OpenAI's name for the field), "type"}}, 4xx for the
request's fault (an MlxdiffError from the pipeline: 400 with its line; a body past its route's size cap: 413),
5xx for the server's.
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

from fastapi import Depends, FastAPI, File, Form, Request, UploadFile
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from PIL import Image
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..arguments import MAX_SEED, check_generate, check_images, check_number
from ..errors import MlxdiffError
from ..pipelines.image_inputs import aspect_note
from .jobs import Job, JobQueue, QueueFull

STATIC = Path(__file__).parent / "static"
MAX_N = 16                      # images in one request (OpenAI's API allows 10)
MAX_UPLOAD_MB = 64              # a multipart request (image and mask) at most, by default: a 4096x4096 PNG is ~50 MB
JSON_BYTES = 1 << 20            # a JSON request at most: prompts and numbers, a few kB
MAX_LORAS = 8                   # LoRAs in one request
UPLOAD_ROUTES = ("/v1/images/edits", "/v1/jobs/edits")     # capped at --max-upload-mb; the rest at JSON_BYTES
NOT_JSON_OPTIONS = ("mask", "image_noise")    # a file or an array: the edits endpoint uploads a mask; no noise
EVENT_POLL = 0.05               # seconds between looks at a job's events


class FieldError(Exception):
    def __init__(self, field, message, status=400):
        super().__init__(message)
        self.field, self.status = field, status


class LoraChoice(BaseModel):
    """One of the server's LoRAs (python -m mlxdiff.serve --lora FILE: named by the file's stem) at a scale."""
    model_config = ConfigDict(extra="forbid")
    name: str
    scale: float = 1.0


LORA_LIST = TypeAdapter(list[LoraChoice])


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
    loras: list[LoraChoice] | None = Field(None, max_length=MAX_LORAS)
    model: str | None = None      # OpenAI clients send it: the served model's id (GET /v1/models), or left out
    user: str | None = None
    quality: str | None = None
    style: str | None = None


def error_body(message, field=None, kind="invalid_request_error") -> dict:
    return {"error": {"message": message, "field": field, "param": field, "type": kind}}


class BodyTooLarge(StarletteHTTPException):
    """A request body past its route's cap (an HTTPException, so that FastAPI's body parsing passes it on)."""
    def __init__(self, limit, path):
        how = ("start the server with a larger --max-upload-mb" if path in UPLOAD_ROUTES else
               "send images as multipart uploads (/v1/images/edits)")
        super().__init__(413, f"body: the request is larger than this server's limit of {limit / (1 << 20):g} MB "
                              f"for {path}; send less, or {how}")


class BodyCap:
    """ASGI middleware: a body past its route's cap refused with a JSON 413, on its declared length before any of
    it is read (a client waiting for 100 Continue sends none), else once the bytes read pass the cap. (Starlette's
    RequestBodyLimitMiddleware answers a declared length in plain text, replacing any JSON error, hence this.)"""

    def __init__(self, app, upload_bytes):
        self.app, self.upload_bytes = app, upload_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.upload_bytes if scope["path"] in UPLOAD_ROUTES else JSON_BYTES
        length = Headers(scope=scope).get("content-length", "")
        if length.isdigit() and int(length) > limit:
            exc = BodyTooLarge(limit, scope["path"])
            response = JSONResponse(error_body(exc.detail, "body"), status_code=413, headers={"Connection": "close"})
            return await response(scope, receive, send)
        read = 0

        async def counted():
            nonlocal read
            message = await receive()
            read += len(message.get("body", b""))
            if read > limit:
                raise BodyTooLarge(limit, scope["path"])
            return message
        await self.app(scope, counted, send)


def takes_image(pipe) -> bool:
    """Whether the family takes an image (an init image with a strength, or references without): its own
    check_images asked, so no family is named here."""
    probe = [Image.new("RGB", (64, 64))]
    for strength in (None, 0.5):
        try:
            pipe.check_images(["image"], probe, strength)
            return True
        except MlxdiffError:
            pass
    return False


def family_takes(pipe, loras) -> dict:
    """What a request may give this model: from the pipeline's OPTIONS and hooks (the page shows these inputs)."""
    return {"image": takes_image(pipe), "mask": "mask" in pipe.OPTIONS, "loras": sorted(loras),
            "options": [o for o in pipe.OPTIONS if o not in NOT_JSON_OPTIONS]}


def create_app(pipe, model_name: str, api_key: str | None = None, loras: dict | None = None,
               max_upload_mb: float = MAX_UPLOAD_MB) -> FastAPI:
    """The app over a loaded pipeline (kept loaded between requests as its `keep` says) and its job queue.
    `loras`: {name: file} the requests may choose from (checked against the model by the caller); `max_upload_mb`:
    the size cap of a multipart request (a JSON one is capped at JSON_BYTES)."""
    queue = JobQueue(pipe, model_name)
    loras = dict(loras or {})
    upload_bytes = int(max_upload_mb * (1 << 20))
    takes = family_takes(pipe, loras)

    @asynccontextmanager
    async def lifespan(app):
        yield
        await asyncio.to_thread(queue.stop)
        # FastAPI keeps each app's endpoints (closures over the queue, which reach the pipeline as queue.pipe) in a
        # process-wide cache, so an app outlives its server: what the pipeline kept loaded is freed here, and the
        # queue lets go of the pipeline, instead of with the app
        released, queue.pipe = queue.pipe, None
        released.release()

    app = FastAPI(title="mlxdiff", description="MLX-native image generation: OpenAI's images API and a job API",
                  lifespan=lifespan)
    app.add_middleware(BodyCap, upload_bytes=upload_bytes)
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

    @app.exception_handler(StarletteHTTPException)    # FastAPI's and Starlette's (a 404, BodyTooLarge)
    async def http_error(request, exc):
        if isinstance(exc, BodyTooLarge):
            return JSONResponse(error_body(str(exc.detail), "body"), status_code=413)
        if exc.status_code == 400:       # FastAPI's and Starlette's body parsing (not JSON text, a broken form)
            form = request.url.path in UPLOAD_ROUTES
            return JSONResponse(error_body(f"body: {exc.detail}; send {'a multipart form' if form else 'a JSON object'}"
                                           f" of this route's fields (/docs)", "body"), status_code=400)
        return JSONResponse(error_body(f"{request.method} {request.url.path}: {exc.detail}"),
                            status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def server_error(request, exc):
        return JSONResponse(error_body(f"{type(exc).__name__}: {exc}", kind="server_error"), status_code=500)

    def make_job(body: dict, images=None, mask=None, strength=None, names=()) -> Job:
        """A checked job from a request's fields: each one against mlxdiff's own rules (arguments.RULES, the
        family's OPTIONS and sizes), so that a bad one is refused with its name before it is queued."""
        extras = {k: v for k, v in body.pop("extras").items()}
        if body.get("model") not in (None, model_name):
            raise FieldError("model", f"model {body['model']!r}: this server serves {model_name!r} only (GET "
                                      "/v1/models); give that or leave the model out")
        chosen = choose_loras(body.get("loras"))
        width, height = parse_size(body["size"])
        fields = {"prompt": body["prompt"], "negative_prompt": body["negative_prompt"], "steps": body["steps"],
                  "guidance": body["guidance"], "seed": body["seed"], "width": width, "height": height}
        for name, value in {**fields, **extras}.items():
            try:
                check_generate(**{name: value})
            except MlxdiffError as e:
                raise FieldError("size" if name in ("width", "height") else name, str(e)) from None
        for name in extras:
            if name not in queue.pipe.OPTIONS or name in NOT_JSON_OPTIONS:
                shown = name if name.isidentifier() else repr(name)
                raise FieldError(name, f"{shown}: not a field of this API for {queue.pipe.title} models (its options: "
                                       f"{', '.join(o for o in queue.pipe.OPTIONS if o not in NOT_JSON_OPTIONS)})")
        try:
            width, height, steps, guidance = queue.pipe.request(width, height, body["steps"], body["guidance"])
        except MlxdiffError as e:
            raise FieldError("size", str(e)) from None
        try:
            queue.pipe.family_options(dict(extras))      # the sampler's name, against the family's kind
        except MlxdiffError as e:
            raise FieldError("scheduler", str(e)) from None
        if body["cache"] is not None:
            try:
                queue.pipe.new_step_cache(body["cache"])
            except MlxdiffError as e:
                raise FieldError("cache", str(e)) from None
        seed = secrets.randbelow(1 << 32) if body["seed"] is None else body["seed"]
        if seed + body["n"] - 1 > MAX_SEED:
            raise FieldError("seed", f"seed {seed} with n={body['n']}: the seeds S..S+n-1 pass {MAX_SEED}")
        options = dict(negative_prompt=body["negative_prompt"], width=width, height=height, steps=steps,
                       guidance=guidance, **extras, **({"cache": body["cache"]} if body["cache"] else {}))
        if images:
            options.update(image=images, strength=strength, **({"mask": mask} if mask is not None else {}))
            if strength is None or mask is not None or queue.pipe.SIZE_OF_IMAGE:   # the image sets the size (the CLI's)
                options.update(width=None if body["size"] in (None, "auto") else width,
                               height=None if body["size"] in (None, "auto") else height)
        parameters = {"negative_prompt": body["negative_prompt"] or "", "model": model_name, "steps": steps,
                      "guidance": guidance, **{k: v for k, v in extras.items()},
                      **({"loras": ", ".join(f"{c['name']}:{c['scale']:g}" for c in body["loras"])} if chosen else {}),
                      **dict(zip(("image", "mask"), names)), **({"strength": strength} if strength is not None else {}),
                      "generator": "mlxdiff server"}
        return Job(body["prompt"], [seed + k for k in range(body["n"])], options, parameters,
                   loras=tuple((loras[c["name"]], c["scale"]) for c in body["loras"] or ()), given=tuple(extras))

    def choose_loras(chosen) -> bool:
        """The request's LoRAs: names the server offers, scales by mlxdiff's rule (arguments.RULES)."""
        for choice in chosen or ():
            if choice["name"] not in loras:
                offered = ", ".join(sorted(loras)) or "none"
                raise FieldError("loras", f"loras: no LoRA named {choice['name']!r} on this server (it offers: "
                                          f"{offered}); start it with --lora FILE to offer one")
            try:
                check_number("lora_scale", choice["scale"])
            except MlxdiffError as e:
                raise FieldError("loras", f"loras: {choice['name']}: {e}") from None
        return bool(chosen)

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
            raise FieldError(error.get("field"), error["message"], error["status"])
        data = [{"b64_json": base64.b64encode(png).decode()} if response_format == "b64_json" else
                {"url": f"/v1/jobs/{job.id}/images/{k}.png"} for k, png in enumerate(job.images)]
        for item, seed in zip(data, job.seeds):
            item["seed"] = seed
        return {"created": int(job.created), "data": data}

    def request_fields(req: GenerationRequest) -> dict:
        """The declared fields, and under "extras" the others (the family's options, or unknown: make_job says)."""
        extras = dict(req.model_extra or {})
        body = req.model_dump(exclude={"user", "quality", "style", *extras})
        body["extras"] = extras
        return body

    @app.post("/v1/images/generations", dependencies=v1)
    async def generations(req: GenerationRequest):
        job = submit(make_job(request_fields(req)))
        return await images_response(job, req.response_format)

    async def edit_job(image: UploadFile = File(...), prompt: str = Form(..., min_length=1),
                       mask: UploadFile | None = File(None), n: int = Form(1, ge=1, le=MAX_N),
                       size: str | None = Form(None, pattern=r"^(auto|\d{1,6}x\d{1,6})$"),
                       response_format: Literal["b64_json", "url"] = Form("b64_json"),
                       seed: int | None = Form(None, ge=0, le=MAX_SEED), negative_prompt: str | None = Form(None),
                       steps: int | None = Form(None), guidance: float | None = Form(None),
                       strength: float | None = Form(None), model: str | None = Form(None),
                       loras: str | None = Form(None, description='JSON: [{"name": ..., "scale": ...}]')):
        """The edits form (OpenAI's multipart fields and mlxdiff's) -> (a checked, submitted job, response_format)."""
        if not takes["image"]:
            raise FieldError("image", f"image: {queue.pipe.title} models take no image (text-to-image only); use "
                                      "/v1/images/generations")
        if mask is not None and not takes["mask"]:
            raise FieldError("mask", f"mask: {queue.pipe.title} models do not inpaint; leave the mask out")
        try:
            check_number("strength", strength)
        except MlxdiffError as e:
            raise FieldError("strength", str(e)) from None
        chosen = None
        if loras:
            try:
                chosen = [c.model_dump() for c in LORA_LIST.validate_json(loras)]
            except ValidationError as e:
                raise FieldError("loras", f"loras: {e.errors()[0]['msg']}; give a JSON list of "
                                          '{"name": ..., "scale": ...}') from None
            if len(chosen) > MAX_LORAS:
                raise FieldError("loras", f"loras: {len(chosen)} LoRAs; give at most {MAX_LORAS}")
        with tempfile.TemporaryDirectory(prefix="mlxdiff-serve-") as folder:
            images = await uploaded("image", image, folder, strength)
            masks = await uploaded("mask", mask, folder, None, alpha_mask=True) if mask is not None else None
        if masks is not None:
            note = aspect_note(mask.filename or "mask", masks[0], image.filename or "image", images[0])
            if note:       # the library stretches it (as diffusers); OpenAI's API wants the image's dimensions
                raise FieldError("mask", note.split(":")[0] + ": another aspect ratio than the image; give a mask "
                                 "of the image's size")
        try:
            queue.pipe.check_images(["image"], images, strength)
        except MlxdiffError as e:
            raise FieldError("image", str(e)) from None
        body = {"prompt": prompt, "n": n, "size": size, "seed": seed, "negative_prompt": negative_prompt,
                "steps": steps, "guidance": guidance, "cache": None, "model": model, "loras": chosen, "extras": {}}
        if strength is None and images:
            strength = queue.pipe.default_strength({"mask": masks[0]} if masks else {})
        names = [image.filename or "image"] + ([mask.filename or "mask"] if masks else [])
        return submit(make_job(body, images, masks[0] if masks else None, strength, names)), response_format

    @app.post("/v1/images/edits", dependencies=v1)
    async def edits(edit=Depends(edit_job)):
        job, response_format = edit
        return await images_response(job, response_format)

    @app.post("/v1/jobs/edits", dependencies=v1, status_code=202)
    async def create_edit_job(edit=Depends(edit_job)):
        """The page's edits: the job at once, as POST /v1/jobs."""
        return edit[0].public()

    @app.get("/v1/models", dependencies=v1)
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": int(time.time()),
                                            "owned_by": "mlxdiff", "family": queue.pipe.title, "takes": takes}]}

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
        steps_guidance = queue.pipe.defaults()
        return {"model": model_name, "family": queue.pipe.title, "size": queue.pipe.default_size(),
                "steps": steps_guidance["steps"], "guidance": steps_guidance["guidance"],
                "api_key": api_key is not None, "inpaints": takes["mask"], "takes": takes,
                "max_upload_mb": upload_bytes / (1 << 20)}

    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    return app


def parse_size(size):
    """"WxH" -> (W, H); None or "auto" -> (None, None): the model's default (or the image's, for edits)."""
    if size in (None, "auto"):
        return None, None
    width, height = size.split("x")
    return int(width), int(height)


async def uploaded(name, upload: UploadFile, folder, strength, alpha_mask=False) -> list:
    """An uploaded image (its size bounded by the route's body limit), through mlxdiff's own image checks
    (arguments.check_images: the decoded size bounded); an OpenAI mask's transparent pixels (where to edit) become
    white (mlxdiff's: repaint)."""
    data = await upload.read()
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
