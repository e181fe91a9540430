"""Writing files so that nothing half-written or stale is ever left where a user looks, and errors say why.

    atomic_write(path, value)        # a temporary beside `path`, unique to this writer, renamed over it
    encode(value, suffix)            # the bytes of a file (a picture, an array, JSON, tensors)
    json_text(value)                 # strict JSON: NaN/Infinity become null
    check_writable(folder)           # a probe through the same writer (raises the OSError)
    hold(temp)                       # a long write's temporary, locked while its writer lives
    remove_stale_temporaries(out)    # what a killed run (kill -9) left behind
    remove_abandoned_staging(folder, prefix)   # the staging folders of a killed writer

predict.py writes every output and manifest through `atomic_write`; so can any other command (video, detection)
that writes into a user's folder. `write_value` is the one place bytes reach the disk: tests inject faults there.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import math
import os
import re
import secrets
import shutil
import signal
import struct
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
from safetensors.torch import save as save_safetensors_bytes

try:
    import fcntl
except ImportError:  # Windows: no flock; held temporaries fall under the 10-minute rule
    fcntl = None


# zlib effort of the PNG outputs. Pillow's default, 6, took 5x longer on a 1440x1080 normal picture (770 ms against
# 150 ms on one core) for a 20% smaller file; the pixels are the same at any level (PNG is lossless).
PNG_COMPRESS_LEVEL = 1
# Write errors that the next file will hit too: the caller stops or narrows the run rather than fail file by file.
REPEATING_WRITE_ERRORS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM}
FOLDER_WRITE_ERRORS = {errno.EROFS, errno.EACCES, errno.EPERM}  # may concern one folder (or file) only




def atomic_write(path: Path, value):
    """Write to a temporary file beside `path` and rename it, so an interrupted run never leaves a half-written
    output. The temporary name is unique to this writer (`.NAME.PID.RANDOM.partial`, created exclusively), so
    two processes writing the same OUT never share one; a failed write removes it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = temporary_path(path)
    try:
        # Exclusive: fails rather than share a name. open() creates it with the umask's mode, which the bytes written
        # next keep: every output gets the mode a plain open() would give it (no mkstemp-like 0600).
        with open(temp, "xb"):
            pass
        write_value(temp, value, path.suffix)
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(OSError):  # a read-only file system refuses even that; the write error matters
            temp.unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def staging_folder(destination: Path, prefix: str, last: tuple[str, ...] = ()):
    """A fresh temporary folder inside `destination` (`PREFIX…tmp`, unique to this writer) for files that must
    appear together: when the block succeeds they are moved into `destination` (renames on one file system; the
    names in `last` after the others, e.g. the file that says the rest is complete), and the folder is removed in
    every case. A failed or interrupted write leaves no partial file under a final name, and a crashed earlier
    writer's folder is never reused. The folder is locked while it exists, so that remove_abandoned_staging can
    tell it from one a kill -9 left."""
    destination.mkdir(parents=True, exist_ok=True)
    staging = lock = None
    try:
        with signals_deferred():  # no Ctrl-C between making the folder and owning it
            staging = Path(tempfile.mkdtemp(prefix=prefix, suffix=".tmp", dir=destination))
            lock = lock_folder(staging)
        yield staging
        order = {name: rank for rank, name in enumerate(last, start=1)}  # the others first (rank 0), by name
        with signals_deferred():  # all moved or none
            for item in sorted(staging.iterdir(), key=lambda item: (order.get(item.name, 0), item.name)):
                os.replace(item, destination / item.name)
    finally:
        if staging is not None:
            with signals_deferred():  # a second Ctrl-C or SIGTERM would cut the removal short
                shutil.rmtree(staging, ignore_errors=True)
                if lock is not None:
                    os.close(lock)


def lock_folder(folder: Path) -> int | None:
    """An open descriptor of `folder` holding its lock (flock: it goes with the process however it ends), or None
    where there are no locks (the folder is then never taken for abandoned)."""
    if fcntl is None:
        return None
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(descriptor)
        return None
    return descriptor


