"""serve.py through its HTTP API, on tiny checkpoints and random weights: its files are predict.py's byte for byte,
its attention rows and token norms are the model's, every bad request gets its status and one line, the queue is
bounded, old jobs expire, and SIGTERM or Ctrl-C stop a real serve.py process within seconds, its folder removed.
Every server binds 127.0.0.1 on a free port; every wait is bounded in time."""

import base64
import contextlib
import http.client
import io
import json
import os
import re
import signal
import struct
import subprocess
import sys
import threading
import time
import zipfile
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import predict
import serve
from conftest import ROOT
from sapiens2 import Sapiens2Config, processing
from sapiens2_app.serve import serve_jobs, serve_uploads
from test_predict import checkpoints, model_args  # noqa: F401 (a fixture)

PHOTO = ROOT / "assets" / "astronaut.jpg"
ALL_TASKS = "seg,pose,normal,pointmap,matting,albedo,features"
WAIT_S = 90  # the longest any test waits for a job (a few seconds on 2 busy cores)


# ----------------------------------------------------------------------------------------------------
# Servers and a client
# ----------------------------------------------------------------------------------------------------
def start_server(argv: list[str]) -> serve.Service:
    return serve.start(serve.build_parser().parse_args(["--port", "0", *map(str, argv)])).in_thread()


@pytest.fixture(scope="module")
def offline(tmp_path_factory):
    """conftest's offline settings, for module-scoped servers (they load before any test's own fixtures run)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SAPIENS2_CACHE", str(tmp_path_factory.mktemp("empty_cache")))
        patch.setenv("HF_HUB_OFFLINE", "1")
        yield


@pytest.fixture(scope="module")
def tiny_preset():
    """A random-weights backbone as small as the tests' checkpoints, input 64x48 (the released sizes take seconds)."""
    import sapiens2

    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(sapiens2.PRESETS, "tiny", Sapiens2Config(32, 2, 2, full_attention_first=1,
                                                                full_attention_last=1, image_size=(64, 48)))
        yield "tiny"


@pytest.fixture(scope="module")
def server(checkpoints, offline):
    """Every task from the tiny checkpoints; pose boxes from the default detector, which cannot be downloaded
    offline: from the segmentation then, as predict.py does."""
    service = start_server(["--tasks", ALL_TASKS, *model_args(checkpoints), "--queue-size", 4, "--keep-jobs", 100])
    yield service
    service.close()


@pytest.fixture(scope="module")
def random_server(tiny_preset, offline):
    service = start_server(["--tasks", "seg,pose", "--random-init", "always", "--random-backbone", tiny_preset])
    yield service
    service.close()


def call(service, method: str, path: str, body: bytes | None = None, headers: dict | None = None):
    """(status, headers, body) of one request, Host given as a browser gives it unless `headers` say otherwise."""
    connection = http.client.HTTPConnection("127.0.0.1", service.app.port, timeout=WAIT_S)
    try:
        host = {"Host": f"127.0.0.1:{service.app.port}"}
        connection.request(method, path, body=body, headers={**host, **(headers or {})})
        response = connection.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
    finally:
        connection.close()


def get_json(service, path: str, status: int = 200) -> dict:
    got, _, body = call(service, "GET", path)
    assert got == status, body
    return json.loads(body)


def multipart(fields: list[tuple[str, str | None, bytes]]) -> tuple[str, bytes]:
    boundary = "----sapiens2-test-boundary"
    body = b""
    for name, filename, data in fields:
        disposition = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename is not None else "")
        body += f"--{boundary}\r\nContent-Disposition: {disposition}\r\n\r\n".encode() + data + b"\r\n"
    return f"multipart/form-data; boundary={boundary}", body + f"--{boundary}--\r\n".encode()


def post_job(service, photos: list[tuple[str, bytes]], tasks: str | None = None, headers: dict | None = None):
    fields = [("image", name, data) for name, data in photos] + ([("tasks", None, tasks.encode())] if tasks else [])
    content_type, body = multipart(fields)
    return call(service, "POST", "/api/jobs", body, {"Content-Type": content_type, **(headers or {})})


def run_job(service, photos, tasks=None) -> dict:
    status, headers, body = post_job(service, photos, tasks)
    assert status == 202, body
    job = json.loads(body)["id"]
    assert headers["location"] == f"/api/jobs/{job}"
    return wait_finished(service, job)


