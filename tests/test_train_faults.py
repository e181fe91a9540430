"""train.py under faults and careless use (issue 25): one `error:` line naming the file or option, exit status 2 for
usage and data, 1 for a run that stopped, 130 for Ctrl-C; no traceback, no hang; the last complete checkpoint
intact, nothing of ours left behind; a --resume after a kill -9 as exact as an uninterrupted run.

Signals and kill -9 go to real child processes, which run train.main with one step (or one checkpoint write) made
to wait, so that the signal lands inside it whatever the machine's speed: the test waits for the child's marker
file, never for a time. Write faults are injected in-process (tests run as root, where chmod protects nothing): a
read-only OUT through safe_io.write_value as tests/test_reliability.py does, a full disk where safetensors writes."""

import argparse
import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

import train
from sapiens2 import weights
from sapiens2_app.train import data_loading, starting_model, train_checkpoints
from sapiens2_app.train.distributed import Distributed
from sapiens2_app.train.train_checkpoints import TrainingStopped
from test_reliability import BOMB_LINE, bomb_png, error_lines, faulty_writer, strict_json
from test_train import HEADS, make_dataset, run_train, save_png, tiny_backbone

ROOT = Path(__file__).resolve().parents[1]
CHILD_ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
DEADLINE_S = 120  # for a child to reach its marker or to exit: a hang fails here, not by hanging the suite


@pytest.fixture(scope="module")
def backbone(tmp_path_factory) -> Path:
    return tiny_backbone(tmp_path_factory.mktemp("backbone"))


@pytest.fixture(scope="module")
def seg_data(tmp_path_factory) -> Path:
    return make_dataset("seg", tmp_path_factory.mktemp("seg"), count=4)


@pytest.fixture
def one_thread():
    """Bit-identical runs in this process and in a child (OMP_NUM_THREADS=1): the same reduction order."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def argv(data, out, backbone, *extra) -> list[str]:
    """The careless user's command: a tiny backbone, a new head, batch 2 (a new run unless extra has --resume)."""
    model = [] if "--resume" in extra else ["--model", backbone, "--head", HEADS["seg"]]
    return [str(a) for a in ["seg", "--data", data, "-o", out, *model, "--batch-size", 2, "--workers", 0,
                             "--no-progress", "--warmup", 0, *extra]]


def files_of(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in out.iterdir() if p.name != "log.jsonl"}


def ours_left(out: Path) -> list[str]:
    """Staging folders and temporaries of ours in OUT."""
    return sorted(p.name for p in out.iterdir() if p.name.startswith(".checkpoint.") or p.name.endswith(".partial"))


def checkpoint_step(out: Path) -> int:
    step = json.loads((out / "train_state.json").read_text())["step"]
    assert json.loads((out / "config.json").read_text())["sapiens2_training"]["step"] == step  # one checkpoint
    return step


# ----------------------------------------------------------------------------------------------------
# Data errors in workers: the workers end with the run
# ----------------------------------------------------------------------------------------------------
class SlowSample:
    """A dataset whose second sample takes a minute: a worker busy with it when the run stops."""

    def __len__(self):
        return 4

    def __getitem__(self, key):
        if key[0] == 1:
            time.sleep(60)
        return {"pixel_values": torch.zeros(3, 2, 2)}


def test_a_busy_worker_ends_when_the_run_stops(monkeypatch):
    """The run stops (a data error, Ctrl-C) while a worker still reads a sample: torch waits for it, then sends
    SIGTERM; a worker that ignores it then (as it must ignore a scheduler's SIGTERM during the run) would keep the
    interpreter's exit waiting for it (multiprocessing joins its children at exit)."""
    monkeypatch.setattr(torch.utils.data._utils, "MP_STATUS_CHECK_INTERVAL", 0.2)  # torch's join timeout, 5 s
    loader = data_loading.data_loader(SlowSample(), [[(0, 0)], [(1, 0)]], workers=1)
    with data_loading.Batches(loader) as batches:
        next(batches)
        worker = batches.iterator._workers[0]
        time.sleep(0.5)  # (not needed for the check: the worker is either in its slow sample or about to be)
    try:
        worker.join(timeout=10)
        assert not worker.is_alive(), "the data worker ignored SIGTERM at shutdown"
    finally:
        if worker.is_alive():
            os.kill(worker.pid, signal.SIGKILL)


