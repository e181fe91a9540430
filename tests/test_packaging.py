"""A non-editable `pip install .` into a folder: the package sapiens2 (the library, the commands, kernels/ and the data
files) and sapiens2_app go there, the one command `sapiens2` to bin/; a command run from the installation (not from
the checkout) finds the data; an installation that lost a data file stops before any model loads, naming the file.
(tests/test_install.py installs into a fresh venv beside transformers and HF's kernels.)"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from sapiens2.processing import DATA_FILES

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The project built into a wheel from a copy of the checkout (so nothing is written into it) and installed
    with pip into a folder of its own."""
    tmp = tmp_path_factory.mktemp("install")
    source = tmp / "source"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".git", ".venv", "tests", "bench", "build", "*.egg-info",
                                                                "__pycache__", "demo_out", "assets"))
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "-w", str(tmp / "dist"), str(source)],
                   check=True, cwd=tmp)
    wheel, = (tmp / "dist").glob("sapiens2-*.whl")
    site = tmp / "site"
    subprocess.run([*pip, "install", "--no-deps", "--target", str(site), str(wheel)], check=True, cwd=tmp)
    return site


def run_installed(site: Path, *args, cwd: Path) -> subprocess.CompletedProcess:
    """python with only the installation on the path (run from a folder outside the checkout)."""
    env = {**os.environ, "PYTHONPATH": str(site)}
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_wheel_installs_the_data_files(installed, tmp_path):
    assert sorted(p.name for p in (installed / "sapiens2" / "data").glob("*.json")) == sorted(DATA_FILES)
    check = ("from sapiens2 import processing; from sapiens2_app.predict import formats; "
             "print(processing.DATA_DIR); print(len(processing.keypoint_metadata()['keypoint_names']), "
             "len(processing.segmentation_metadata()['class_names']), len(formats.openpose_table()))")
    done = run_installed(installed, "-c", check, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    data_dir, counts = done.stdout.splitlines()
    assert Path(data_dir) == installed / "sapiens2" / "data"
    assert counts == "308 29 4"


def test_wheel_installs_the_served_page(installed):
    """serve.py's page is package data of sapiens2_app (the server reads it from beside its module)."""
    static = installed / "sapiens2_app" / "serve" / "static"
    assert sorted(p.name for p in static.iterdir()) == ["serve.css", "serve.html", "serve.js"]
    assert all((static / p.name).read_bytes() == p.read_bytes() for p in (ROOT / "sapiens2_app" / "serve" / "static").iterdir())


def test_only_sapiens2_names_are_installed(installed):
    """site-packages gets the package sapiens2 and sapiens2_app, nothing with a generic name (kernels, weights, hub,
    train, ...); bin/ gets the one command."""
    top = {p.name for p in installed.iterdir() if not p.name.endswith(".dist-info") and p.name != "__pycache__"}
    assert top == {"bin", "sapiens2", "sapiens2_app"}, top
    assert [p.name for p in (installed / "bin").iterdir()] == ["sapiens2"]
    assert {"predict.py", "train.py", "export.py", "__main__.py"} <= {p.name for p in (installed / "sapiens2").iterdir()}


def test_installed_export_runs_from_elsewhere(installed, tmp_path):
    """Every folder of sapiens2_app is installed, and `python -m sapiens2 export` reaches the checks that live in
    sapiens2_app/export/ (a wrong -o suffix: one line, exit 2, before any model loads)."""
    folders = {p.name for p in (ROOT / "sapiens2_app").iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders <= {p.name for p in (installed / "sapiens2_app").iterdir()}
    done = run_installed(installed, "-m", "sapiens2", "export", "seg", "--format", "torch-export", "-o", "model.onnx",
                         cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert done.stderr == "error: -o model.onnx: a torch-export file should end in .pt2, e.g. -o model.pt2\n"


def test_installed_predict_runs_from_elsewhere(installed, tmp_path):
    Image.fromarray(np.full((40, 30, 3), 128, np.uint8)).save(tmp_path / "photo.png")
    done = run_installed(installed, "-m", "sapiens2", "predict", "seg", "photo.png", "-o", "out",
                         "--random-init", "always", "--random-backbone", "0.1b", "--size", "64x48", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "out" / "photo.seg.png").is_file()


def test_a_missing_data_file_stops_before_any_model_loads(installed, tmp_path):
    broken = tmp_path / "site"
    shutil.copytree(installed, broken)
    (broken / "sapiens2" / "data" / "seg29.json").unlink()
    Image.fromarray(np.full((40, 30, 3), 128, np.uint8)).save(tmp_path / "photo.png")
    done = run_installed(broken, "-m", "sapiens2", "predict", "seg", "photo.png", "-o", "out",
                         "--random-init", "always", "--random-backbone", "0.1b", "--size", "64x48", cwd=tmp_path)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "seg29.json" in lines[0], done.stderr
    assert "installation is incomplete" in lines[0] and "RANDOM" not in done.stderr  # no model was built
    assert not (tmp_path / "out").exists()