def wait_finished(service, job: str) -> dict:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        state = get_json(service, f"/api/jobs/{job}")
        if state["state"] in ("done", "failed"):
            return state
        time.sleep(0.05)
    raise AssertionError(f"job {job} not finished within {WAIT_S} s: {state}")


def download(service, state: dict, name: str) -> bytes:
    status, _, body = call(service, "GET", state["files"][name]["url"])
    assert status == 200, body
    return body


def predict_files(argv: list[str], out: Path) -> dict[str, bytes]:
    assert predict.main([*map(str, argv), "-o", str(out)]) == 0
    return {p.name: p.read_bytes() for p in out.iterdir() if p.name != "run.json"}


# ----------------------------------------------------------------------------------------------------
# Results: predict.py's files, the model's attention
# ----------------------------------------------------------------------------------------------------
def test_files_are_predict_files_byte_for_byte(server, checkpoints, tmp_path):
    """Every task on the bundled photo: the same files as predict.py's with the same models and options, the same
    bytes (pose.json names the photo as the client did), one by one and in the zip."""
    state = run_job(server, [("astronaut.jpg", PHOTO.read_bytes())])
    assert state["state"] == "done" and state["images"][0]["state"] == "done", state
    expected = predict_files([ALL_TASKS, PHOTO, *model_args(checkpoints)], tmp_path / "out")
    assert sorted(state["files"]) == sorted(expected) == sorted(state["images"][0]["files"])
    for name, data in expected.items():
        assert download(server, state, name) == data, name
        assert state["files"][name]["bytes"] == len(data)
    status, headers, body = call(server, "GET", f"/api/jobs/{state['id']}/zip")
    assert status == 200 and headers["content-type"] == "application/zip"
    with zipfile.ZipFile(io.BytesIO(body)) as archive:
        assert {name: archive.read(name) for name in archive.namelist()} == expected
    assert json.loads(expected["astronaut.pose.json"])["box_source"] == "segmentation"  # the detector's fallback


def test_random_weights_stamp_pictures_and_say_so(random_server, tiny_preset, tmp_path):
    health = get_json(random_server, "/api/health")
    assert health["random_weights"] and "RANDOM WEIGHTS for seg, pose" in health["banner"]
    assert all(model["random_weights"] for model in health["models"].values())
    state = run_job(random_server, [("astronaut.jpg", PHOTO.read_bytes())], "seg,pose")
    expected = predict_files(["seg,pose", PHOTO, "--random-init", "always", "--random-backbone", tiny_preset],
                             tmp_path / "out")
    assert {name: download(random_server, state, name) for name in state["files"]} == expected
    overlay = np.array(Image.open(io.BytesIO(expected["astronaut.seg_overlay.jpg"])))
    assert (overlay[2:8, 2:40] > 200).all()  # the white band of the RANDOM WEIGHTS stamp (outputs.stamp_random)


def model_attention(backbone, block: int):
    """What the explorer shows, from the model directly: the photo resized to the input size without padding."""
    image = processing.load_image(PHOTO)
    pixels = processing.preprocess([image], tuple(backbone.config.image_size), pad=False).pixel_values
    with torch.no_grad():
        out = backbone(pixels, attentions=[block], layers=list(range(backbone.config.depth)))
    return out, out.attentions[range(backbone.config.depth)[block]][0]