def test_a_bad_label_in_val_found_by_workers_costs_no_training(backbone, tmp_path, capsys):
    """A class id 7 in a 3-class set, met by 2 DataLoader workers in the evaluation at the last step: one line naming
    the file, exit 2, and the step's checkpoint saved before (the evaluation comes after the save)."""
    data = make_dataset("seg", tmp_path / "data", count=4)
    save_png(data / "val/masks/im1.png", np.full((64, 48), 7, np.uint8))
    out = tmp_path / "run"
    assert train.main(argv(data, out, backbone, "--steps", 2, "--workers", 2)) == 2
    assert error_lines(capsys.readouterr().err) == [f"error: {data / 'val/masks/im1.png'}: class id 7 but classes.json "
                                                    "lists 3 classes (ids 0..2, 255 = ignore)"]
    assert checkpoint_step(out) == 2


def test_a_bad_training_file_found_at_step_2_keeps_steps_0_and_1(backbone, tmp_path, capsys):
    """The sample of step 2 has class id 7: exit 2 with the line naming it, and the two steps trained before saved
    (--save-every 0: none was due), so that the fixed file and --resume lose nothing."""
    data = make_dataset("seg", tmp_path / "data", count=8)
    sampler = data_loading.StepSampler(8, argparse.Namespace(seed=0, batch_size=2, accumulate=1), Distributed("cpu"),
                                       0, 4)
    (index, _), _ = list(sampler)[2]  # the first sample of step 2 (images/ sorted by name: im{index})
    bad = data / f"train/masks/im{index}.png"
    save_png(bad, np.full((64, 48), 7, np.uint8))
    out = tmp_path / "run"
    assert train.main(argv(data, out, backbone, "--steps", 4, "--save-every", 0)) == 2
    err = capsys.readouterr().err
    assert error_lines(err) == [f"error: {bad}: class id 7 but classes.json lists 3 classes (ids 0..2, 255 = ignore)"]
    assert "saved the checkpoint of step 2; fix the file below, then --resume goes on" in err
    assert checkpoint_step(out) == 2


@pytest.mark.parametrize("task, image", [("seg", "train/images/im1.png"), ("pose", "train/images/p1.png")])
def test_a_decompression_bomb_in_the_training_set_is_one_line(task, image, backbone, tmp_path, capsys):
    """Issue 29: an image whose header declares 30000x30000 pixels, found as an unreadable image is: one line, exit 2.
    seg reads every image's header before training (its targets must have its size); pose takes the sizes from
    annotations.json and meets the bomb when its sample is read, in the first step. Both were tracebacks (Pillow's
    DecompressionBombError is neither an OSError nor a ValueError)."""
    data = make_dataset(task, tmp_path / "data", count=4)
    bomb = bomb_png(data / image)
    code = run_train(task, data, tmp_path / "run", backbone, "--steps", 1)
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    assert error_lines(err) == [f"error: {bomb}: {BOMB_LINE}"], err


