"""The Makefile on a user's machine: `make test` installs Python packages into .venv and nothing else. It never
escalates (no sudo) and installs no system package; the browser of the real-browser test is `make browser`'s job,
run as root, which .ci/run does before `make test`."""

import re
import shutil
import subprocess

import pytest

from conftest import ROOT


def dry_run(*targets: str, venv: str) -> str:
    """What make would run for targets, without running it (make -n), for a .venv that does not exist yet."""
    if shutil.which("make") is None:
        pytest.skip("no make here (the Makefile's targets need it)")
    done = subprocess.run(["make", "-n", *targets, f"VENV={venv}"], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.parametrize("target", ["test", "env", "demo"])
def test_make_never_escalates_nor_installs_system_packages(target, tmp_path):
    commands = dry_run(target, venv=str(tmp_path / "venv"))
    assert "pip install" in commands  # the dry run did reach the install steps
    for word in ("sudo", "apt-get", "apt ", "dnf", "brew"):
        assert word not in commands, f"make {target} would run {word!r}:\n{commands}"


def test_ci_installs_the_browser_before_the_suite():
    steps = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()
             if line.strip().startswith(("make", "for target"))]
    assert steps[:2] == ["make browser", "for target in test test-floor test-latest; do"], steps


def test_runtime_floors_are_the_same_in_requirements_and_pyproject():
    """requirements.txt (make test, make test-floor) and pyproject.toml (pip install) declare the same floors."""
    lines = (ROOT / "requirements.txt").read_text().splitlines()
    required = [line.split("#")[0].strip() for line in lines if line.split("#")[0].strip()]
    declared = re.search(r"^dependencies = \[(.*?)\]", (ROOT / "pyproject.toml").read_text(), re.MULTILINE)
    assert re.findall(r'"([^"]+)"', declared.group(1)) == required