def test_attention_rows_equal_the_model(server, monkeypatch):
    """The grid of each query (CLS, a register, a patch), the mean of heads or one head, equals the model's
    `attentions=` row over the patch keys; the model runs once per photo and block asked for (the cache)."""
    state = run_job(server, [("astronaut.jpg", PHOTO.read_bytes())], "seg,normal")
    backbone = server.app.models.loaded["normal"].backbone
    expected_probs = {block: model_attention(backbone, block)[1] for block in (0, -1)}
    asked, forward = [], backbone.forward
    monkeypatch.setattr(backbone, "forward", lambda *a, **k: asked.append(k.get("attentions")) or forward(*a, **k))
    h, w = 4, 3  # 64x48 / 16
    for block, probs in expected_probs.items():
        for head in ("mean", "1"):
            for query, token in (("cls", 0), ("register:3", 4), ("patch:2,1", 1 + 8 + 2 * w + 1)):
                row = get_json(server, f"/api/jobs/{state['id']}/attention?image=0&task=normal&block={block}"
                                       f"&head={head}&query={query}")
                assert (row["rows"], row["cols"], row["token"], row["heads"], row["depth"]) == (h, w, token, 2, 3)
                keys = probs[:, token, 9:].reshape(2, h, w)
                expected = keys.mean(0) if head == "mean" else keys[1]
                # the same fp32 ops in another thread: only BLAS's thread-dependent splits can differ (a few ulp)
                torch.testing.assert_close(torch.tensor(row["grid"]), expected, rtol=1e-5, atol=1e-7)
    assert asked == [[0], [2]]  # one forward per block (-1 is block 2), each with that block's attention only
    pictures = set()
    for query in ("cls", "patch:0,0", "patch:3,2"):
        row = get_json(server, f"/api/jobs/{state['id']}/attention?task=normal&query={query}")
        png = Image.open(io.BytesIO(base64.b64decode(row["png"].split(",", 1)[1])))
        assert png.size == (512, 512) and png.mode == "RGB"  # the photo's size (under the 640-pixel cap)
        pictures.add(png.tobytes())
    assert len(pictures) == 3 and asked == [[0], [2]]


def test_token_norms_equal_the_model(server):
    state = run_job(server, [("astronaut.jpg", PHOTO.read_bytes())], "seg")
    norms = get_json(server, f"/api/jobs/{state['id']}/norms?image=0&task=seg")
    out, _ = model_attention(server.app.models.loaded["seg"].backbone, 0)
    expected_cls = [t[0].norm().item() for t in out.layer_cls]
    expected_registers = [t[0].norm(dim=-1).tolist() for t in out.layer_registers]
    expected_mean = [layer[0].norm(dim=0).mean().item() for layer in out.layers]
    # fp32 norms of the same activations, computed apart: within a few ulp
    np.testing.assert_allclose(norms["cls"], expected_cls, rtol=1e-5)
    np.testing.assert_allclose(norms["register_norms"], expected_registers, rtol=1e-5)
    np.testing.assert_allclose(norms["patches_mean"], expected_mean, rtol=1e-5)
    assert (norms["depth"], norms["registers"], len(norms["patches_max"])) == (3, 8, 3)


def test_events_stream_each_change_until_done(server):
    """The events stream opens on the queued job (the worker held busy meanwhile), then sends each change until
    the job is done, and ends."""
    with worker_held(server):
        status, _, body = post_job(server, [("a.jpg", PHOTO.read_bytes()), ("b.jpg", PHOTO.read_bytes())], "seg")
        job = json.loads(body)["id"]
        connection = http.client.HTTPConnection("127.0.0.1", server.app.port, timeout=WAIT_S)
        connection.request("GET", f"/api/jobs/{job}/events", headers={"Host": f"localhost:{server.app.port}"})
        response = connection.getresponse()
        assert response.status == 200 and response.getheader("Content-Type") == "text/event-stream"
        assert response.readline() == b"retry: 2000\n"
        first = json.loads(response.readline()[len(b"data: "):])
        assert first["state"] == "queued"
    events = [json.loads(line[len(b"data: "):]) for line in response.read().splitlines() if line.startswith(b"data: ")]
    connection.close()  # (the server ends the stream once the job is finished)
    states = [(e["state"], *(i["state"] for i in e["images"])) for e in events]
    every = [("running", "queued", "queued"), ("running", "running", "queued"), ("running", "done", "queued"),
             ("running", "done", "running"), ("running", "done", "done"), ("done", "done", "done")]
    # changes that come faster than the stream sends them are sent as one: the states in order, ending done
    assert states == sorted(set(states), key=every.index) and states[-1] == every[-1], states
    assert sorted(events[-1]["files"]) == ["a.seg.png", "a.seg_overlay.jpg", "b.seg.png", "b.seg_overlay.jpg"]


@contextlib.contextmanager
def worker_held(service):
    """The worker busy (a call that waits) for the duration of the block; jobs queue meanwhile."""
    release, holding = threading.Event(), threading.Event()
    held = threading.Thread(target=service.app.worker.call,
                            args=(lambda: holding.set() or release.wait(WAIT_S), WAIT_S))
    held.start()
    assert holding.wait(WAIT_S)
    try:
        yield
    finally:
        release.set()
        held.join(WAIT_S)