# ----------------------------------------------------------------------------------------------------
# -o, before any model loads
# ----------------------------------------------------------------------------------------------------
@pytest.fixture
def no_model_loads(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before -o was checked")
    monkeypatch.setattr(starting_model, "build_model", refuse)


def test_unusable_out_is_refused_before_the_model_loads(seg_data, tmp_path, monkeypatch, capsys, no_model_loads):
    (tmp_path / "file").write_text("a file")
    for out, line in [(tmp_path / "file", f"error: -o {tmp_path / 'file'}: is a file, not a folder"),
                      (tmp_path / "file" / "run", f"error: -o {tmp_path / 'file' / 'run'}: cannot write there "
                                                  f"(Not a directory (ENOTDIR): {tmp_path / 'file' / 'run'})")]:
        assert train.main(argv(seg_data, out, "unused.safetensors", "--steps", 1)) == 2
        assert error_lines(capsys.readouterr().err) == [line]
    assert (tmp_path / "file").read_text() == "a file"
    faulty_writer(monkeypatch, lambda file: errno.EROFS)  # a read-only file system
    out = tmp_path / "ro" / "run"
    assert train.main(argv(seg_data, out, "unused.safetensors", "--steps", 1)) == 2
    (line,) = error_lines(capsys.readouterr().err)
    assert line.startswith(f"error: -o {out}: cannot write there (Read-only file system (EROFS)"), line
    assert list(tmp_path.iterdir()) == [tmp_path / "file"]  # the probe and the folders made for it are gone


# ----------------------------------------------------------------------------------------------------
# Non-finite numbers: refused in annotations.json, never saved, never written as JSON
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity", "1e999"])
def test_non_finite_keypoints_are_refused(value, backbone, tmp_path, capsys):
    data = make_dataset("pose", tmp_path / "data", count=2)
    path = data / "train/annotations.json"
    path.write_text(path.read_text().replace('"keypoints": [', f'"keypoints": [{value}, ', 1))
    out = tmp_path / "run"
    args = ["pose", "--data", data, "-o", out, "--model", backbone, "--head", HEADS["pose"], "--steps", 1,
            "--batch-size", 2, "--workers", 0, "--no-progress"]
    assert train.main([str(a) for a in args]) == 2
    assert error_lines(capsys.readouterr().err) == [
        f"error: {path}: {value} is not a finite number (keypoints and boxes must be; an unlabelled keypoint is "
        "0, 0, 0)"]
    assert not out.exists()


def test_a_diverging_run_stops_and_keeps_its_last_finite_checkpoint(backbone, seg_data, tmp_path, capsys):
    """--lr 1e30: the step-1 weights are huge but finite (saved), the step-2 loss is NaN: exit 1, nothing saved at
    step 2. Weights that are no longer finite are never saved."""
    out = tmp_path / "run"
    assert train.main(argv(seg_data, out, backbone, "--steps", 4, "--lr", "1e30", "--save-every", 1,
                           "--log-every", 1)) == 1
    assert error_lines(capsys.readouterr().err) == [
        f"error: stopped: the loss is nan at step 2: the training diverged (a lower --lr, or --clip-grad, may help); "
        f"not saved; {out} keeps the checkpoint of step 1 (--resume continues from it)"]
    assert checkpoint_step(out) == 1 and all(t.isfinite().all() for t in load_file(out / "model.safetensors").values())
    assert [record["step"] for record in map(json.loads, (out / "log.jsonl").read_text().splitlines())
            if "loss" in record] == [1]
    model, before = weights.load(out), files_of(out)
    with torch.no_grad():
        model.decode_head.predictor.weight[0, 0] = float("inf")
    with pytest.raises(TrainingStopped) as stopped:
        train_checkpoints.save_checkpoint(out, model, torch.optim.AdamW(model.parameters()), 2,
                                          argparse.Namespace(task="seg"), {}, Distributed("cpu"), 2)
    assert str(stopped.value) == ("the weights of step 2 hold NaN or Inf (1 tensors: decode_head.predictor.weight): the "
                                  "training diverged (a lower --lr, or --clip-grad, may help); not saved; "
                                  f"{out} keeps the checkpoint of step 1 (--resume continues from it)")
    assert files_of(out) == before and ours_left(out) == []


def test_log_and_checkpoint_json_are_strict(backbone, seg_data, tmp_path):
    """A NaN among the values the run logs (a metric of an empty class set, a rate) is written as null."""
    log = train.Log(tmp_path, enabled=True)
    log.write({"step": 1, "loss": float("nan"), "eval": {"miou": float("inf")}})
    assert strict_json(tmp_path / "log.jsonl") == {"step": 1, "loss": None, "eval": {"miou": None}}
    with pytest.raises(TrainingStopped, match=r"^cannot write .*log.jsonl \(Not a directory \(ENOTDIR\)"):
        train.Log(tmp_path / "log.jsonl", enabled=True).write({"step": 2})  # (a full disk: the same OSError path)
    out = tmp_path / "run"
    assert train.main(argv(seg_data, out, backbone, "--steps", 1)) == 0
    for name in ("config.json", "train_state.json"):
        strict_json(out / name)
    [strict_json_line(line) for line in (out / "log.jsonl").read_text().splitlines()]


def strict_json_line(line: str):
    return json.loads(line, parse_constant=lambda name: pytest.fail(f"{name} in log.jsonl"))


# ----------------------------------------------------------------------------------------------------
# --resume with other data or damaged run files
# ----------------------------------------------------------------------------------------------------
def test_resume_refuses_other_classes_and_damaged_run_files(backbone, seg_data, tmp_path, capsys):
    out = tmp_path / "run"
    assert train.main(argv(seg_data, out, backbone, "--steps", 1)) == 0
    before = files_of(out)
    other = make_dataset("seg", tmp_path / "five", count=4)
    (other / "classes.json").write_text(json.dumps(["a", "b", "c", "d", "e"]))
    resume = argv(other, out, backbone, "--resume", "--steps", 2)
    assert train.main(resume) == 2
    assert error_lines(capsys.readouterr().err) == [
        f"error: --resume: the run in {out} was trained on 3 classes (background, red, blue), {other / 'classes.json'}"
        f" lists 5 (a, b, c, d, e); resume it with its own data, or start a new run from its weights with --model {out}"]
    (other / "classes.json").write_text(json.dumps(["background", "red", "green"]))
    assert train.main(resume) == 2
    assert "3 classes, but classes 2 is 'blue' there and 'green' in" in capsys.readouterr().err
    assert files_of(out) == before

    resume = argv(seg_data, out, backbone, "--resume", "--steps", 2)
    (out / "optimizer.safetensors").write_bytes(b"garbage")
    assert train.main(resume) == 2
    (line,) = error_lines(capsys.readouterr().err)
    assert line.startswith(f"error: {out / 'optimizer.safetensors'}: cannot read the optimizer state ("), line
    for garbage in ('{"step": 1, oops', "[1, 2]"):
        (out / "train_state.json").write_text(garbage)
        with pytest.raises(SystemExit) as exit_info:
            train.main(resume)
        (line,) = error_lines(capsys.readouterr().err)
        assert exit_info.value.code == 2 and line.startswith(f"error: --resume: {out / 'train_state.json'}: "), line


# ----------------------------------------------------------------------------------------------------
# A full disk at a checkpoint
# ----------------------------------------------------------------------------------------------------
def test_full_disk_at_a_checkpoint_stops_keeping_the_previous_one(backbone, seg_data, tmp_path, monkeypatch, capsys):
    """safetensors writes its files itself; on a full disk it raises its own error carrying the OS's code (this
    message is the one it gives for a real write error, EFBIG under RLIMIT_FSIZE)."""
    out = tmp_path / "run"
    real, calls = weights.save_file, []

    def disk_full_at_the_second_checkpoint(tensors, path, metadata=None):
        calls.append(path)
        if len(calls) <= 2:  # step 1's model and optimizer fit
            return real(tensors, path, metadata=metadata)
        Path(path).write_bytes(b"half a file")
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(weights, "save_file", disk_full_at_the_second_checkpoint)
    assert train.main(argv(seg_data, out, backbone, "--steps", 3, "--save-every", 1, "--stop-at", 1)) == 0
    before = files_of(out)
    assert train.main(argv(seg_data, out, backbone, "--resume", "--steps", 3, "--save-every", 1)) == 1
    assert error_lines(capsys.readouterr().err) == [
        f"error: stopped: cannot save the checkpoint of step 2 in {out} (No space left on device (ENOSPC)); {out} "
        "keeps the checkpoint of step 1 (--resume continues from it)"]
    assert files_of(out) == before and ours_left(out) == []


# ----------------------------------------------------------------------------------------------------
# Ctrl-C twice, kill -9: real signals to a child process
# ----------------------------------------------------------------------------------------------------
CHILD = '''
import sys, time
from pathlib import Path
import train
from sapiens2_app.train import train_checkpoints

marker, where, at_step = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
step_of_run, write_files = train.Run.train_step, train_checkpoints.write_checkpoint_files

def slow_step(self, step, batches, params):  # the step that ends at `at_step`, made long
    loss = step_of_run(self, step, batches, params)
    if where == "step" and step + 1 == at_step:
        marker.write_text("in the step")
        time.sleep(300)
    return loss

def slow_write(tmp, model, model_state, optimizer_state, rng, step, *rest):  # its checkpoint's files, written
    write_files(tmp, model, model_state, optimizer_state, rng, step, *rest)
    if where == "checkpoint" and step == at_step:
        marker.write_text(str(tmp))
        time.sleep(300)

train.Run.train_step, train_checkpoints.write_checkpoint_files = slow_step, slow_write
sys.exit(train.main(sys.argv[4:]))
'''


def start_child(tmp_path: Path, where: str, at_step: int, args: list[str]):
    """train.main in a child whose step `at_step` (or its checkpoint) waits: (process, marker, stderr file)."""
    (tmp_path / "child.py").write_text(CHILD)
    marker, stderr = tmp_path / "marker", (tmp_path / "stderr").open("w")
    command = [sys.executable, str(tmp_path / "child.py"), str(marker), where, str(at_step), *args]
    return subprocess.Popen(command, stderr=stderr, env=CHILD_ENV, cwd=ROOT), marker, tmp_path / "stderr"


def wait_for(process, condition, stderr: Path):
    deadline = time.time() + DEADLINE_S
    while not condition():
        assert process.poll() is None, stderr.read_text()
        assert time.time() < deadline, "the child did not get there: " + stderr.read_text()
        time.sleep(0.05)


def test_a_second_ctrl_c_quits_at_once(backbone, seg_data, tmp_path):
    """Ctrl-C in step 3 (with a data worker): 'stopping after this step'; Ctrl-C again, the step still running:
    exit 130 at once, one line, no traceback; the checkpoint of step 2 complete, no staging folder left."""
    out = tmp_path / "run"
    args = argv(seg_data, out, backbone, "--steps", 100, "--save-every", 1, "--workers", 1)
    process, marker, stderr = start_child(tmp_path, "step", 3, args)
    try:
        wait_for(process, marker.exists, stderr)
        process.send_signal(signal.SIGINT)
        wait_for(process, lambda: "Ctrl-C again to quit now" in stderr.read_text(), stderr)
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=DEADLINE_S) == 130, stderr.read_text()  # (the step would sleep 300 s)
    finally:
        process.kill()
    err = stderr.read_text()
    assert "Traceback" not in err and err.count("\ninterrupted: quit without saving; ") == 1, err
    assert f"interrupted: quit without saving; {out} keeps the checkpoint of step 2 (--resume continues from it)" in err
    assert checkpoint_step(out) == 2 and ours_left(out) == []
    weights.load(out)


