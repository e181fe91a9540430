"""serve.py's HTTP layer: the page and the API (docs/serve.md), the routes and the Handler that answers them, and
the checks every request passes first (their pieces in serve_requests; the server that runs the Handler in
serve_server). A local server is an attack surface, so:

- the Host header must name the bound address or localhost (a DNS-rebinding page names its own domain), and a POST
  that carries an Origin must come from the server's own page (a cross-site form cannot start jobs);
- an upload needs a Content-Length within --max-upload-mb (413 before a byte of it is read), a strict multipart
  body (serve_uploads) and photos judged by their content;
- no name from a client reaches the file system: jobs and files are looked up in the server's own tables;
- connections (serve_server) and parallel uploads are bounded, and a socket that stalls times out;
- a request that fails answers JSON {"error": one line} with its status, and never stops the server.
"""

from __future__ import annotations

import re
import shutil
import sys
import threading
import time
import zipfile
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from urllib.parse import unquote

from sapiens2_app.common.cli import UsageError, one_line, parse_tasks
from sapiens2_app.common.safe_io import json_text
from sapiens2_app.serve.serve_attention import Explorer
from sapiens2_app.serve.serve_jobs import Job, JobStore, ServeModels, Stopping, Worker
from sapiens2_app.serve.serve_requests import MAX_LENGTH_DIGITS, content_length, disposition, host_allowed, \
    query_args, same_site, whole_number
from sapiens2_app.serve.serve_uploads import MAX_IMAGES, ClientError, boundary_of, check_photo, parse_multipart, \
    text_field

STATIC = Path(__file__).resolve().parent / "static"
PAGES = {"/": ("serve.html", "text/html; charset=utf-8"),
         "/static/serve.js": ("serve.js", "text/javascript; charset=utf-8"),
         "/static/serve.css": ("serve.css", "text/css; charset=utf-8")}
CONTENT_TYPES = {".png": "image/png", ".jpg": "image/jpeg", ".json": "application/json"}  # else octet-stream
COMPRESSED = (".png", ".jpg", ".safetensors")  # stored as they are in the zip
PAGE_POLICY = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data: blob:; "
               "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
PARALLEL_UPLOADS = 4  # uploads read at once (each holds up to --max-upload-mb in memory)
SOCKET_TIMEOUT_S = 30  # a client that sends nothing for this long is dropped
EVENTS_KEEPALIVE_S = 15
JOB = r"/api/jobs/(?P<job>[A-Za-z0-9_-]{22})"  # secrets.token_urlsafe(16)
ROUTES = [  # (method, path pattern, Handler method)
    ("GET", re.compile(r"/|/static/serve\.(js|css)"), "page"),
    ("GET", re.compile(r"/favicon\.ico"), "no_icon"),
    ("GET", re.compile(r"/api/health"), "health"),
    ("POST", re.compile(r"/api/jobs"), "create_job"),
    ("GET", re.compile(JOB), "job_status"),
    ("GET", re.compile(JOB + r"/events"), "job_events"),
    ("GET", re.compile(JOB + r"/files/(?P<name>[^/]{1,300})"), "job_file"),
    ("GET", re.compile(JOB + r"/zip"), "job_zip"),
    ("GET", re.compile(JOB + r"/attention"), "job_attention"),
    ("GET", re.compile(JOB + r"/norms"), "job_norms"),
]


@dataclass
class App:
    """What the handlers serve: the jobs, the worker, the attention explorer and the models, and the limits."""
    models: ServeModels
    store: JobStore
    worker: Worker
    explorer: Explorer
    hosts: frozenset[str]  # host names a request's Host header may give
    max_upload_bytes: int
    limits: dict  # shown by /api/health (the page checks sizes before it uploads)
    models_json: dict
    pages: dict[str, bytes] = field(init=False)  # the page's files, read once
    port: int = 0
    stopping: threading.Event = field(default_factory=threading.Event)
    upload_slots: threading.Semaphore = field(default_factory=lambda: threading.Semaphore(PARALLEL_UPLOADS))

    def __post_init__(self):
        self.pages = {path: (STATIC / name).read_bytes() for path, (name, _) in PAGES.items()}