# ----------------------------------------------------------------------------------------------------
# Bad input: its status and one line; nothing reaches the file system under a client's name
# ----------------------------------------------------------------------------------------------------
def png_bomb(width: int, height: int) -> bytes:
    """A 1x1 PNG whose header claims width x height (CRC fixed): what Pillow sees before decoding anything."""
    buffer = io.BytesIO()
    Image.new("RGB", (1, 1)).save(buffer, format="PNG")
    data = bytearray(buffer.getvalue())
    data[16:24] = struct.pack(">II", width, height)
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(data[12:29])))
    return bytes(data)


def error_of(response) -> tuple[int, str]:
    status, headers, body = response
    assert headers["content-type"] == "application/json"
    message = json.loads(body)["error"]
    assert "\n" not in message and len(message) < 400
    return status, message


@pytest.mark.parametrize("photos, tasks, status, says", [
    ([("notes.jpg", b"just some text, not a picture")], None, 400, "notes.jpg: not an image"),
    ([("empty.png", b"")], None, 400, "empty.png: the file is empty"),
    ([("bomb.png", png_bomb(20000, 20000))], None, 400, "refused: 20000x20000 is 400 megapixels"),
    ([("x.jpg", b"no"), ("y.jpg", b"nope")], None, 400, "none of the 2 photos can be read: x.jpg: not an image"),
    ([], "seg", 400, "no photo in the upload"),
    ([("a.jpg", PHOTO.read_bytes())], "seg,depth", 400, "tasks=seg,depth: unknown task 'depth'; choose from seg,"),
])
def test_bad_uploads_are_refused_with_one_line(server, photos, tasks, status, says):
    got, message = error_of(post_job(server, photos, tasks))
    assert got == status and says in message, message


def test_bad_requests_get_their_status_and_message(server, tmp_path):
    port, photo = server.app.port, PHOTO.read_bytes()
    content_type, body = multipart([("image", "a.jpg", photo)])
    checks = [  # (the response, its status, what its message says)
        (call(server, "POST", "/api/jobs", b"x" * 10, {"Content-Type": "application/json"}), 415, "multipart"),
        (call(server, "POST", "/api/jobs", body[:-10], {"Content-Type": content_type}), 400, "closing boundary"),
        (call(server, "POST", "/api/jobs", b"", {"Content-Type": "multipart/form-data"}), 400, "boundary"),
        (call(server, "POST", "/api/jobs", *multipart_with_field("colour", b"red")), 400, "unexpected form field"),
        (call(server, "GET", "/api/jobs", None, {"Host": "evil.example:%d" % port}), 403, "Host header"),
        (call(server, "GET", "/api/health", None, {"Host": "127.0.0.1:1"}), 403, "Host header"),
        (post_job(server, [("a.jpg", photo)], "seg", {"Origin": "http://evil.example"}), 403, "another site"),
        (call(server, "GET", "/api/jobs/" + "A" * 22), 404, "no such job"),
        (call(server, "GET", "/api/jobs/../../etc/passwd"), 404, "no such page"),
        (call(server, "GET", "/static/../serve.py"), 404, "no such page"),
        (call(server, "DELETE", "/api/jobs"), 405, "use POST"),
    ]
    for (status, message), (want_status, says) in ((error_of(r), (s, m)) for r, s, m in checks):
        assert status == want_status and says in message, (status, message)
    huge = http.client.HTTPConnection("127.0.0.1", port, timeout=WAIT_S)  # a Content-Length over the limit: 413
    huge.putrequest("POST", "/api/jobs", skip_host=True)  # before any of the body is sent
    for name, value in (("Host", f"localhost:{port}"), ("Content-Type", content_type),
                        ("Content-Length", str(51 * 2**20))):
        huge.putheader(name, value)
    huge.endheaders()
    response = huge.getresponse()
    assert response.status == 413 and "over this server's limit of 50 MB (serve.py --max-upload-mb)" in \
        json.loads(response.read())["error"]
    huge.close()
    chunked = http.client.HTTPConnection("127.0.0.1", port, timeout=WAIT_S)
    chunked.request("POST", "/api/jobs", body=iter([body]), headers={"Content-Type": content_type,
                                                                       "Transfer-Encoding": "chunked"})
    assert chunked.getresponse().status == 411
    chunked.close()
    assert get_json(server, "/api/health")["status"] == "ok"  # none of that stopped the server


