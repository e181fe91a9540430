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

SHARED = Path(os.environ.get("SAPIENS2_SHARED", ROOT.parent / "shared"))
FIXTURES = SHARED / "fixtures" / "original"


@pytest.fixture
def fixtures_dir() -> Path:
    if not FIXTURES.is_dir():
        message = f"golden fixtures not found at {FIXTURES} (set SAPIENS2_SHARED)"
        if os.environ.get("CI"):
            pytest.fail(message)  # CI always has them: a missing copy is an error, not a skip
        pytest.skip(message)
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


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected|: the relative error every parity test reports."""
    return ((actual.double() - expected.double()).abs().max() / expected.double().abs().max()).item()