class Handler(BaseHTTPRequestHandler):
    server_version, sys_version = "sapiens2-serve", ""
    timeout = SOCKET_TIMEOUT_S
    app: App

    def setup(self):
        super().setup()
        self.app, self.answered, self.unread = self.server.app, False, 0

    def log_message(self, format, *args):  # noqa: A002 (the base class's name): no access log on stderr
        pass

    def do_GET(self):
        self.answer("GET")

    def do_POST(self):
        self.answer("POST")

    def do_PUT(self):
        self.answer("PUT")

    def do_DELETE(self):
        self.answer("DELETE")

    # The other methods of RFC 9110 and PATCH: 405 (or 404) in JSON like any refusal, not the standard library's 501
    # HTML page. A method no RFC names still gets 501, in JSON (send_error).
    def do_HEAD(self):
        self.answer("HEAD")

    def do_OPTIONS(self):
        self.answer("OPTIONS")

    def do_PATCH(self):
        self.answer("PATCH")

    def do_TRACE(self):
        self.answer("TRACE")

    def do_CONNECT(self):
        self.answer("CONNECT")

    def parse_request(self) -> bool:
        """The standard library's reading of the request line and headers. It may raise on crafted headers (a
        multipart Content-Type with `boundary*=idna''abc`: email's feed parser decodes the boundary as it reads the
        headers): a 400, not a connection closed without an answer."""
        try:
            return super().parse_request()
        except Exception as error:  # noqa: BLE001 (what email's parser raises on crafted bytes is open-ended)
            self.send_error(400, f"malformed request headers ({type(error).__name__})")
            return False

    def send_error(self, code: int, message: str | None = None, explain: str | None = None):
        """The standard library's own refusals (a malformed request line, headers too long or malformed, a method no
        RFC names) in JSON, as every other refusal."""
        self.close_connection = True
        self.refuse(code, message or self.responses.get(code, ("error",))[0])

    def answer(self, method: str):
        try:
            if not host_allowed(self.headers.get("Host"), self.app.hosts, self.app.port):
                raise ClientError(403, "refused: the Host header names neither this server's address nor localhost "
                                       "(serve.py --allow-host NAME accepts another name)")
            origin = self.headers.get("Origin")
            if method != "GET" and origin is not None and not same_site(origin, self.app.hosts, self.app.port):
                raise ClientError(403, "refused: a request from another site's page")
            self.route(method)
        except ClientError as error:
            self.refuse(error.status, error.message)
        except Stopping:
            self.refuse(503, "the server is stopping")
        except (BrokenPipeError, ConnectionResetError, TimeoutError):
            self.close_connection = True  # the client went away or stalled: nobody to answer
        except Exception as error:  # noqa: BLE001 (a failing request never stops the server)
            print(f"serve: {self.command} {self.path}: {type(error).__name__}: {one_line(str(error))}",
                  file=sys.stderr)
            self.refuse(500, f"internal error: {type(error).__name__}: {one_line(str(error), 300)}")

    def route(self, method: str):
        path, _, query = self.path.partition("?")
        allowed = []
        for route_method, pattern, name in ROUTES:
            if (match := pattern.fullmatch(path)) is not None:
                if route_method == method:
                    return getattr(self, name)(query=query, **{k: v for k, v in match.groupdict().items()})
                allowed.append(route_method)
        if allowed:
            raise ClientError(405, f"{method} {path}: use {' or '.join(allowed)}")
        raise ClientError(404, f"no such page or API route: {path[:100]}")

    # ----- answers ----------------------------------------------------------------------------------------------
    def refuse(self, status: int, message: str):
        if self.answered:  # a stream already under way: it can only be cut
            self.close_connection = True
            return
        self.send_bytes(status, json_text({"error": message}).encode(), "application/json")
        if self.unread:
            self.drain()

    def send_bytes(self, status: int, body: bytes, content_type: str, headers: dict | None = None):
        self.start(status, content_type, {"Content-Length": str(len(body)), **(headers or {})})
        if self.command == "HEAD":  # the headers alone (the body would be read as the next response)
            self.close_connection = True
            return
        self.wfile.write(body)

    def start(self, status: int, content_type: str, headers: dict | None = None):
        self.answered = True
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        for name, value in {"Cache-Control": "no-store", "X-Content-Type-Options": "nosniff",
                            "Referrer-Policy": "no-referrer", "X-Frame-Options": "DENY", **(headers or {})}.items():
            self.send_header(name, value)
        self.end_headers()

    def send_json(self, status: int, value, headers: dict | None = None):
        self.send_bytes(status, json_text(value).encode(), "application/json", headers)

    def drain(self):
        """After refusing an upload before reading all of it: let the client finish sending for up to 2 s, so that
        it sees the answer rather than a connection reset with its data unread."""
        self.close_connection = True
        deadline = time.monotonic() + 2
        try:
            self.connection.settimeout(0.5)
            while self.unread > 0 and time.monotonic() < deadline:
                chunk = self.rfile.read1(min(self.unread, 1 << 16))
                if not chunk:
                    break
                self.unread -= len(chunk)
        except OSError:
            pass

    # ----- the page -----------------------------------------------------------------------------------------
    def page(self, query: str, **_):
        path = self.path.partition("?")[0]
        headers = {"Content-Security-Policy": PAGE_POLICY} if path == "/" else {}
        self.send_bytes(200, self.app.pages[path], PAGES[path][1], headers)

    def no_icon(self, **_):
        self.start(204, "image/x-icon", {"Content-Length": "0"})

    def health(self, **_):
        app = self.app
        self.send_json(200, {
            "status": "stopping" if app.stopping.is_set() else "ok", "tasks": app.models.offered,
            "models": app.models_json, "random_weights": app.models.banner is not None, "banner": app.models.banner,
            "device": str(app.models.device), "dtype": str(app.models.dtype).replace("torch.", ""),
            "queue": app.worker.queue_json(), "jobs": app.store.counts(), "limits": app.limits})

    # ----- jobs -----------------------------------------------------------------------------------------------
    def create_job(self, **_):
        length = content_length(self.headers.get("Content-Length"))
        chunked = bool(self.headers.get("Transfer-Encoding"))  # (refused by read_body)
        self.unread = self.app.max_upload_bytes if chunked else length or 0
        if self.app.stopping.is_set():
            raise ClientError(503, "the server is stopping")
        content_type = self.headers.get("Content-Type", "")
        boundary_of(content_type)  # 415 or 400 before reading the body
        body = self.read_body()
        images, tasks_text = [], None
        for part in parse_multipart(content_type, body):
            if part.name == "image":
                images.append(part)
            elif part.name == "tasks" and tasks_text is None:
                tasks_text = text_field(part)
            else:
                raise ClientError(400, f"unexpected form field {part.name[:40]!r}: send image (one or more) and tasks")
        if not images:
            raise ClientError(400, "no photo in the upload: send each as a form field named image")
        if len(images) > MAX_IMAGES:
            raise ClientError(400, f"{len(images)} photos in one upload: at most {MAX_IMAGES}")
        tasks = self.job_tasks(tasks_text)
        photos = [check_photo(part, index) for index, part in enumerate(images)]
        if all(photo.data is None for photo in photos):
            reasons = [photo.error for photo in photos]
            raise ClientError(400, reasons[0] if len(reasons) == 1 else f"none of the {len(reasons)} photos can be "
                                   f"read: " + "; ".join(reasons[:3]) + ("; ..." if len(reasons) > 3 else ""))
        job = self.app.store.create(tasks, photos)
        try:
            self.app.worker.submit(job)
        except ClientError:
            self.app.store.discard(job)
            raise
        self.send_json(202, {"id": job.id, "url": f"/api/jobs/{job.id}"}, {"Location": f"/api/jobs/{job.id}"})

    def read_body(self) -> bytes:
        """The request body, all of it, within --max-upload-mb (413 before reading any of it when it says more)."""
        if self.headers.get("Transfer-Encoding"):
            raise ClientError(411, "send the upload with a Content-Length (chunked uploads are not accepted)")
        text = self.headers.get("Content-Length")
        length = content_length(text)
        if length is None:
            raise ClientError(411, "send the upload with a Content-Length") if text is None else ClientError(
                400, f"Content-Length {text[:20]!r}: expected a number of bytes (at most {MAX_LENGTH_DIGITS} digits)")
        limit = self.app.max_upload_bytes
        if self.unread > limit:
            raise ClientError(413, f"the upload is {self.unread / 2**20:.1f} MB, over this server's limit of "
                                   f"{limit / 2**20:g} MB (serve.py --max-upload-mb)")
        if not self.app.upload_slots.acquire(timeout=SOCKET_TIMEOUT_S):
            raise ClientError(503, f"busy: {PARALLEL_UPLOADS} uploads are being received; try again")
        try:
            body = self.rfile.read(self.unread)
        finally:
            self.app.upload_slots.release()
        self.unread = 0
        if len(body) < length:
            raise ClientError(400, f"the upload ended after {len(body)} of its {length} bytes")
        return body

    def job_tasks(self, text: str | None) -> list[str]:
        offered = self.app.models.offered
        if text is None:
            return offered
        try:
            tasks = parse_tasks(text)
        except UsageError as error:
            raise ClientError(400, f"tasks={text[:100]}: {error}") from None
        if missing := [task for task in tasks if task not in offered]:
            raise ClientError(400, f"tasks={text[:100]}: this server runs {', '.join(offered)}, not "
                                   f"{', '.join(missing)} (serve.py --tasks)")
        return tasks

    def job(self, job_id: str) -> Job:
        return self.app.store.get(job_id)

    def job_status(self, job: str, **_):
        self.send_json(200, self.app.store.snapshot(self.job(job))[0])

    def job_events(self, job: str, **_):
        """Server-Sent Events: the job's JSON now and after each change, until it is finished (or the server stops);
        a comment line every 15 s keeps the connection alive."""
        found, store = self.job(job), self.app.store
        self.start(200, "text/event-stream", {"X-Accel-Buffering": "no"})
        self.close_connection = True
        state, version, finished = store.snapshot(found)
        self.wfile.write(b"retry: 2000\ndata: " + json_text(state).encode() + b"\n\n")
        while not finished and not self.app.stopping.is_set() and not store.closed:
            if store.wait_for_change(found, version, EVENTS_KEEPALIVE_S) == version:
                self.wfile.write(b": keep-alive\n\n")
                continue
            state, version, finished = store.snapshot(found)
            self.wfile.write(b"data: " + json_text(state).encode() + b"\n\n")

    def job_file(self, job: str, name: str, **_):
        found = self.job(job)
        name = unquote(name)
        entry = found.files.get(name)
        if entry is None:
            raise ClientError(404, f"no file {name[:100]!r} in this job")
        try:
            file = open(entry.path, "rb")  # noqa: SIM115 (closed below)
        except FileNotFoundError:
            raise ClientError(404, "the job was removed (--keep-jobs)") from None
        with file:
            suffix = "." + name.rsplit(".", 1)[-1]
            self.start(200, CONTENT_TYPES.get(suffix, "application/octet-stream"),
                       {"Content-Length": str(entry.size), "Content-Disposition": disposition("inline", name)})
            shutil.copyfileobj(file, self.wfile, 1 << 20)

    def job_zip(self, job: str, **_):
        """Every file of a finished job in one zip, streamed as it is made (no copy on disk or in memory)."""
        found = self.job(job)
        if not found.finished:
            raise ClientError(409, "the job is not finished yet")
        names = sorted(found.files)
        self.start(200, "application/zip", {"Content-Disposition": disposition("attachment", "sapiens2-results.zip")})
        self.close_connection = True  # no Content-Length: the end of the zip is the end of the connection
        with zipfile.ZipFile(self.wfile, "w") as archive:
            for name in names:
                compression = zipfile.ZIP_STORED if name.endswith(COMPRESSED) else zipfile.ZIP_DEFLATED
                archive.write(found.files[name].path, name, compress_type=compression, compresslevel=1)

    def job_attention(self, job: str, query: str, **_):
        found = self.job(job)
        args = query_args(query, {"image": "0", "task": "", "block": "-1", "head": "mean", "query": "cls"})
        self.send_json(200, self.app.explorer.attention(found, whole_number(args, "image"), args["task"] or None,
                                                        whole_number(args, "block"), args["head"], args["query"]))

    def job_norms(self, job: str, query: str, **_):
        found = self.job(job)
        args = query_args(query, {"image": "0", "task": ""})
        self.send_json(200, self.app.explorer.norms(found, whole_number(args, "image"), args["task"] or None))
