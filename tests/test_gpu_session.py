"""bench/gpu_session.sh dry run, no GPU: a stub python3 that records its calls. The steps run in the stated
order (attention first), a step that hangs is stopped and the deadline holds, later steps are reported as
not run, and everything lands in $OUT."""

import os
import shutil
import subprocess
import time

import pytest

from conftest import ROOT

STUB = """#!/usr/bin/env bash
echo "$*" >> "$STUB_LOG"
if [[ "$*" == *"$STUB_HANG_MATCH"* ]]; then exec sleep 1000; fi  # exec: the INT reaches the sleeper
"""


@pytest.mark.skipif(shutil.which("timeout") is None or shutil.which("bash") is None, reason="needs bash and timeout")
def test_gpu_session_order_and_deadline(tmp_path):
    stub = tmp_path / "python3"
    stub.write_text(STUB)
    stub.chmod(0o755)
    out, log = tmp_path / "out", tmp_path / "calls.log"
    env = dict(os.environ, PYTHON=str(stub), OUT=str(out), STUB_LOG=str(log), STUB_HANG_MATCH="--presets 5b,0.8b",
               DEADLINE="6", MIN_STEP="1", WHEELS=str(tmp_path / "none"))
    t = time.time()
    proc = subprocess.run(["bash", str(ROOT / "bench" / "gpu_session.sh")], env=env, capture_output=True,
                          text=True, timeout=60)
    assert time.time() - t < 6 + 5  # the deadline, and no kill-after grace needed
    assert proc.returncode == 0, proc.stderr
    calls = [line for line in log.read_text().splitlines() if line.startswith("bench/")]
    assert [c.split(" --out")[0].split("--presets ")[1].split(" ")[0] for c in calls] == ["0.4b", "0.4b,5b", "5b,0.8b"]
    assert "--ops attention" in calls[0] and "--ops copy,qk_norm_rope" in calls[1]
    session = (out / "gpu-session.log").read_text()
    assert "step 3 attention 5b, 0.8b: exit 124" in session  # stopped at the deadline
    assert "step 4 e2e backbone 0.4b: not run" in session and "step 5 kernel tests on CUDA: not run" in session
    assert all(str(out) in c for c in calls)  # results to $OUT, never bench/results