def remove_abandoned_staging(destination: Path, prefix: str) -> int:
    """staging_folder's folders `PREFIX` + 8 characters + `.tmp` in `destination` whose writer is gone (nobody
    holds the lock: a kill -9, a power loss), removed. Returns how many. (A folder is unlocked for the few
    microseconds between its creation and its lock: a writer starting then, on the same OUT, would lose it.)"""
    names = re.compile(re.escape(prefix) + r"[a-z0-9_]{8}\.tmp")  # tempfile.mkdtemp's 8 characters
    removed = 0
    for folder in destination.iterdir() if fcntl is not None and destination.is_dir() else ():
        if not (names.fullmatch(folder.name) and folder.is_dir() and not folder.is_symlink()):
            continue
        try:
            descriptor = os.open(folder, os.O_RDONLY)
        except OSError:
            continue
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)  # BlockingIOError: its writer is at work
            shutil.rmtree(folder)
            removed += 1
        except OSError:  # held, no locks here, or not ours to remove: leave it
            pass
        finally:
            os.close(descriptor)
    return removed


@contextlib.contextmanager
def signals_deferred():
    """Ctrl-C and SIGTERM held back during the block and raised again when it ends, to the handlers that were in
    place (in the main thread, where Python handles signals; the block must be short: a Ctrl-C waits for it).
    Python-level, because blocking the signal in the OS would only block it for the calling thread, and the
    kernel hands a Ctrl-C to any thread (torch's, ONNX Runtime's) that does not block it."""
    signals = (signal.SIGINT, signal.SIGTERM)
    if threading.current_thread() is not threading.main_thread() or None in map(signal.getsignal, signals):
        yield  # (None: a handler installed outside Python, which could not be put back)
        return
    pending = []
    previous = {sig: signal.signal(sig, lambda signum, frame: pending.append(signum))
                for sig in signals}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if pending:
            signal.raise_signal(pending[0])  # as if it came now


def temporary_path(path: Path, held: bool = False) -> Path:
    """`.NAME.PID.RANDOM.partial` beside `path` (`.NAME.PID.RANDOM.held.partial` for a temporary its writer
    holds locked, see `hold`): unique to this writer, and known to remove_stale_temporaries."""
    # a long name shortened, so that the temporary's name fits where the output's does (255 bytes)
    name = path.name if len(os.fsencode(path.name)) <= 200 else path.name[:50]
    return path.with_name(f".{name}.{os.getpid()}.{secrets.token_hex(4)}{'.held' if held else ''}.partial")


