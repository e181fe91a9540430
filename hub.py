"""The Hugging Face Hub: where a hub id's checkpoint folder is (config.json + model.safetensors or shards).

The Hugging Face cache first (where transformers users already have the weights), then a download, with
huggingface_hub when it is installed (its cache, auth, resume), else with the built-in downloader into
~/.cache/sapiens2 (SAPIENS2_CACHE). HF_ENDPOINT, HF_TOKEN, HF_HUB_OFFLINE, HF_HOME, HF_HUB_CACHE are honoured.
weights.resolve and the person detector's loader call `download`; reading the folder is weights.py's job.
"""

from __future__ import annotations

if __name__ == "hub":  # a bare `import hub` in a checkout gives the one module, sapiens2.hub
    __import__("sapiens2").one_module(__name__)

import contextlib
import importlib.util
import json
import os
import re
import socket
import sys
import tempfile
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from sapiens2 import PRESETS
from sapiens2.heads import TASK_PRESETS

try:
    import fcntl  # POSIX file locks: one process downloads, the others wait for it (see download_lock)
except ImportError:  # Windows: no lock; each process then downloads into its own temporary file
    fcntl = None

INSTALL_HINT = "pip install huggingface_hub  (or: pip install 'sapiens2[hub]')"
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# Released checkpoints by preset name: pretrain by size ("0.4b"; the 4K variant has no Hub repo: HF cannot
# represent its tokenizer), task models as "seg-0.4b" (albedo: none released).
HUB_IDS = {name: f"facebook/sapiens2-pretrain-{name}" for name, c in PRESETS.items() if not c.use_tokenizer}
HUB_IDS.update({name: f"facebook/sapiens2-{name}" for name in TASK_PRESETS if not name.startswith("albedo")})


def cache_dir() -> Path:
    return Path(os.environ.get("SAPIENS2_CACHE", Path.home() / ".cache" / "sapiens2"))


def _fetch(url: str, target: Path, progress: bool = True) -> bool:
    """Download url to target, resuming what a stopped download left in `target.part`. False on HTTP 404.

    The bytes go to a temporary file of this process alone (a `.part` left behind is first moved there, which only
    one process can do), renamed into place once complete: target is never seen half written, even by processes
    that share no lock."""
    part = target.with_name(target.name + ".part")
    fd, name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    os.close(fd)
    temporary = Path(name)
    with contextlib.suppress(FileNotFoundError):
        os.replace(part, temporary)  # take over a partial download
    try:
        found = _fetch_into(url, temporary, target.name, progress)
    except BaseException:
        if temporary.stat().st_size:
            os.replace(temporary, part)  # kept for the next try to resume
        temporary.unlink(missing_ok=True)
        raise
    if found:
        os.replace(temporary, target)
    else:
        temporary.unlink()
    return found


def _fetch_into(url: str, temporary: Path, name: str, progress: bool) -> bool:
    """Append url's bytes past temporary's current size to it (HTTP Range). False on HTTP 404."""
    start = temporary.stat().st_size
    request = urllib.request.Request(url, headers={"User-Agent": "sapiens2"})
    if os.environ.get("HF_TOKEN"):
        request.add_header("Authorization", f"Bearer {os.environ['HF_TOKEN']}")
    if start:
        request.add_header("Range", f"bytes={start}-")
    try:
        response = urllib.request.urlopen(request, timeout=60)
    except urllib.error.HTTPError as e:
        if e.code == 404:
            return False
        if e.code == 416:  # the partial file is already complete
            return True
        raise
    with response:
        resumed = response.status == 206
        total = int(response.headers.get("Content-Length", 0)) + (start if resumed else 0)
        done = start if resumed else 0
        with open(temporary, "ab" if resumed else "wb") as out:
            while chunk := response.read(1 << 20):
                out.write(chunk)
                done += len(chunk)
                if progress and total:
                    print(f"\r{name}: {done / 2**20:.0f}/{total / 2**20:.0f} MiB", end="", file=sys.stderr)
    if progress and total:
        print(file=sys.stderr)
    return True


