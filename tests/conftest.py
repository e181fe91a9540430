import contextlib
import os
import sys
from pathlib import Path

import pytest
import torch

# Without CUDA, the Triton kernels run in Triton's CPU interpreter. Triton fixes its mode when a kernel module is
# first imported, and any test module may import one while pytest collects (train.py, export.py, the model), so
# the switch is made here, before every test module, not in tests/test_kernels.py alone.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# The original code's golden outputs: tests/fixtures/original/README.md says which cases and how they were made.
FIXTURES = ROOT / "tests" / "fixtures" / "original"


def original_case_dir(name: str) -> Path:
    """The folder that holds fixture case `name` (`name.safetensors`, `.io.safetensors`, `.json`). The cases are part
    of the repository: a missing file fails the test, it never skips it."""
    missing = [f.name for f in (FIXTURES / f"{name}{ext}" for ext in (".safetensors", ".io.safetensors", ".json"))
               if not f.is_file()]
    if missing:
        pytest.fail(f"golden fixtures missing from {FIXTURES}: {', '.join(missing)} (they are part of the repository; "
                    f"tests/fixtures/make_original_fixtures.py makes them again)")
    return FIXTURES


@pytest.fixture(autouse=True)
def _seed_and_threads():
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True)
def _no_downloads(tmp_path_factory, monkeypatch):
    """Tests never download: an empty cache, offline (a test that serves a hub of its own overrides both). Without
    this, `predict.py pose` would fetch the default person detector from the hub."""
    monkeypatch.setenv("SAPIENS2_CACHE", str(tmp_path_factory.mktemp("empty_cache")))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


class OptionalTransformers:
    """transformers, imported when a test first uses it (`transformers.Sapiens2Model`): the parity tests' oracle.
    A test that uses it skips where it is missing, and only that test: make test-floor's venv has none
    (transformers 5.23 needs a newer torch and safetensors than the library's floors). make test installs it."""

    def __init__(self):
        # Imported now, while the test module is collected, as a plain import would: huggingface_hub (which it imports)
        # reads HF_HUB_OFFLINE once, at its import, and a test's import would see _no_downloads' offline setting.
        with contextlib.suppress(ImportError):
            import transformers  # noqa: F401

    def __getattr__(self, name: str):
        if name.startswith("_"):  # pytest's collection probes module globals (__test__, _pytestfixturefunction)
            raise AttributeError(name)
        return getattr(pytest.importorskip("transformers"), name)


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected|: the relative error every parity test reports."""
    return ((actual.double() - expected.double()).abs().max() / expected.double().abs().max()).item()
