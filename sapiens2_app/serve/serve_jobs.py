"""serve.py's jobs: each upload becomes a Job, its photos kept in a temporary folder of the server's own under names
the server chooses, run by one worker thread photo after photo through predict.py's own inference and file makers
(inference.infer, outputs.Outputs), so that its files are predict.py's, byte for byte.

    store = JobStore(keep=20)                    # a fresh temporary folder, locked; store.close() removes it
    worker = Worker(models, store, capacity=4)   # one thread; submit() raises ClientError(503) when 4 jobs wait
    job = store.create(tasks, photos); worker.submit(job)
    worker.call(fn)                              # fn() on the worker's thread, before the next photo (attention)

Memory and disk stay bounded: at most `capacity` jobs wait, and a finished job is removed (its folder, its cached
attention) once `keep` newer jobs have finished.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import tempfile
import threading
from collections import OrderedDict, deque
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Callable
from urllib.parse import quote

import torch

from sapiens2 import processing
from sapiens2_app.common.artefacts import DEFAULT_KINDS
from sapiens2_app.predict.inference import Inference, infer
from sapiens2_app.predict.inputs import InputImage
from sapiens2_app.predict.models import LoadedModel
from sapiens2_app.predict.outputs import Outputs
from sapiens2_app.predict.pipeline import failure_report
from sapiens2_app.common.reporting import utc_now
from sapiens2_app.common.safe_io import atomic_write, lock_folder, remove_abandoned_staging
from sapiens2_app.serve.serve_uploads import CheckedPhoto, ClientError

FOLDER_PREFIX = "sapiens2-serve-"
CALLS_WAITING = 8  # attention requests waiting for the worker; more get 503


@dataclass
class ServeModels:
    """What the worker computes with: serve.py's models (seg too when pose boxes come from its blobs), the tasks it
    offers, and predict.py's settings for them (one photo per batch: `batch_size` counts pose's people)."""
    loaded: dict[str, LoadedModel]
    offered: list[str]
    device: torch.device
    dtype: torch.dtype
    batch_size: int
    size: tuple[int, int] | None
    flip: bool
    detector: Callable | None
    boxes_from: str | None  # the --detector choice in effect (load_for_tasks)
    resample: str
    banner: str | None = None  # the random-weights banner; None when every model has its checkpoint

    def inference(self, tasks: list[str]) -> Inference:
        """predict.py's Inference for these tasks: their models only (+ seg for pose boxes), as predict.py run with
        these tasks would load them."""
        models = {task: self.loaded[task] for task in tasks}
        if "pose" in tasks and self.boxes_from == "seg" and "seg" in self.loaded:
            models["seg"] = self.loaded["seg"]
        return Inference(list(tasks), models, self.device, self.dtype, self.batch_size, self.size, self.flip,
                         detector=self.detector, seg_boxes=self.detector is None and self.boxes_from != "none",
                         resample=self.resample)


@dataclass
class Photo:
    """One uploaded photo of a job and what became of it."""
    name: str  # the client's file name, made safe (serve_uploads.safe_name): shown, and written into pose.json
    stem: str  # its results' names, distinct within the job: STEM.seg.png
    upload: Path | None  # where the server keeps it (None: refused at upload)
    size: tuple[int, int] = (0, 0)  # width, height
    state: str = "queued"  # queued, running, done, failed
    error: str | None = None  # why it failed (every task, or the photo itself)
    task_errors: dict[str, str] = field(default_factory=dict)  # tasks that failed on a photo that is done
    warnings: list[str] = field(default_factory=list)
    files: list[str] = field(default_factory=list)


@dataclass
class ResultFile:
    path: Path
    photo: int
    task: str
    size: int  # bytes


@dataclass
class Job:
    id: str
    tasks: list[str]
    folder: Path
    photos: list[Photo]
    created: str = field(default_factory=utc_now)
    state: str = "queued"  # queued, running, done, failed
    files: dict[str, ResultFile] = field(default_factory=dict)  # name in the API -> file
    version: int = 0  # bumped on every change (the events stream waits for it)

    @property
    def finished(self) -> bool:
        return self.state in ("done", "failed")

    @property
    def error(self) -> str | None:
        if self.state != "failed":
            return None
        return self.photos[0].error if len(self.photos) == 1 else "no photo could be processed: " + "; ".join(
            f"{photo.name}: {photo.error}" for photo in self.photos[:3])

    def to_json(self) -> dict:
        return {"id": self.id, "state": self.state, "tasks": self.tasks, "created": self.created, "error": self.error,
                "images": [{"name": p.name, "state": p.state, "error": p.error, "task_errors": p.task_errors,
                            "warnings": p.warnings, "width": p.size[0], "height": p.size[1], "files": p.files}
                           for p in self.photos],
                "files": {name: {"image": f.photo, "task": f.task, "bytes": f.size,
                                 "url": f"/api/jobs/{self.id}/files/{quote(name)}"}
                          for name, f in self.files.items()}}


def distinct_stems(names: list[str]) -> list[str]:
    """Each photo's results' name: its name without the extension; `x-2`, `x-3` for the same name again (ignoring
    case, as a zip of them unpacked on a Mac or Windows would)."""
    stems, seen = [], set()
    for name in names:
        stem, n = PurePosixPath(name).stem or "image", 1
        candidate = stem
        while candidate.casefold() in seen:
            n += 1
            candidate = f"{stem}-{n}"
        seen.add(candidate.casefold())
        stems.append(candidate)
    return stems


class Stopping(Exception):
    """The server is shutting down: nothing more is written."""


class JobStore:
    """The jobs of this server and the one temporary folder that holds their photos and results (locked while the
    server lives, removed by close(); one left by a killed server is removed when the next one starts)."""

    def __init__(self, keep: int, parent: Path | None = None):
        parent = Path(parent or tempfile.gettempdir())
        self.removed_stale = remove_abandoned_staging(parent, FOLDER_PREFIX)
        self.folder = Path(tempfile.mkdtemp(prefix=FOLDER_PREFIX, suffix=".tmp", dir=parent))
        self.folder_lock = lock_folder(self.folder)
        self.keep = keep
        self.jobs: OrderedDict[str, Job] = OrderedDict()
        self.changed = threading.Condition()  # guards jobs and every job's state; notified on every change
        self.write_lock = threading.Lock()  # held while writing into the folder, so that close() never races a write
        self.closed = False
        self.on_expire: list[Callable[[str], None]] = []  # called with the id of each job removed (caches)

    @contextlib.contextmanager
    def writing(self):
        """A block that writes into the folder: none starts once close() has begun."""
        with self.write_lock:
            if self.closed:
                raise Stopping("the server is stopping")
            yield

    def create(self, tasks: list[str], photos: list[CheckedPhoto]) -> Job:
        """A queued job of the uploaded photos; those refused at upload are failed already. The readable ones are
        written under the server's names (0.jpg, 1.png, ...: the index and the extension of the sniffed format)."""
        job_id = secrets.token_urlsafe(16)  # 128 random bits: not guessable, and no client name in it
        folder = self.folder / job_id
        stems = distinct_stems([photo.name for photo in photos])
        job = Job(job_id, list(tasks), folder, [])
        with self.writing():
            folder.mkdir()
            for index, (checked, stem) in enumerate(zip(photos, stems)):
                if checked.data is None:
                    job.photos.append(Photo(checked.name, stem, None, state="failed", error=checked.error))
                    continue
                path = folder / f"{index}{checked.extension}"
                atomic_write(path, checked.data)
                job.photos.append(Photo(checked.name, stem, path, checked.size))
        with self.changed:
            self.jobs[job_id] = job
        return job

    def get(self, job_id: str) -> Job:
        with self.changed:
            job = self.jobs.get(job_id)
        if job is None:
            raise ClientError(404, "no such job (finished jobs are removed once --keep-jobs newer ones have finished)")
        return job

    def update(self, job: Job, change: Callable[[Job], None]):
        """Apply a change to a job's state and wake whoever waits for one."""
        with self.changed:
            change(job)
            job.version += 1
            self.changed.notify_all()

    def snapshot(self, job: Job) -> tuple[dict, int, bool]:
        """(the job's JSON, its version, whether it is finished), read together."""
        with self.changed:
            return job.to_json(), job.version, job.finished

    def wait_for_change(self, job: Job, seen: int, timeout: float) -> int:
        """Until the job changes after version `seen` (or `timeout` seconds); its version then."""
        with self.changed:
            self.changed.wait_for(lambda: job.version != seen or self.closed, timeout)
            return job.version

    def discard(self, job: Job):
        """A job that never ran (its queue was full): forgotten and its folder removed."""
        with self.changed:
            self.jobs.pop(job.id, None)
        self.remove_folder(job)

    def expire(self):
        """Remove the oldest finished jobs beyond the newest `keep`."""
        with self.changed:
            finished = [job for job in self.jobs.values() if job.finished]
            old = finished[: max(0, len(finished) - self.keep)]
            for job in old:
                del self.jobs[job.id]
        for job in old:
            self.remove_folder(job)
            for callback in self.on_expire:
                callback(job.id)

    def remove_folder(self, job: Job):
        with self.write_lock:
            shutil.rmtree(job.folder, ignore_errors=True)

    def counts(self) -> dict[str, int]:
        with self.changed:
            states = [job.state for job in self.jobs.values()]
        return {state: states.count(state) for state in ("queued", "running", "done", "failed")}

    def close(self, timeout: float | None = None) -> bool:
        """No more writes; the folder removed. Waits for a write in progress (a fraction of a second, unless the disk
        or the machine is overloaded) for at most `timeout` seconds (None: as long as it takes); then removes the
        folder under it (that writer started before close and writes nothing after it). False when it had to."""
        waited = self.write_lock.acquire(timeout=-1 if timeout is None else timeout)
        try:
            if self.closed:
                return waited
            self.closed = True
            shutil.rmtree(self.folder, ignore_errors=True)
            if self.folder_lock is not None:
                os.close(self.folder_lock)
        finally:
            if waited:
                self.write_lock.release()
        with self.changed:
            self.changed.notify_all()
        return waited


