"""The server's queue: jobs run in the order they came, one at a time, on the one loaded pipeline, by one worker
thread (MLX work stays on one thread; the pipeline's kept components and prompt cache serve every request). A job is
n images of one prompt from seeds S..S+n-1, as the CLI's --num-images makes them; its events (per-step progress with
the latest preview, then done / error / cancelled) are what GET /v1/jobs/{id}/events streams."""

import base64
import concurrent.futures
import io
import itertools
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field

from PIL.PngImagePlugin import PngInfo

from ..errors import MlxdiffError
from ..pipelines.base import Cancelled

KEEP_FINISHED = 64      # finished jobs (and their PNGs) kept for GET /v1/jobs and the image URLs; older ones go
MAX_WAITING = 256       # jobs queued at once; past it a request is refused (503) rather than held in memory
FINISHED = ("done", "error", "cancelled")


def png_bytes(image, parameters: dict) -> bytes:
    """A PNG with the parameters in its text chunks, as cli.save_png writes them."""
    info = PngInfo()
    info.add_text("parameters", "; ".join(f"{k}: {v}" for k, v in parameters.items()))
    for k, v in parameters.items():
        info.add_text(f"mlxdiff:{k}", str(v))
    out = io.BytesIO()
    image.save(out, format="PNG", pnginfo=info)
    return out.getvalue()


@dataclass(eq=False)
class Job:
    """One request: what generate() gets (prompt, options) once per seed, and what came of it."""
    prompt: str
    seeds: list
    options: dict                 # generate()'s keywords besides the prompt and seed, checked by the app
    parameters: dict              # what the job reports and its PNGs record (the seed and size added per image)
    loras: tuple = ()             # ((file, scale), ...) on the pipeline while the job runs
    given: tuple = ()             # the family options the request gave (the names of some of options' keys)
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:16])
    created: float = field(default_factory=time.time)
    status: str = "queued"        # queued, running, done, error, cancelled
    step: int = 0                 # denoising steps done of the current image
    total: int = 0
    image: int = 0                # the image being made (0-based)
    images: list = field(default_factory=list)    # PNG bytes
    error: dict | None = None     # {"message", "field", "status"}: the HTTP status the error answers with
    events: list = field(default_factory=list)    # (name, data) in order; only the last progress keeps a preview
    cancel_requested: bool = False
    finished: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)

    def add_event(self, name, data):
        last = self.events[-1] if self.events else None
        if name == "progress" and last is not None and last[0] == "progress":    # memory: one preview a job (a new
            self.events[-1] = (last[0], {k: v for k, v in last[1].items() if k != "preview"})   # dict: one being
        self.events.append((name, data))                                                       # sent is left whole

    def public(self) -> dict:
        """The job as GET /v1/jobs/{id} shows it."""
        return {"id": self.id, "object": "job", "status": self.status, "created": int(self.created),
                "prompt": self.prompt, "seeds": self.seeds, "parameters": self.parameters,
                "progress": {"image": self.image, "images": len(self.seeds), "step": self.step, "steps": self.total},
                "images": [f"/v1/jobs/{self.id}/images/{k}.png" for k in range(len(self.images))],
                "error": self.error}