@contextlib.contextmanager
def download_lock(entry: Path):
    """Hold `<entry>.lock`, the lock file beside a cache entry, while downloading into it: of N processes that need
    the same checkpoint (torchrun's ranks), one downloads and the others wait, then find it complete. The OS drops
    the lock when its holder exits, however it exits."""
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        lock = open(entry.with_name(entry.name + ".lock"), "a")
    except OSError:  # a cache folder this process cannot write (huggingface_hub may still write its own): no lock
        yield
        return
    with lock:
        if fcntl is not None:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                print(f"waiting for another process downloading into {entry}", file=sys.stderr)
                fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def download(repo_id: str, revision: str = "main", progress: bool = True) -> Path:
    """A local directory holding repo_id's config.json and weights: a complete copy in our cache or the
    Hugging Face cache, else downloaded (huggingface_hub when installed, else the built-in downloader)."""
    local = cache_dir() / repo_id.replace("/", "--") / revision
    for found in (local, hf_cache_snapshot(repo_id, revision)):
        if found is not None and _complete(found):
            return found
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false"):
        raise FileNotFoundError(_how_to_get(repo_id, revision, local, "HF_HUB_OFFLINE is set"))
    try:
        import huggingface_hub
        import huggingface_hub.errors
    except ImportError:  # optional: the built-in downloader does the same, without auth helpers or xet
        huggingface_hub = None
    where = local if huggingface_hub is None else hf_cache_dir() / f"models--{repo_id.replace('/', '--')}"
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")
    unresolvable = _unresolvable_host(endpoint)
    if unresolvable:  # no network: fail at once (huggingface_hub would retry each file for ~25 s first)
        raise FileNotFoundError(_how_to_get(repo_id, revision, where, f"download failed: {unresolvable}"))
    with download_lock(local):  # in our cache with either downloader: one lock per repo id and revision
        for found in (local, hf_cache_snapshot(repo_id, revision)):  # another process may have finished meanwhile
            if found is not None and _complete(found):
                return found
        if huggingface_hub is None:
            return _download_builtin(repo_id, revision, local, endpoint, progress)
        return _download_with_hub(huggingface_hub, repo_id, revision, endpoint, where)


def _complete(directory: Path) -> bool:
    """model.safetensors, or an index and every shard it lists."""
    index = directory / "model.safetensors.index.json"
    if (directory / "model.safetensors").exists():
        return True
    return index.exists() and all((directory / s).exists() for s in _shard_names(index))