# ----------------------------------------------------------------------------------------------------
# The worker: one thread owns the models
# ----------------------------------------------------------------------------------------------------
class Worker:
    """One thread that runs every model call: the jobs in the order they came, photo after photo, and between two
    photos the calls waiting (attention maps, which a person clicking waits for)."""

    def __init__(self, models: ServeModels, store: JobStore, capacity: int):
        self.models, self.store, self.capacity = models, store, capacity
        self.waiting: deque[Job] = deque()
        self.calls: deque[tuple[Callable, Future]] = deque()
        self.current: Job | None = None
        self.wake = threading.Condition()
        self.stopping = False
        self.thread = threading.Thread(target=self.run, name="sapiens2-serve-worker", daemon=True)

    def start(self):
        self.thread.start()

    def submit(self, job: Job):
        with self.wake:
            if self.stopping:
                raise ClientError(503, "the server is stopping")
            if len(self.waiting) >= self.capacity:
                raise ClientError(503, f"busy: {len(self.waiting)} jobs are waiting already (--queue-size "
                                       f"{self.capacity}); try again when one is done")
            self.waiting.append(job)
            self.wake.notify()

    def call(self, fn: Callable, timeout: float):
        """fn() on the worker's thread, as soon as the photo in progress is done; its result or its exception."""
        future = Future()
        with self.wake:
            if self.stopping:
                raise ClientError(503, "the server is stopping")
            if len(self.calls) >= CALLS_WAITING:
                raise ClientError(503, f"busy: {len(self.calls)} attention requests are waiting; try again")
            self.calls.append((fn, future))
            self.wake.notify()
        try:
            return future.result(timeout)
        except FutureTimeout:
            raise ClientError(503, f"busy: no answer within {timeout:.0f} s (a long job is running); "
                                   f"try again") from None

    def queue_json(self) -> dict:
        with self.wake:
            return {"waiting": len(self.waiting), "capacity": self.capacity,
                    "running": None if self.current is None else self.current.id}

    def stop(self, timeout: float) -> bool:
        """Ask the thread to stop after the photo in progress; False when it is still busy after `timeout` s."""
        with self.wake:
            self.stopping = True
            for _, future in self.calls:
                future.set_exception(ClientError(503, "the server is stopping"))
            self.calls.clear()
            self.wake.notify_all()
        self.thread.join(timeout)
        return not self.thread.is_alive()

    def run(self):
        while (work := self.next_work()) is not None:
            try:
                work()
            except Stopping:
                return

    def next_work(self) -> Callable | None:
        with self.wake:
            self.wake.wait_for(lambda: self.stopping or self.calls or self.current or self.waiting)
            if self.stopping:
                return None
            if self.calls:
                fn, future = self.calls.popleft()
                return lambda: run_call(fn, future)
            if self.current is None:
                self.current = self.waiting.popleft()
                self.store.update(self.current, lambda job: setattr(job, "state", "running"))
            job = self.current
        index = next((i for i, photo in enumerate(job.photos) if photo.state == "queued"), None)
        if index is None:
            return lambda: self.finish(job)
        return lambda: process_photo(self.models, self.store, job, index)

    def finish(self, job: Job):
        failed = all(photo.state == "failed" for photo in job.photos)
        self.store.update(job, lambda job: setattr(job, "state", "failed" if failed else "done"))
        with self.wake:
            self.current = None
        self.store.expire()


