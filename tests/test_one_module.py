"""One module per name: in a checkout, the library's bare file names (`import heads`, `import kernels`) give the very
module objects of the namespace (`from sapiens2 import heads`), in either order of import.

Two copies would break quietly: an instance of the copy's class fails isinstance against the other's, and a
function swapped into the copy's `kernels` never reaches the model (docs/research.md teaches that swap). Each
check runs in a fresh interpreter, since what a process imported first is the point.
"""

import json
import subprocess
import sys

from conftest import FIXTURES, ROOT

NAMES = ("heads", "weights", "processing", "losses", "hub", "kernels")

# Bare names first (what an older script or notebook does), then the namespace.
BARE_FIRST = f"""
import json, sys, torch
sys.path.insert(0, {str(ROOT)!r})
import heads, weights, processing, losses, hub, kernels
import sapiens2
from sapiens2 import heads as h2, weights as w2, processing as p2, losses as l2, hub as hb2, kernels as k2
same = [a is b for a, b in zip((heads, weights, processing, losses, hub, kernels), (h2, w2, p2, l2, hb2, k2))]
model = weights.load({str(FIXTURES / "public_pose.safetensors")!r})
calls = []
def counting_attention(q, k, v, scale=None):
    calls.append(q.shape)
    return kernels.attention_reference(q, k, v, scale)
kernels.attention = counting_attention
config = sapiens2.Sapiens2Config(embed_dim=32, depth=2, num_heads=2, full_attention_first=1, full_attention_last=1)
with torch.no_grad():
    sapiens2.Sapiens2(config).eval()(torch.randn(1, 3, 32, 32))
print(json.dumps({{"same": same, "pose_class": isinstance(model, heads.Sapiens2ForPose) and isinstance(model, h2.Sapiens2ForPose),
                  "attention_calls": len(calls),
                  "submodule": sys.modules.get("kernels.attention") is sys.modules["sapiens2.kernels.attention"]}}))
"""

# The namespace first, then the bare names.
NAMESPACE_FIRST = f"""
import json, sys
sys.path.insert(0, {str(ROOT)!r})
from sapiens2 import heads as h2, weights as w2, processing as p2, losses as l2, hub as hb2, kernels as k2
import heads, weights, processing, losses, hub, kernels
same = [a is b for a, b in zip((heads, weights, processing, losses, hub, kernels), (h2, w2, p2, l2, hb2, k2))]
print(json.dumps({{"same": same}}))
"""


def run_fresh(code: str) -> dict:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_bare_names_are_the_namespace_modules():
    out = run_fresh(BARE_FIRST)
    assert dict(zip(NAMES, out["same"])) == dict.fromkeys(NAMES, True)
    assert out["pose_class"], "weights.load's model is no instance of the bare heads.Sapiens2ForPose"
    assert out["attention_calls"] == 2, "kernels.attention swapped through the bare name did not reach the model"
    assert out["submodule"], "kernels.attention (the submodule) is loaded twice"


def test_namespace_first_then_bare_names():
    out = run_fresh(NAMESPACE_FIRST)
    assert dict(zip(NAMES, out["same"])) == dict.fromkeys(NAMES, True)