def hf_cache_dir() -> Path:
    """The Hugging Face hub cache, by huggingface_hub's rules (read from the environment at call time)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "huggingface"
    return Path(home).expanduser() / "hub"


def hf_cache_snapshot(repo_id: str, revision: str = "main") -> Path | None:
    """The snapshot directory of repo_id@revision in the Hugging Face cache, if there is one
    (models--<owner>--<name>/snapshots/<commit>, the commit read from refs/<revision>)."""
    repo = hf_cache_dir() / f"models--{repo_id.replace('/', '--')}"
    ref = repo / "refs" / revision
    commit = ref.read_text().strip() if ref.is_file() else revision
    snapshot = repo / "snapshots" / commit
    return snapshot if snapshot.is_dir() else None


def _download_with_hub(hub, repo_id: str, revision: str, endpoint: str, where: Path) -> Path:
    """Download into the Hugging Face cache (`where`: the repo's folder there) with huggingface_hub; the snapshot
    directory."""
    get = lambda name: Path(hub.hf_hub_download(  # noqa: E731
        repo_id, name, revision=revision, cache_dir=hf_cache_dir(), endpoint=endpoint))
    try:
        _hub_optional(hub, get, "config.json")
        weights_file = _hub_optional(hub, get, "model.safetensors")
        if weights_file is not None:
            return weights_file.parent
        index = _hub_optional(hub, get, "model.safetensors.index.json")
        if index is None:
            raise FileNotFoundError(f"{repo_id}@{revision} has neither model.safetensors nor an index")
        for shard in _shard_names(index):  # a malformed index is reported by the loader, naming it
            get(shard)
        return index.parent
    except FileNotFoundError as e:
        if isinstance(e, hub.errors.LocalEntryNotFoundError):  # the Hub could not be reached
            raise FileNotFoundError(_how_to_get(repo_id, revision, where, f"download failed: {e}")) from e
        raise
    except (hub.errors.HfHubHTTPError, OSError) as e:
        raise FileNotFoundError(_how_to_get(repo_id, revision, where, f"download failed: {e}")) from e


def _unresolvable_host(endpoint: str) -> str | None:
    """Why the endpoint's host name cannot be resolved (offline, no DNS), or None when it can."""
    host = urllib.parse.urlsplit(endpoint).hostname
    try:
        socket.getaddrinfo(host, None)
    except (OSError, UnicodeError) as e:
        return f"cannot resolve {host} ({e})"
    return None


def _hub_optional(hub, get, name: str) -> Path | None:
    """get(name), or None when the repo has no such file (HTTP 404, which huggingface_hub may wrap)."""
    try:
        return get(name)
    except (hub.errors.HfHubHTTPError, hub.errors.LocalEntryNotFoundError) as e:
        if any(getattr(getattr(x, "response", None), "status_code", None) == 404 for x in (e, e.__cause__)):
            return None
        raise


def _download_builtin(repo_id: str, revision: str, local: Path, endpoint: str, progress: bool) -> Path:
    have = lambda name: (local / name).exists()  # noqa: E731
    local.mkdir(parents=True, exist_ok=True)
    url = f"{endpoint}/{repo_id}/resolve/{revision}/"
    try:
        _fetch(url + "config.json", local / "config.json", progress=False)  # optional
        if not _fetch(url + "model.safetensors", local / "model.safetensors", progress):
            if not _fetch(url + "model.safetensors.index.json", local / "model.safetensors.index.json", False):
                raise FileNotFoundError(f"{repo_id}@{revision} has neither model.safetensors nor an index at {url}")
            for shard in _shard_names(local / "model.safetensors.index.json"):
                if not have(shard) and not _fetch(url + shard, local / shard, progress):
                    raise FileNotFoundError(f"{repo_id}: shard {shard} listed in the index is missing at {url}")
    except FileNotFoundError:
        raise
    except (urllib.error.URLError, OSError) as e:
        raise FileNotFoundError(_how_to_get(repo_id, revision, local, f"download failed: {e}")) from e
    return local


def _how_to_get(repo_id, revision, local, why) -> str:
    without_hub = "" if importlib.util.find_spec("huggingface_hub") else (
        f" huggingface_hub, when installed, downloads with its cache, auth and resume: {INSTALL_HINT}.")
    return (
        f"cannot get {repo_id} ({why}). Download model.safetensors (and config.json) from "
        f"https://huggingface.co/{repo_id}/tree/{revision} and put them in {local}, or pass the file's path."
        + without_hub
    )


def _shard_names(index: Path) -> list[str]:
    """The shard files an index lists; none when it is not a readable index: the folder then counts as
    complete, and the loader, reading the index (weights.read_json), names the file and what is wrong."""
    try:
        listing = json.loads(Path(index).read_text())
    except (OSError, ValueError):  # unreadable, not UTF-8 (UnicodeDecodeError), not JSON: all ValueErrors but OSError
        return []
    weight_map = listing.get("weight_map") if isinstance(listing, dict) else None
    return sorted({v for v in weight_map.values() if isinstance(v, str)}) if isinstance(weight_map, dict) else []