def run_call(fn: Callable, future: Future):
    if not future.set_running_or_notify_cancel():
        return
    try:
        future.set_result(fn())
    except Stopping:
        future.set_exception(ClientError(503, "the server is stopping"))
        raise
    except BaseException as error:  # noqa: BLE001 (the caller's request reports it; the worker goes on)
        future.set_exception(error)


def process_photo(models: ServeModels, store: JobStore, job: Job, index: int):
    """One photo through every task of its job, as predict.py runs an image: infer, then Outputs.make and commit
    (OUT = the job's folder, NAME = the photo's index). A task that fails costs that task; a photo that cannot be
    read, or a write that fails, costs the photo."""
    photo = job.photos[index]
    store.update(job, lambda job: setattr(photo, "state", "running"))
    item = InputImage(photo.upload, photo.name)  # the name goes into pose.json, as predict.py's input name does
    try:
        image = processing.load_image(photo.upload)
        result = infer(models.inference(job.tasks), [item], [image])[0]
        warnings = result.pop("warnings")
        outputs = Outputs(job.folder, job.tasks, set(DEFAULT_KINDS), models.loaded, {item: str(index)})
        made = outputs.make(item, image, result)
        with store.writing():
            _, failures = outputs.commit(item, result, made)
    except Stopping:
        raise
    except Exception as error:  # noqa: BLE001 (this photo fails; the job and the server go on)
        message = error_line(item, None, error)
        return store.update(job, lambda job: fail_photo(photo, message))
    failed = {task: error_line(item, task, error) for task, error in failures}
    written = {photo.stem + suffix: ResultFile(outputs.path(item, suffix), index, task, len(data))
               for task, files in made.items() if task not in failed and not isinstance(files, Exception)
               for suffix, (_, data) in files.items()}

    def done(job: Job):
        if len(failed) == len(job.tasks):
            fail_photo(photo, "; ".join(f"{task}: {message}" for task, message in failed.items()))
            return
        photo.state, photo.task_errors, photo.warnings, photo.files = "done", failed, warnings, list(written)
        photo.size = (int(image.shape[-1]), int(image.shape[-2]))
        job.files.update(written)

    store.update(job, done)


def fail_photo(photo: Photo, message: str):
    photo.state, photo.error = "failed", message


def error_line(item: InputImage, task: str | None, error: Exception) -> str:
    """predict.py's report of a failure (`TypeName: message`), naming the photo as the client named it, never by
    the server's path."""
    return failure_report(item, task, error)[0]["error"].replace(str(item.path), item.relative)
