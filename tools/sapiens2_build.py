"""The build backend of sapiens2 (PEP 517 and PEP 660): lays the checkout out as one `sapiens2` namespace.

A checkout keeps the design card's layout: `sapiens2.py`, `kernels/`, `heads.py`, ..., the commands and `data/` at the
root. Installed, those files become the package `sapiens2` (sapiens2.py is its `__init__.py`), beside `sapiens2_app`.
Nothing else reaches site-packages: no top-level `kernels`, `weights` or `hub` that another distribution could own.
The files are copied byte for byte; no import is rewritten, because the sources already import the one way that
works in both layouts (`from sapiens2 import weights`: sapiens2.py gives itself a `__path__` in a checkout).

    wheel                    sapiens2/__init__.py        <- sapiens2.py
                             sapiens2/{heads,...}.py     <- the library modules and the commands at the root
                             sapiens2/kernels/           <- kernels/
                             sapiens2/data/              <- data/
                             sapiens2/__main__.py        (two generated lines: `python -m sapiens2 ...`)
                             sapiens2_app/               <- sapiens2_app/
    editable wheel           sapiens2_editable.pth + sapiens2_editable_finder.py: an import hook that finds
                             `sapiens2` and `sapiens2_app` in the checkout, and nothing else there.

`installed_files()` is the one table of what goes where; tests/test_install.py checks an installed tree against it.
Only the standard library is used (tomllib; tomli on Python 3.10), so a build needs no network.
"""

from __future__ import annotations

import base64
import hashlib
import io
import re
import sys
import tarfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NAME = "sapiens2"
LIBRARY = ("heads.py", "processing.py", "weights.py", "losses.py", "hub.py")
COMMANDS = ("predict.py", "train.py", "export.py", "serve.py")  # each has main(argv) -> exit code
MAIN = "from sapiens2_app.commands import main\n\nraise SystemExit(main())\n"
SDIST_EXTRA = ("pyproject.toml", "README.md", "LICENSE", "tools/sapiens2_build.py")
SKIPPED_PARTS = {"__pycache__"}


def _toml():
    if sys.version_info >= (3, 11):
        import tomllib
        return tomllib
    import tomli  # listed by get_requires_for_build_wheel on Python 3.10
    return tomli


def project_table() -> dict:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return _toml().load(f)["project"]


def version() -> str:
    """`__version__` of sapiens2.py: its one home (pyproject.toml declares the version dynamic)."""
    match = re.search(r'^__version__ = "([^"]+)"', (ROOT / "sapiens2.py").read_text(encoding="utf-8"), re.M)
    if not match:
        raise RuntimeError("sapiens2.py defines no __version__ = \"...\" line")
    return match.group(1)


def _tree(folder: str, suffixes: tuple[str, ...]) -> list[Path]:
    files = [p for p in sorted((ROOT / folder).rglob("*")) if p.is_file() and p.suffix in suffixes
             and not SKIPPED_PARTS.intersection(p.relative_to(ROOT).parts)]
    return [p.relative_to(ROOT) for p in files]


def installed_files() -> dict[str, Path]:
    """{path in site-packages: source file in the checkout}, for every file of the wheel but the generated ones."""
    layout = {f"{NAME}/__init__.py": Path("sapiens2.py")}
    for name in LIBRARY + COMMANDS:
        if (ROOT / name).is_file():
            layout[f"{NAME}/{name}"] = Path(name)
    for source in _tree("kernels", (".py", ".md")):
        layout[f"{NAME}/{source.as_posix()}"] = source
    for source in _tree("data", (".json",)):
        layout[f"{NAME}/{source.as_posix()}"] = source
    for source in _tree("sapiens2_app", (".py", ".html", ".js", ".css", ".png", ".svg", ".ico")):
        layout[source.as_posix()] = source
    return layout


# ----------------------------------------------------------------------------------------------------------------
# Metadata (core metadata 2.1 from pyproject.toml's [project])
# ----------------------------------------------------------------------------------------------------------------

def metadata() -> str:
    project = project_table()
    lines = ["Metadata-Version: 2.1", f"Name: {NAME}", f"Version: {version()}",
             f"Summary: {project.get('description', '')}", f"Requires-Python: {project['requires-python']}",
             f"License: {project.get('license', '')}"]
    lines += [f"Requires-Dist: {dep}" for dep in project.get("dependencies", [])]
    for extra, deps in project.get("optional-dependencies", {}).items():
        lines.append(f"Provides-Extra: {extra}")
        lines += [f"Requires-Dist: {_with_extra(dep, extra)}" for dep in deps]
    lines.append("Description-Content-Type: text/markdown")
    return "\n".join(lines) + "\n\n" + (ROOT / "README.md").read_text(encoding="utf-8")


def _with_extra(requirement: str, extra: str) -> str:
    requirement, _, marker = requirement.partition(";")
    marker = f"({marker.strip()}) and extra == '{extra}'" if marker.strip() else f"extra == '{extra}'"
    return f"{requirement.strip()}; {marker}"