class JobQueue:
    """Jobs in order, run by one worker thread on `pipe`."""

    def __init__(self, pipe, model_name: str):
        self.pipe, self.model_name = pipe, model_name
        self.jobs = OrderedDict()        # id -> Job, oldest first
        self.lock = threading.Lock()
        self.ready = threading.Condition(self.lock)
        self.waiting = []                # queued jobs, in order
        self.running = None
        self.counter = itertools.count()
        self.stopped = False
        self.loras = ()                  # the LoRAs on the pipeline now (the last job's)
        self.worker = threading.Thread(target=self.work, name="mlxdiff-serve-worker", daemon=True)
        self.worker.start()

    def submit(self, job: Job) -> Job:
        with self.lock:
            if len(self.waiting) >= MAX_WAITING:
                raise QueueFull(f"{MAX_WAITING} jobs are waiting already; try again when some have finished")
            self.jobs[job.id] = job
            self.waiting.append(job)
            job.add_event("queued", {"id": job.id, "position": len(self.waiting)})
            self.ready.notify()
        return job

    def get(self, job_id) -> Job | None:
        with self.lock:
            return self.jobs.get(job_id)

    def list(self) -> list:
        with self.lock:
            return list(self.jobs.values())

    def cancel(self, job: Job) -> Job:
        """A queued job ends now; a running one after its current step (its on_step says stop, and pipe.cancel()
        for a step already under way); a finished one is left as it is."""
        with self.lock:
            job.cancel_requested = job.status not in FINISHED
            if job in self.waiting:
                self.waiting.remove(job)
                self._finish(job, "cancelled")
            elif self.running is job:
                self.pipe.cancel()
        return job

    def stop(self, wait: float = 30.0):
        """No job runs after the server stops: queued ones end cancelled, the running one after its current step,
        and the worker is joined (a daemon thread left computing would hold the pipeline and its memory)."""
        with self.lock:
            self.stopped = True
            for job in self.waiting:
                self._finish(job, "cancelled")
            self.waiting.clear()
            if self.running is not None:
                self.running.cancel_requested = True
                self.pipe.cancel()
            self.ready.notify()
        self.worker.join(wait)

    def work(self):
        while True:
            with self.lock:
                while not self.waiting and not self.stopped:
                    self.ready.wait()
                if self.stopped:
                    return
                job = self.running = self.waiting.pop(0)
                job.status = "running"
                job.add_event("started", {"id": job.id})
            status, error = self.run(job)
            with self.lock:
                self.running = None
                self._finish(job, status, error)

    def run(self, job: Job):
        """(status, error): the job's images made one seed at a time; the worker survives whatever a job raises."""
        try:
            try:
                self.use_loras(job.loras)
            except MlxdiffError as e:
                return "error", {"message": f"loras: {e}", "field": "loras", "status": 400}
            for k, seed in enumerate(job.seeds):
                job.image, job.step = k, 0
                result = self.pipe.generate(job.prompt, seed=seed, progress_bar=False,
                                            on_step=lambda step, k=k: self.on_step(job, k, step), **job.options)
                image = result.image
                job.images.append(png_bytes(image, {"prompt": job.prompt, **job.parameters, "width": image.width,
                                                    "height": image.height, "seed": seed}))
            return "done", None
        except Cancelled:
            return "cancelled", None
        except MlxdiffError as e:
            return "error", {"message": str(e), "field": refused_field(job, str(e)), "status": 400}
        except MemoryError as e:
            return "error", {"message": f"out of memory ({e}); use a smaller size or fewer images, or start the "
                                        "server with a larger --memory-limit", "field": None, "status": 507}
        except Exception as e:          # noqa: BLE001  (a bug must not take the server down: the job says it)
            return "error", {"message": f"{type(e).__name__}: {e}", "field": None, "status": 500}

    def use_loras(self, loras):
        """The job's LoRAs on the pipeline (kept components changed in place), unless they are on already."""
        if loras == self.loras:
            return
        self.loras = None                # unknown until every one is on
        self.pipe.unload_loras()
        for file, scale in loras:
            self.pipe.load_lora(file, scale)
        self.loras = loras

    def on_step(self, job: Job, k: int, step):
        job.step, job.total = step.index + 1, step.total
        preview = io.BytesIO()
        step.preview.save(preview, format="PNG")
        job.add_event("progress", {"image": k, "images": len(job.seeds), "step": step.index + 1,
                                   "steps": step.total, "timestep": step.timestep,
                                   "preview": base64.b64encode(preview.getvalue()).decode()})
        return not job.cancel_requested

    def _finish(self, job: Job, status, error=None):
        """(under the lock) The job's end: its last event, its future, and the oldest finished jobs forgotten."""
        job.status, job.error = status, error
        data = {"id": job.id, "status": status}
        if status == "done":
            data["images"] = job.public()["images"]
        job.add_event(status, error or data)
        if not job.finished.done():
            job.finished.set_result(job)
        done = [j for j in self.jobs.values() if j.status in FINISHED]
        for old in done[:max(0, len(done) - KEEP_FINISHED)]:
            del self.jobs[old.id]


def refused_field(job: Job, message: str) -> str | None:
    """The field a run's refusal is about: the one its line starts with (a pipeline's line starts with what it
    refuses: FLUX.2's "text_encoder_out_layers=[]: expected ..."), else, where the request gave one family option,
    that one (the other fields were checked before the job was queued, so the option is what the pipeline found
    wrong); None where neither says."""
    named = [n for n in ("prompt", "negative_prompt", "image", "mask", "strength", *job.options)
             if message.startswith(n)]
    return named[0] if named else job.given[0] if len(job.given) == 1 else None


class QueueFull(Exception):
    """More than MAX_WAITING jobs waiting."""
