"""Crafted uploads and requests to serve.py (issue 35, classes 1 and 2): a malformed upload is a 400 with one line, a
photo whose part cannot be read is refused alone while the others run, every refusal (the standard library's own
too) answers JSON with a 4xx, never a 500 and never a closed connection, no message shows the server's temporary
path, and a stop is bounded whatever is in flight. Then seeded mutation loops (tests/fuzz_support.py) over the
multipart parser and over raw requests to a live server."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from conftest import ROOT
from fuzz_support import SEED_CORPUS, fuzz_loop, mutate
from sapiens2_app.serve import serve_jobs
from sapiens2_app.serve.serve_uploads import ClientError, boundary_of, check_photo, parse_multipart
from test_serve import (PHOTO, call, error_of, multipart, offline, post_job, run_job,  # noqa: F401 (fixtures)
                        start_server, tiny_preset, wait_finished)

GOOD_PART = b'Content-Disposition: form-data; name="image"; filename="good.jpg"\r\n\r\n' + PHOTO.read_bytes()[:4000]


def upload_with_part_headers(disposition: bytes) -> bytes:
    """An upload of a good photo's part and one whose Content-Disposition is `disposition`."""
    bad = b"Content-Disposition: " + disposition + b"\r\n\r\n" + PHOTO.read_bytes()[:4000]
    return b"--b\r\n" + GOOD_PART + b"\r\n--b\r\n" + bad + b"\r\n--b--\r\n"


# ----------------------------------------------------------------------------------------------------
# Class 1: the multipart parser
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("content_type", [
    "multipart/form-data; boundary=abé",  # UnicodeEncodeError at boundary.encode("latin-1")
    "multipart/form-data; boundary*=utf-8''%E2%82%AC",
    "multipart/form-data; boundary*=utf-16''%E2%82%AC",
    "multipart/form-data; boundary*=idna''abc",  # a codec that refuses email's error handler: UnicodeError
    "multipart/form-data; boundary*=punycode''a%ff",
    "multipart/form-data; boundary*=ut\x00f-8''abc",  # ValueError: embedded null character
    "multipart/form-data; boundary=x; a*",  # IndexError inside email's parameter parser
])
def test_a_content_type_email_cannot_read_is_a_400(content_type):
    with pytest.raises(ClientError) as refused:
        boundary_of(content_type)
    assert refused.value.status == 400 and "\n" not in refused.value.message


@pytest.mark.parametrize("disposition", [
    b"form-data; name=\"image\"; filename*=utf-16''%ff%fe%41",  # UnicodeDecodeError
    b"form-data; name=\"image\"; filename*=idna''abc",
    b"form-data; name=\"image\"; filename*=punycode''a%ff",
    b"form-data; name=\"image\"; filename*=u\x00tf-8''ab",
    b"form-data; name=\"image\"; a*",
])
def test_a_photo_whose_headers_cannot_be_read_is_refused_alone(disposition):
    good, bad = [check_photo(part, i) for i, part in enumerate(parse_multipart("multipart/form-data; boundary=b",
                                                                               upload_with_part_headers(disposition)))]
    assert good.data is not None and good.name == "good.jpg"
    assert bad.data is None and bad.error.startswith("image-1.jpg: a part's headers cannot be read ("), bad.error


def test_a_field_whose_name_cannot_be_read_fails_the_upload_with_a_400():
    with pytest.raises(ClientError) as refused:
        parse_multipart("multipart/form-data; boundary=b", upload_with_part_headers(b"form-data; name*=idna''x"))
    assert refused.value.status == 400


# Byte edits of a seed upload, and Content-Types built from the parameter forms that broke email's parser.
CHARSETS = ["utf-8", "utf-16", "utf-32", "cp424", "idna", "punycode", "ut\x00f-8", "", "latin-1", "rot13", "bogus"]
VALUES = ["abc", "%E2%82%AC", "%ff%fe%41", "a%ff", "%00", "é", "\"quoted\"", "", "x" * 80]


def crafted_parameter(rng) -> str:
    name = rng.choice(["boundary", "filename", "name", "a", "charset"])
    form = rng.randrange(4)
    if form == 0:
        return f"{name}*={rng.choice(CHARSETS)}'{rng.choice(['', 'en'])}'{rng.choice(VALUES)}"
    if form == 1:
        return f"{name}*{rng.randrange(3)}*={rng.choice(CHARSETS)}''{rng.choice(VALUES)}"
    if form == 2:
        return f"{name}*"
    return f"{name}={rng.choice(VALUES)}"


def crafted_upload(rng, seed: bytes) -> tuple[str, bytes]:
    if rng.random() < 0.4:
        return "multipart/form-data; boundary=seedboundary", mutate(rng, seed, max_edits=8)
    params = "; ".join(crafted_parameter(rng) for _ in range(rng.randint(1, 3)))
    if rng.random() < 0.5:  # in the Content-Type
        return f"multipart/form-data; boundary=seedboundary; {params}", seed
    return "multipart/form-data; boundary=seedboundary", seed.replace(b'name="image"', b'name="image"; '
                                                                      + params.encode("utf-8"), 1)


