"""serve.py's HTTP layer: the page and the API (docs/serve.md) on the standard library's ThreadingHTTPServer, and the
checks every request passes first. A local server is an attack surface, so:

- the Host header must name the bound address or localhost (a DNS-rebinding page names its own domain), and a POST
  that carries an Origin must come from the server's own page (a cross-site form cannot start jobs);
- an upload needs a Content-Length within --max-upload-mb (413 before a byte of it is read), a strict multipart
  body (serve_uploads) and photos judged by their content;
- no name from a client reaches the file system: jobs and files are looked up in the server's own tables;
- connections and parallel uploads are bounded, and a socket that stalls times out;
- a request that fails answers JSON {"error": one line} with its status, and never stops the server.
"""

from __future__ import annotations

import re
import shutil
import socket
import socketserver
import sys
import threading
import time
import zipfile
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qsl, quote, unquote, urlsplit

from sapiens2_app.common.cli import UsageError, one_line, parse_tasks
from sapiens2_app.common.safe_io import json_text
from sapiens2_app.serve.serve_attention import Explorer
from sapiens2_app.serve.serve_jobs import Job, JobStore, ServeModels, Stopping, Worker
from sapiens2_app.serve.serve_uploads import MAX_IMAGES, MAX_PIXELS, ClientError, boundary_of, check_photo, \
    parse_multipart, text_field

STATIC = Path(__file__).resolve().parent / "static"
PAGES = {"/": ("serve.html", "text/html; charset=utf-8"),
         "/static/serve.js": ("serve.js", "text/javascript; charset=utf-8"),
         "/static/serve.css": ("serve.css", "text/css; charset=utf-8")}
CONTENT_TYPES = {".png": "image/png", ".jpg": "image/jpeg", ".json": "application/json"}  # else octet-stream
COMPRESSED = (".png", ".jpg", ".safetensors")  # stored as they are in the zip
PAGE_POLICY = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data: blob:; "
               "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
MAX_CONNECTIONS = 64  # requests served at once (each holds a thread; an events stream holds one for its job)
PARALLEL_UPLOADS = 4  # uploads read at once (each holds up to --max-upload-mb in memory)
SOCKET_TIMEOUT_S = 30  # a client that sends nothing for this long is dropped
EVENTS_KEEPALIVE_S = 15
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
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


class Service:
    """The server: bound at once (a port in use fails before any model loads), serving once attach() gave it its App;
    serve_forever() in this thread (serve.py, where a signal ends it) or in_thread() (tests). close() stops it within
    seconds: no new job, the worker after its photo (or left behind after `timeout` s: a daemon thread, whose writes
    the closed store refuses), the temporary folder removed (after a write in progress, or `timeout` s)."""

    def __init__(self, host: str, port: int):
        self.server, self.app, self.thread = Server(host, port), None, None
        shown = f"[{host}]" if ":" in host else host
        self.url = f"http://{shown}:{self.server.server_address[1]}/"

    def attach(self, app: App) -> "Service":
        app.port = self.server.server_address[1]
        self.app = self.server.app = app
        return self

    def serve_forever(self):
        self.server.serve_forever(poll_interval=0.2)

    def in_thread(self) -> "Service":
        self.thread = threading.Thread(target=self.serve_forever, name="sapiens2-serve-http", daemon=True)
        self.thread.start()
        return self

    def close(self, timeout: float = 3.0) -> bool:
        """True when everything stopped; False when work was left in flight (the worker still busy, or a write
        still holding the folder, after `timeout` s each): serve.py then ends the process without waiting for it."""
        if self.app is not None:
            self.app.stopping.set()
        if self.thread is not None:  # (serve_forever in this thread has ended already: a signal raised out of it)
            self.server.shutdown()
        self.server.server_close()
        if self.app is None:
            return True
        worker_stopped = self.app.worker.stop(timeout)
        return self.app.store.close(timeout) and worker_stopped