def test_resume_after_kill_9_in_a_checkpoint_write_is_exact(backbone, seg_data, tmp_path, one_thread, capsys):
    """kill -9 while the checkpoint of step 2 is being written (its staging folder full): --resume removes that
    folder and any temporary of ours whose writer is gone (whatever its age), keeps a running writer's, and goes on
    from step 1 to the weights of an uninterrupted run, bit for bit (one thread in both processes)."""
    reference = tmp_path / "reference"
    assert train.main(argv(seg_data, reference, backbone, "--steps", 3)) == 0
    out = tmp_path / "run"
    process, marker, stderr = start_child(tmp_path, "checkpoint", 2, argv(seg_data, out, backbone, "--steps", 3,
                                                                          "--save-every", 1))
    try:
        wait_for(process, marker.exists, stderr)
        process.kill()
        process.wait(timeout=DEADLINE_S)
    finally:
        process.kill()
    staging = Path(marker.read_text())
    assert staging.parent == out and (staging / "model.safetensors").is_file() and checkpoint_step(out) == 1
    dead = out / f".train_state.json.{process.pid}.0123abcd.partial"  # an atomic_write temporary of the dead child
    dead.write_text("{")
    alive = out / f".checkpoint.{os.getpid()}.abcdefgh.tmp"  # a writer that still runs (this process)
    alive.mkdir()
    assert train.main(argv(seg_data, out, backbone, "--resume", "--steps", 3)) == 0
    assert f"removed {staging}, left by a run that was killed" in capsys.readouterr().err
    assert ours_left(out) == [alive.name]
    assert checkpoint_step(out) == 3
    for name in ("model.safetensors", "optimizer.safetensors"):
        resumed, uninterrupted = load_file(out / name), load_file(reference / name)
        assert resumed.keys() == uninterrupted.keys()
        assert [k for k in resumed if not torch.equal(resumed[k], uninterrupted[k])] == [], name