def test_mutated_uploads_are_refused_with_a_4xx_or_parsed(tmp_path):
    seed = (SEED_CORPUS / "upload.multipart").read_bytes()

    def one(rng):
        content_type, body = crafted_upload(rng, seed)
        try:
            parts = parse_multipart(content_type, body)
            photos = [check_photo(part, i) for i, part in enumerate(parts) if part.name == "image"]
        except ClientError as refused:
            assert 400 <= refused.status < 500 and "\n" not in refused.message, (content_type, body)
            return f"{refused.status}", refused.message[:60]
        return f"parsed, {sum(p.data is None for p in photos)} of {len(photos)} photos refused", content_type

    tally = fuzz_loop("multipart", one, count=1500, seconds=4.0)
    assert not tally.failures, tally.failures[:3]
    assert tally.total() >= 100, tally.counts


# ----------------------------------------------------------------------------------------------------
# Class 2: the HTTP layer, on a live server
# ----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tiny_preset, offline):  # noqa: F811 (test_serve's fixtures)
    service = start_server(["--tasks", "seg", "--random-init", "always", "--random-backbone", tiny_preset])
    yield service
    service.close()


def raw_request(service, data: bytes, timeout: float = 10) -> bytes:
    """The bytes a server answers to `data`, until it closes the connection."""
    with socket.create_connection(("127.0.0.1", service.app.port), timeout=timeout) as connection:
        connection.sendall(data)
        connection.shutdown(socket.SHUT_WR)  # all is sent: a request cut short is answered, not waited for
        answer = b""
        while chunk := connection.recv(1 << 16):
            answer += chunk
    return answer


def status_and_error(answer: bytes) -> tuple[int, str | None]:
    head, _, body = answer.partition(b"\r\n\r\n")
    assert answer, "no answer at all: the connection was closed"
    status = int(head.split(b" ", 2)[1])
    assert b"content-type: application/json" in head.lower(), head
    return status, json.loads(body)["error"] if body else None


def request(service, first_line: str, headers: str = "", body: bytes = b"") -> bytes:
    host = f"Host: 127.0.0.1:{service.app.port}\r\n"
    return raw_request(service, f"{first_line}\r\n{host}{headers}Connection: close\r\n\r\n".encode("latin-1") + body)


@pytest.mark.parametrize("length", ["²", "1" * 5000, "-1", "0x10", "1e3", "7\x1d", "\x1e7"])
def test_a_content_length_that_is_not_a_number_is_a_400(server, length):
    answer = request(server, "POST /api/jobs HTTP/1.1", f"Content-Type: multipart/form-data; boundary=b\r\n"
                                                         f"Content-Length: {length}\r\n", b"--b--\r\n")
    status, message = status_and_error(answer)
    assert status == 400 and message.startswith("Content-Length "), message


@pytest.mark.parametrize("content_type", ["multipart/form-data; boundary*=idna''abc",
                                          "multipart/form-data; boundary*=punycode''a%ff",
                                          "multipart/form-data; boundary=x; a*"])
def test_headers_the_standard_library_cannot_parse_get_a_400(server, content_type):
    """The connection was closed without an answer (email's feed parser reads a multipart boundary in
    http.server's header parsing, before the handler runs)."""
    answer = request(server, "POST /api/jobs HTTP/1.1", f"Content-Type: {content_type}\r\nContent-Length: 5\r\n",
                     b"--x--")
    assert status_and_error(answer)[0] == 400


@pytest.mark.parametrize("method", ["HEAD", "OPTIONS", "PATCH", "TRACE"])
def test_other_methods_get_405_in_json(server, method):
    status, message = status_and_error(request(server, f"{method} /api/health HTTP/1.1"))
    assert status == 405
    assert message == (None if method == "HEAD" else f"{method} /api/health: use GET")  # HEAD: the headers alone


def test_a_method_no_rfc_names_gets_501_in_json(server):
    assert status_and_error(request(server, "BREW /api/health HTTP/1.1")) == (501, "Unsupported method ('BREW')")


@pytest.fixture(scope="module")
def jobs(server):
    """A job with one photo that runs and one truncated JPEG: its header passes the upload's check, its data does
    not decode."""
    truncated = PHOTO.read_bytes()[:3000]
    state = run_job(server, [("whole.jpg", PHOTO.read_bytes()), ("cut.jpg", truncated)], "seg")
    return state


def test_a_head_number_in_another_script_is_a_400(server, jobs):
    status, message = error_of(call(server, "GET", f"/api/jobs/{jobs['id']}/attention?head=%C2%B2"))
    assert status == 400 and message.startswith("head=²: expected mean or a head"), message


