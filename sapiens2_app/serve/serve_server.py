"""The server around serve_http's Handler: Service binds it, serves it in this thread or another, and stops it;
Server is the standard library's ThreadingHTTPServer with a bound on the connections served at once."""

from __future__ import annotations

import socket
import socketserver
import sys
import threading
from http.server import ThreadingHTTPServer

from sapiens2_app.common.cli import one_line
from sapiens2_app.common.safe_io import json_text
from sapiens2_app.serve.serve_http import App, Handler

MAX_CONNECTIONS = 64  # requests served at once (each holds a thread; an events stream holds one for its job)


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