def multipart_with_field(name: str, value: bytes) -> tuple[bytes, dict]:
    content_type, body = multipart([("image", "a.jpg", PHOTO.read_bytes()), (name, None, value)])
    return body, {"Content-Type": content_type}


def test_one_bad_photo_among_good_ones_fails_alone(server):
    truncated = PHOTO.read_bytes()[:3000]  # a JPEG header, cut short: refused when decoded, by the worker
    state = run_job(server, [("good.jpg", PHOTO.read_bytes()), ("text.jpg", b"hello"), ("cut.jpg", truncated)], "seg")
    good, text, cut = state["images"]
    assert state["state"] == "done" and good["state"] == "done" and good["files"] == ["good.seg.png",
                                                                                      "good.seg_overlay.jpg"]
    assert (text["state"], text["error"]) == ("failed", "text.jpg: not an image: expected BMP, GIF, JPEG, PNG, PPM, "
                                                        "TIFF, WEBP (its first bytes say otherwise)")
    assert cut["state"] == "failed" and cut["error"].startswith("ImageLoadError: cut.jpg: truncated or corrupt")
    assert str(server.app.store.folder) not in json.dumps(state)  # the server's paths stay its own


def test_client_names_never_reach_the_file_system(server):
    """A name with folders, dots and control characters is shown made safe, and written only into pose.json; the
    server's folder holds its own names alone."""
    state = run_job(server, [("../../../etc/x\x00.jpg", PHOTO.read_bytes()), ("..\\..\\x.jpg", PHOTO.read_bytes())],
                    "pose")
    assert [image["name"] for image in state["images"]] == ["x.jpg", "x.jpg"]
    assert sorted(state["files"]) == ["x-2.pose.json", "x-2.pose_overlay.jpg", "x.pose.json", "x.pose_overlay.jpg"]
    assert json.loads(download(server, state, "x-2.pose.json"))["image"] == "x.jpg"
    job_folder = server.app.store.folder / state["id"]
    assert sorted(p.name for p in job_folder.iterdir()) == ["0.jpg", "0.pose.json", "0.pose_overlay.jpg", "1.jpg",
                                                            "1.pose.json", "1.pose_overlay.jpg"]
    for name in ("../0.jpg", "%2e%2e%2f0.jpg", "0.jpg", "x.seg.png"):  # only the job's own result names are served
        assert call(server, "GET", f"/api/jobs/{state['id']}/files/{name}")[0] == 404


@pytest.mark.parametrize("query, says", [
    ("block=3", "block=3: the seg backbone has 3 blocks"), ("head=2", "head=2: expected mean or a head from 0 to 1"),
    ("query=patch:4,0", "the patch grid is 4 rows x 3 columns"), ("query=register:8", "this model has 8 registers"),
    ("query=everything", "expected cls, register:K or patch:ROW,COL"), ("image=3", "the job has 1 images"),
    ("task=pose", "task=pose: not a task of this job"), ("colour=red", "unknown or repeated"),
    ("block=1&block=2", "unknown or repeated"), ("block=x", "block='x': expected a whole number"),
])
def test_bad_attention_requests(server, query, says):
    state = run_job(server, [("a.jpg", PHOTO.read_bytes())], "seg")
    status, message = error_of(call(server, "GET", f"/api/jobs/{state['id']}/attention?{query}"))
    assert status == 400 and says in message, message


def test_a_failing_request_does_not_stop_the_server(server, monkeypatch):
    state = run_job(server, [("a.jpg", PHOTO.read_bytes())], "seg")

    def broken(*args, **kwargs):
        raise RuntimeError("something\nunexpected")

    monkeypatch.setattr(server.app.explorer, "norms", broken)
    assert error_of(call(server, "GET", f"/api/jobs/{state['id']}/norms")) == (
        500, "internal error: RuntimeError: something; unexpected")
    assert get_json(server, "/api/health")["status"] == "ok"