@pytest.mark.parametrize("route", ["attention", "norms"])
def test_a_photo_that_does_not_decode_is_a_422_naming_it_not_the_server_path(server, jobs, route):
    assert [photo["state"] for photo in jobs["images"]] == ["done", "failed"]
    status, message = error_of(call(server, "GET", f"/api/jobs/{jobs['id']}/{route}?image=1"))
    assert status == 422 and message.startswith("cut.jpg: truncated or corrupt image"), message
    assert str(server.app.store.folder) not in message


REQUEST_LINES = ["GET / HTTP/1.1", "GET /api/health HTTP/1.1", "POST /api/jobs HTTP/1.1",
                 "GET /api/jobs/AAAAAAAAAAAAAAAAAAAAAA/attention?head=1&block=0 HTTP/1.1"]


def crafted_request(rng, port: int, job: str) -> bytes:
    line = rng.choice(REQUEST_LINES).replace("AAAAAAAAAAAAAAAAAAAAAA", job)
    headers = [f"Host: 127.0.0.1:{port}", "Connection: close"]
    body = b""
    if line.startswith("POST"):
        seed = (SEED_CORPUS / "upload.multipart").read_bytes()
        content_type, body = crafted_upload(rng, seed)
        headers += [f"Content-Type: {content_type}", f"Content-Length: {len(body)}"]
    data = ("\r\n".join([line, *headers]) + "\r\n\r\n").encode("utf-8") + body
    return mutate(rng, data, max_edits=3) if rng.random() < 0.7 else data


def test_mutated_requests_get_an_answer_in_json_never_a_500(server, jobs):
    def one(rng):
        data = crafted_request(rng, server.app.port, jobs["id"])
        answer = raw_request(server, data)
        if not answer.startswith(b"HTTP/"):  # an HTTP/0.9 request (no version): the body alone, as that protocol has
            assert answer == b"" or answer.startswith(b"{"), (data, answer)
            return "HTTP/0.9 or no status line", data[:60]
        status = int(answer.split(b" ", 2)[1])
        if status >= 400:  # every refusal: JSON, one line, no server path; never a 500
            message = status_and_error(answer)[1] or ""
            assert status < 500 or status == 501 or (status == 503 and "busy" in message), (data, message)
            assert str(server.app.store.folder) not in message, (data, message)
        return str(status), data[:80]

    tally = fuzz_loop("http", one, count=150, seconds=8.0)
    assert not tally.failures, tally.failures[:3]
    assert call(server, "GET", "/api/health")[0] == 200


# ----------------------------------------------------------------------------------------------------
# Class 2: a stop is bounded whatever is in flight
# ----------------------------------------------------------------------------------------------------
HOLD_THE_WORKER = """
import sys, time
from concurrent.futures import ThreadPoolExecutor
sys.path[:0] = [{root!r}]
import sapiens2, serve
from sapiens2_app.serve import serve_jobs

sapiens2.PRESETS["tiny"] = sapiens2.Sapiens2Config(32, 2, 2, full_attention_first=1, full_attention_last=1,
                                                   image_size=(64, 48))  # (random 0.1b weights take seconds)

def held(*args, **kwargs):  # a photo whose call hands work to a thread pool (joined at the interpreter's exit)
    ThreadPoolExecutor(1).submit(time.sleep, 60)
    time.sleep(60)

serve_jobs.process_photo = held
sys.argv[0] = "serve.py"
sys.exit(serve.main())
"""


def test_a_stop_is_bounded_whatever_is_in_flight(tmp_path):
    """The worker is held for a minute in a model call that started a thread of its own: Ctrl-C stops the process
    within seconds, its folder removed (it waited for the call's thread: a minute)."""
    script = tmp_path / "held_serve.py"
    script.write_text(HOLD_THE_WORKER.format(root=str(ROOT)))
    env = {**os.environ, "TMPDIR": str(tmp_path), "HF_HUB_OFFLINE": "1", "SAPIENS2_CACHE": str(tmp_path / "cache")}
    process = subprocess.Popen([sys.executable, str(script), "--port", "0", "--tasks", "seg", "--random-init", "always",
                                "--random-backbone", "tiny"], env=env, stderr=subprocess.PIPE, text=True)
    try:
        line, deadline = "", time.monotonic() + 90
        while "serving http" not in line and time.monotonic() < deadline and process.poll() is None:
            line = process.stderr.readline()
        match = re.search(r"serving http://127\.0\.0\.1:(\d+)/ .*results in (\S+), removed at exit", line)
        assert match, line
        service = type("Remote", (), {"app": type("App", (), {"port": int(match[1])})})
        assert post_job(service, [("a.jpg", PHOTO.read_bytes())], "seg")[0] == 202
        time.sleep(0.5)  # the worker takes the photo
        signalled = time.monotonic()
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=30) == 0
        assert time.monotonic() - signalled < 15  # 3 s for the worker, 3 s for a write, and the exit
        assert not os.path.exists(match[2])
        assert "work in flight after 3 s was abandoned" in process.stderr.read()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