def hold(temp: Path):
    """Create `temp` (a `held` temporary_path) and lock it for as long as the returned file stays open: for a
    temporary written for long (an overlay video), so that remove_stale_temporaries can tell, whatever its age,
    whether its writer is gone (the lock goes with the process however it ends, kill -9 included)."""
    file = open(temp, "xb")  # noqa: SIM115 (open until the writer is done)
    if fcntl is not None:
        with contextlib.suppress(OSError):  # no locks on this file system: the 10-minute rule applies to it
            fcntl.flock(file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    return file


# atomic_write's and hold's names: .NAME.PID.RANDOM.partial, .NAME.PID.RANDOM.held.partial
TEMPORARY = re.compile(r"^\..+\.(\d+)\.[0-9a-f]{8}(\.held)?\.partial$")
STALE_AFTER_S = 600


def remove_stale_temporaries(out: Path) -> int:
    """Temporaries left in OUT by a killed run (kill -9, power loss). A held one as soon as no process holds
    its lock; the others when their process no longer runs here and they were untouched for 10 minutes (on a
    shared disk the process may run on another machine, and would still be writing). Returns how many were
    removed."""
    removed, now = 0, time.time()
    for folder, _, files in os.walk(out):
        for name in files:
            match = TEMPORARY.match(name)
            path = Path(folder) / name
            if not match:
                continue
            try:
                gone = writer_gone(path) if match[2] else None  # None: cannot tell by a lock
                if gone is None:
                    gone = not process_alive(int(match[1])) and now - path.stat().st_mtime > STALE_AFTER_S
                if gone:
                    path.unlink()
                    removed += 1
            except OSError:  # gone meanwhile, or not ours to remove: leave it
                pass
    return removed


def writer_gone(path: Path) -> bool | None:
    """Whether nobody holds a held temporary's lock; None when this system cannot tell (no locks)."""
    if fcntl is None:
        return None
    with open(path, "rb") as file:
        try:
            fcntl.flock(file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # its writer holds it
        except OSError:
            return None
        return True


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True  # alive, another user's (or an impossible pid: do not guess)
    return True


def write_value(file: Path, value, suffix: str):
    """Write `value` (see encode) into `file`."""
    file.write_bytes(encode(value, suffix))


def encode(value, suffix: str) -> bytes:
    """The bytes of a file whose name ends in `suffix` (`.json`, or `.pose.json`: the last extension counts):
    value is text or bytes (as is), a dict (strict .json), an array (.npy), (tensors, metadata) (.safetensors), a
    PIL image (.png, .jpg). Apart from writing, so that one thread can encode while another writes."""
    suffix = "." + suffix.rsplit(".", 1)[-1]
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode()
    if suffix == ".json":
        return json_text(value).encode()
    if suffix == ".safetensors":
        tensors, metadata = value
        return safetensors_bytes({k: v.contiguous() for k, v in tensors.items()}, metadata)
    buffer = io.BytesIO()
    if suffix == ".npy":
        np.save(buffer, value)
    elif suffix == ".jpg":
        value.save(buffer, format="JPEG", quality=90)
    else:
        value.save(buffer, format="PNG", compress_level=PNG_COMPRESS_LEVEL)
    return buffer.getvalue()


def safetensors_bytes(tensors: dict, metadata: dict | None) -> bytes:
    """safetensors.torch.save with its JSON header's keys sorted. The library writes the metadata and the tensors'
    entries in a Rust HashMap's order, which changes from call to call (15 orders in 20 calls of the same save),
    so the same tensors gave other bytes each time. The data after the header is the library's; the header stays
    padded with spaces to a multiple of 8 bytes, as the format wants for the data's alignment."""
    data = save_safetensors_bytes(tensors, metadata=metadata)
    size = struct.unpack("<Q", data[:8])[0]
    header = json.dumps(json.loads(data[8 : 8 + size]), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    header = header.encode()
    header += b" " * (-len(header) % 8)
    return struct.pack("<Q", len(header)) + header + data[8 + size :]


def json_text(value, indent: int | None = None) -> str:
    """Strict JSON (NaN and Infinity are not JSON; many parsers reject them): non-finite numbers become null."""
    return json.dumps(finite_or_null(value), indent=indent, allow_nan=False)


def finite_or_null(value):
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: finite_or_null(v) for key, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_null(v) for v in value]
    return value


def check_writable(folder: Path):
    """Write and remove a probe file through the same writer as the outputs; raises the OSError if it fails."""
    probe = folder / "sapiens2-write-test"  # its temporary is hidden, like every output's
    atomic_write(probe, b"probe")
    probe.unlink(missing_ok=True)


def os_error_text(error: OSError) -> str:
    """`No space left on device (ENOSPC): out/a.seg.png` from an OSError."""
    code = f" ({errno.errorcode[error.errno]})" if error.errno in errno.errorcode else ""
    where = f": {error.filename}" if error.filename else ""
    return f"{error.strerror or error}{code}{where}"


def probe_error(folder: Path) -> OSError | None:
    """The error writing into `folder` gives now, or None when it takes files."""
    try:
        check_writable(folder)
    except OSError as error:
        return error
    return None