def entry_points() -> str:
    scripts = project_table().get("scripts", {})
    return "[console_scripts]\n" + "".join(f"{name} = {target}\n" for name, target in scripts.items())


def dist_info() -> str:
    return f"{NAME}-{version()}.dist-info"


def _dist_info_files() -> dict[str, bytes]:
    wheel = "Wheel-Version: 1.0\nGenerator: sapiens2_build\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    return {f"{dist_info()}/METADATA": metadata().encode(), f"{dist_info()}/WHEEL": wheel.encode(),
            f"{dist_info()}/entry_points.txt": entry_points().encode(),
            f"{dist_info()}/licenses/LICENSE": (ROOT / "LICENSE").read_bytes()}


# ----------------------------------------------------------------------------------------------------------------
# Writing wheels
# ----------------------------------------------------------------------------------------------------------------

def _record_line(path: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{path},sha256={digest},{len(data)}"


def _write_wheel(directory: str, files: dict[str, bytes]) -> str:
    """A py3-none-any wheel of `files` {archive path: bytes}, with its dist-info and RECORD."""
    files = {**files, **_dist_info_files()}
    name = f"{NAME}-{version()}-py3-none-any.whl"
    record = f"{dist_info()}/RECORD"
    lines = [_record_line(path, data) for path, data in files.items()] + [f"{record},,"]
    with zipfile.ZipFile(Path(directory) / name, "w", zipfile.ZIP_DEFLATED) as wheel:
        for path, data in [*files.items(), (record, ("\n".join(lines) + "\n").encode())]:
            info = zipfile.ZipInfo(path, date_time=(2020, 1, 1, 0, 0, 0))  # reproducible: no build time inside
            info.external_attr = 0o644 << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            wheel.writestr(info, data)
    return name


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None) -> str:
    files = {path: (ROOT / source).read_bytes() for path, source in installed_files().items()}
    files[f"{NAME}/__main__.py"] = MAIN.encode()
    return _write_wheel(wheel_directory, files)


EDITABLE_FINDER = '''"""The editable install of sapiens2 (PEP 660): `sapiens2` and `sapiens2_app` come from the checkout {root!r}.
Only these two names: the checkout's other top-level files (kernels/, weights.py, ...) stay off sys.path."""
import importlib.abc
import importlib.util
import os
import sys

ROOT = {root!r}
PLACES = {{"sapiens2": os.path.join(ROOT, "sapiens2.py"),
           "sapiens2_app": os.path.join(ROOT, "sapiens2_app", "__init__.py")}}


class Sapiens2CheckoutFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name not in PLACES or not os.path.isfile(PLACES[name]):
            return None
        folder = ROOT if name == "sapiens2" else os.path.dirname(PLACES[name])
        return importlib.util.spec_from_file_location(name, PLACES[name], submodule_search_locations=[folder])


if not any(type(finder).__name__ == "Sapiens2CheckoutFinder" for finder in sys.meta_path):
    sys.meta_path.insert(0, Sapiens2CheckoutFinder())
'''


def build_editable(wheel_directory, config_settings=None, metadata_directory=None) -> str:
    files = {"sapiens2_editable_finder.py": EDITABLE_FINDER.format(root=str(ROOT)).encode(),
             "sapiens2_editable.pth": b"import sapiens2_editable_finder\n"}
    return _write_wheel(wheel_directory, files)


def _requires(config_settings=None) -> list[str]:
    return [] if sys.version_info >= (3, 11) else ["tomli"]


get_requires_for_build_wheel = get_requires_for_build_editable = get_requires_for_build_sdist = _requires


def _prepare_metadata(metadata_directory, config_settings=None) -> str:
    for path, data in _dist_info_files().items():
        target = Path(metadata_directory) / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
    return dist_info()


prepare_metadata_for_build_wheel = prepare_metadata_for_build_editable = _prepare_metadata


# ----------------------------------------------------------------------------------------------------------------
# The source distribution: the files the wheel is made of, and this backend
# ----------------------------------------------------------------------------------------------------------------

def build_sdist(sdist_directory, config_settings=None) -> str:
    base = f"{NAME}-{version()}"
    sources = sorted({*installed_files().values(), *map(Path, SDIST_EXTRA)})
    pkg_info = metadata().encode()
    name = f"{base}.tar.gz"
    with tarfile.open(Path(sdist_directory) / name, "w:gz", format=tarfile.PAX_FORMAT) as sdist:
        for source in sources:
            sdist.add(ROOT / source, arcname=f"{base}/{source.as_posix()}", filter=_reproducible)
        info = tarfile.TarInfo(f"{base}/PKG-INFO")
        info.size, info.mode = len(pkg_info), 0o644
        sdist.addfile(info, io.BytesIO(pkg_info))
    return name


def _reproducible(info: tarfile.TarInfo) -> tarfile.TarInfo:
    info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
    info.mode = 0o755 if info.mode & 0o100 else 0o644
    return info


if __name__ == "__main__":  # python tools/sapiens2_build.py [DIR]: a wheel into DIR (default dist/)
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "dist")
    out.mkdir(parents=True, exist_ok=True)
    print(out / build_wheel(str(out)))