def test_the_page_and_its_files(server):
    status, headers, body = call(server, "GET", "/")
    assert status == 200 and b'<script src="/static/serve.js"' in body
    assert "script-src 'self'" in headers["content-security-policy"] and headers["x-frame-options"] == "DENY"
    for path, kind in (("/static/serve.js", "text/javascript"), ("/static/serve.css", "text/css")):
        status, headers, body = call(server, "GET", path)
        assert status == 200 and headers["content-type"].startswith(kind) and len(body) > 1000
        assert not re.search(rb"https?://(?!www\.w3\.org/2000/svg)", body)  # nothing from another site: works offline


# ----------------------------------------------------------------------------------------------------
# Load, expiry, shutdown
# ----------------------------------------------------------------------------------------------------
def test_eight_concurrent_clients_against_a_queue_of_four(server):
    """The worker held busy, 8 clients post at once: 4 jobs wait, 4 clients get 503 with a message; once the worker
    is free the 4 jobs finish, with the same files."""
    answers = []

    def client():
        answers.append(post_job(server, [("a.jpg", PHOTO.read_bytes())], "seg"))

    with worker_held(server):
        clients = [threading.Thread(target=client) for _ in range(8)]
        for thread in clients:
            thread.start()
        for thread in clients:
            thread.join(WAIT_S)
    statuses = sorted(status for status, _, _ in answers)
    assert statuses == [202] * 4 + [503] * 4
    refused = {json.loads(body)["error"] for status, _, body in answers if status == 503}
    assert refused == {"busy: 4 jobs are waiting already (--queue-size 4); try again when one is done"}
    jobs = [wait_finished(server, json.loads(body)["id"]) for status, _, body in answers if status == 202]
    assert all(job["state"] == "done" for job in jobs)
    assert len({download(server, job, "a.seg.png") for job in jobs}) == 1
    assert len(list(server.app.store.folder.iterdir())) == len(server.app.store.jobs)  # refused jobs left nothing


def test_old_jobs_expire(checkpoints, offline):
    """--keep-jobs 2: a finished job goes, with its folder and its cached attention, once two newer ones finished."""
    service = start_server(["--tasks", "seg", *model_args(checkpoints, ["seg"]), "--keep-jobs", 2])
    try:
        jobs = [run_job(service, [("a.jpg", PHOTO.read_bytes())])]
        get_json(service, f"/api/jobs/{jobs[0]['id']}/attention")
        assert [key[0] for key in service.app.explorer.probs.entries] == [jobs[0]["id"]]
        jobs += [run_job(service, [("a.jpg", PHOTO.read_bytes())]) for _ in range(2)]
        get_json(service, f"/api/jobs/{jobs[2]['id']}/attention")
        assert [key[0] for key in service.app.explorer.probs.entries] == [jobs[2]["id"]]  # job 0's went with it
        jobs.append(run_job(service, [("a.jpg", PHOTO.read_bytes())]))
        for job in jobs[:2]:
            assert error_of(call(service, "GET", f"/api/jobs/{job['id']}")) == (
                404, "no such job (finished jobs are removed once --keep-jobs newer ones have finished)")
        assert [get_json(service, f"/api/jobs/{job['id']}")["state"] for job in jobs[2:]] == ["done", "done"]
        assert sorted(p.name for p in service.app.store.folder.iterdir()) == sorted(job["id"] for job in jobs[2:])
        assert get_json(service, "/api/health")["jobs"] == {"queued": 0, "running": 0, "done": 2, "failed": 0}
    finally:
        service.close()
    assert not service.app.store.folder.exists()