class Server(ThreadingHTTPServer):
    """ThreadingHTTPServer with a bound on connections served at once (more get 503) and no reverse-DNS lookup at
    bind time."""
    daemon_threads = True  # a stalled client never holds the process at exit
    request_queue_size = 64

    app: App | None = None  # (Service.attach)

    def __init__(self, host: str, port: int):
        self.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        super().__init__((host, port), Handler)

    def server_bind(self):
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = self.server_address[:2]

    def process_request(self, request, client_address):
        if not self.slots.acquire(blocking=False):
            body = json_text({"error": f"busy: {MAX_CONNECTIONS} requests in progress; try again"}).encode()
            try:
                request.sendall(b"HTTP/1.0 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                                b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body))
            except OSError:
                pass
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.slots.release()
            raise

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()

    def handle_error(self, request, client_address):
        print(f"serve: error while answering {client_address[0]}: {one_line(str(sys.exc_info()[1]))}", file=sys.stderr)


def host_allowed(value: str | None, hosts: frozenset[str], port: int) -> bool:
    """Does a Host header (or an Origin's host:port) name this server: an accepted name, and its port?"""
    if not value:
        return False
    try:
        parts = urlsplit("//" + value)
        given_port = parts.port
    except ValueError:
        return False
    return parts.hostname in hosts and (given_port or 80) == port and parts.path == "" and not parts.username


def same_site(origin: str, hosts: frozenset[str], port: int) -> bool:
    """Is an Origin header this server's own page (http://HOST:PORT)? A cross-site form's is its site's."""
    return origin.startswith("http://") and host_allowed(origin[len("http://"):], hosts, port)


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


def query_args(query: str, defaults: dict[str, str]) -> dict[str, str]:
    """A URL's query as {name: value}: only the names in `defaults` (missing ones take their default), each once."""
    try:
        pairs = parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query), max_num_fields=len(defaults))
    except ValueError:
        raise ClientError(400, f"malformed query string (expected at most {', '.join(defaults)})") from None
    names = [name for name, _ in pairs]
    if unknown := [name for name in names if name not in defaults or names.count(name) > 1]:
        raise ClientError(400, f"query parameter {unknown[0][:40]!r}: unknown or repeated (expected "
                               f"{', '.join(defaults)})")
    return {**defaults, **dict(pairs)}


MAX_LENGTH_DIGITS = 15  # a Content-Length of up to a petabyte, far over any --max-upload-mb


def content_length(text: str | None) -> int | None:
    """A Content-Length header's number of bytes; None when absent or not ASCII digits ("²" passes str.isdigit and
    then int() refuses it; int() refuses more than 4300 digits too). Only HTTP's spaces and tabs around it are
    ignored: str.strip() takes control characters such as \x1d too, which int() does not."""
    value = None if text is None else text.strip(" \t")
    if value is None or not re.fullmatch(rf"[0-9]{{1,{MAX_LENGTH_DIGITS}}}", value):
        return None
    return int(value)


def whole_number(args: dict[str, str], name: str) -> int:
    text = args[name]
    if not re.fullmatch(r"-?[0-9]{1,6}", text):
        raise ClientError(400, f"{name}={text[:20]!r}: expected a whole number")
    return int(text)


def disposition(kind: str, name: str) -> str:
    """Content-Disposition with the name as ASCII (others as _) and in full as RFC 5987 UTF-8."""
    ascii_name = re.sub(r'[^A-Za-z0-9._ -]', "_", name)
    return f"{kind}; filename=\"{ascii_name}\"; filename*=UTF-8''{quote(name, safe='')}"


def limits_json(max_upload_mb: int, keep_jobs: int) -> dict:
    return {"max_upload_mb": max_upload_mb, "max_images": MAX_IMAGES, "max_megapixels": MAX_PIXELS / 1e6,
            "keep_jobs": keep_jobs}