def test_a_killed_servers_folder_is_removed_by_the_next(tmp_path):
    stale = tmp_path / f"{serve_jobs.FOLDER_PREFIX}abcdefgh.tmp"  # as tempfile.mkdtemp names it; nobody holds its lock
    (stale / "job").mkdir(parents=True)
    store = serve_jobs.JobStore(keep=1, parent=tmp_path)
    try:
        assert not stale.exists() and store.removed_stale == 1
        second = serve_jobs.JobStore(keep=1, parent=tmp_path)
        assert second.removed_stale == 0 and store.folder.exists()  # a live server's folder is kept
        second.close()
    finally:
        store.close()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_a_real_serve_process_within_seconds(checkpoints, tmp_path, stop):
    """serve.py as a process, a job running when the signal comes: exit status 0 within seconds, its temporary
    folder removed."""
    env = {**os.environ, "TMPDIR": str(tmp_path), "HF_HUB_OFFLINE": "1", "SAPIENS2_CACHE": str(tmp_path / "cache")}
    process = subprocess.Popen([sys.executable, str(ROOT / "serve.py"), "--port", "0", "--tasks", "seg",
                                *model_args(checkpoints, ["seg"])], env=env, stderr=subprocess.PIPE, text=True)
    try:
        started = ""
        deadline = time.monotonic() + WAIT_S
        while "serving http" not in started and time.monotonic() < deadline and process.poll() is None:
            started = process.stderr.readline()
        match = re.search(r"serving (http://127\.0\.0\.1:(\d+)/) .*results in (\S+), removed at exit", started)
        assert match, started
        folder = Path(match[3])
        assert folder.is_dir() and folder.parent == tmp_path
        service = type("Remote", (), {"app": type("App", (), {"port": int(match[2])})})
        status, _, body = post_job(service, [("a.jpg", PHOTO.read_bytes())] * 8, "seg")
        assert status == 202, body
        signalled = time.monotonic()
        process.send_signal(stop)
        assert process.wait(timeout=20) == 0
        assert time.monotonic() - signalled < 10
        assert not folder.exists() and list(tmp_path.glob(f"{serve_jobs.FOLDER_PREFIX}*")) == []
        assert "stopped; the temporary folder is removed" in process.stderr.read()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_binds_localhost_unless_told_and_warns(capsys):
    assert serve.build_parser().parse_args([]).host == "127.0.0.1"
    assert serve.accepted_hosts("127.0.0.1", []) == {"127.0.0.1", "localhost", "::1"}
    assert capsys.readouterr().err == ""
    assert serve.accepted_hosts("0.0.0.0", ["box.lan"]) == {"0.0.0.0", "box.lan", "127.0.0.1", "localhost", "::1"}
    assert "warning: --host 0.0.0.0: other machines can reach this server" in capsys.readouterr().err


def test_multipart_parser_is_strict():
    content_type, body = multipart([("image", 'a %22b%22.jpg', b"\r\n--not-the-boundary\r\n"), ("tasks", None, b"seg")])
    parts = serve_uploads.parse_multipart(content_type, body)
    assert [(p.name, p.filename, p.data) for p in parts] == [("image", 'a "b".jpg', b"\r\n--not-the-boundary\r\n"),
                                                            ("tasks", None, b"seg")]
    too_many = multipart([("tasks", None, b"x")] * (serve_uploads.MAX_PARTS + 1))
    for content_type, body, says in [
        (content_type, body.replace(b'form-data; name="tasks"', b"attachment"), "Content-Disposition"),
        (content_type, body[: body.index(b"\r\n\r\n")], "closing boundary"),
        (content_type, b"garbage" + body, "does not start with its boundary"),
        (*too_many, "too many form fields"),
        ("multipart/form-data; boundary=" + "x" * 71, body, "no valid boundary"),
    ]:
        with pytest.raises(serve_uploads.ClientError, match=says):
            serve_uploads.parse_multipart(content_type, body)


def test_a_header_reader_raising_any_class_fails_that_photo_alone(monkeypatch):
    """Whatever a format's header reader raises on crafted bytes (here a class nobody lists) refuses that photo with
    its one line; the upload's other photos are judged as usual (processing.decoding's rule for the server)."""
    class ReaderBug(Exception):
        pass

    def broken_reader(*args, **kwargs):
        raise ReaderBug("index out of range in a chunk table")

    Image.init()
    monkeypatch.setitem(Image.OPEN, "PNG", (broken_reader, Image.OPEN["PNG"][1]))
    png = io.BytesIO()
    Image.new("RGB", (8, 6)).save(png, "PNG")
    photos = [serve_uploads.check_photo(serve_uploads.Part("image", name, data), i) for i, (name, data) in
              enumerate([("a.png", png.getvalue()), ("good.jpg", PHOTO.read_bytes())])]
    assert photos[0].data is None and photos[0].error == (
        "a.png: a PNG file whose header cannot be read (ReaderBug: index out of range in a chunk table)")
    assert photos[1].error is None and photos[1].extension == ".jpg" and photos[1].data == PHOTO.read_bytes()
