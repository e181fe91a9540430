"""`pip install` lands as one `sapiens2` namespace and leaves every other distribution alone (issue 30).

A fresh venv gets torch, transformers 5.23.0 and Hugging Face's `kernels` (the hub-kernels package, whose import
name our kernels/ folder shares) from the registry; then our wheel, then our editable install. Checked: only
`sapiens2*` names land in site-packages and bin/, HF kernels' files are byte-identical after installing and after
uninstalling, `from kernels import get_kernel` works in a process that ran our model, the installed library builds,
saves, loads and runs a model equal to the checkout's, and `sapiens2 predict` runs. sapiens2.py copied alone into an
empty folder runs too, on its PlainKernels, equal to kernels/' references bit for bit.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import sapiens2
from sapiens2 import kernels

ROOT = Path(__file__).resolve().parents[1]
HF_KERNELS = "kernels==0.17.2"  # the hub-kernels release transformers 5.23.0 works with
TRANSFORMERS = "transformers==5.23.0"
TINY_CONFIG = dict(embed_dim=64, depth=2, num_heads=4, gqa_kv_heads=2, full_attention_first=1, full_attention_last=0,
                   image_size=(64, 48))  # one full and one GQA block
TINY = repr(TINY_CONFIG)


def load_build_backend():
    spec = importlib.util.spec_from_file_location("sapiens2_build", ROOT / "tools" / "sapiens2_build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run(args, cwd: Path, env: dict | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    done = subprocess.run([str(a) for a in args], cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1", **(env or {})})
    assert done.returncode == 0, f"{' '.join(map(str, args))}\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    return done


def registry_unreachable(error: str):
    """The registry is part of CI's machine: there a failed download is a failure; elsewhere (offline) a skip."""
    if os.environ.get("CI"):
        pytest.fail(error)
    pytest.skip(f"the package registry is not reachable here: {error.splitlines()[-1] if error else ''}")


def snapshot(folder: Path) -> dict[str, str]:
    """{relative path: sha256} of every file under folder (compiled caches left out: Python writes those)."""
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and "__pycache__" not in p.parts}


class Venv:
    def __init__(self, path: Path):
        self.path = path
        self.python = path / "bin" / "python"
        self.bin = path / "bin"
        self.site, = (path / "lib").glob("python3*/site-packages")

    def pip(self, *args, cwd: Path) -> subprocess.CompletedProcess:
        return run([self.python, "-m", "pip", "--disable-pip-version-check", "-q", *args], cwd=cwd)

    def top_level(self) -> set[str]:
        return {p.name for p in self.site.iterdir() if p.name != "__pycache__"}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """`pip wheel .` of the checkout (the build writes nothing into it: checked by the caller's git status)."""
    dist = tmp_path_factory.mktemp("dist")
    run([sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", "wheel", "--no-deps", "-w", dist, ROOT],
        cwd=dist)
    found, = dist.glob("sapiens2-*-py3-none-any.whl")
    return found


@pytest.fixture(scope="module")
def fresh(tmp_path_factory) -> Venv:
    """A new venv with this torch, transformers 5.23.0, HF kernels 0.17.2 and our other runtime dependencies (so that
    what installing the wheel adds is ours alone), and nothing of ours."""
    where = tmp_path_factory.mktemp("venv")
    venv.EnvBuilder(with_pip=True).create(where / "env")
    env = Venv(where / "env")
    torch_spec = f"torch=={torch.__version__.split('+')[0]}"
    runtime = load_build_backend().project_table()["dependencies"]
    done = subprocess.run([env.python, "-m", "pip", "--disable-pip-version-check", "-q", "install", torch_spec,
                           *runtime, TRANSFORMERS, HF_KERNELS], cwd=where, capture_output=True, text=True, timeout=900)
    if done.returncode:
        registry_unreachable(done.stderr.strip())
    return env


def hf_kernels_files(env: Venv) -> dict[str, str]:
    files = snapshot(env.site / "kernels")
    assert "__init__.py" in files and any(name.startswith("_rust") for name in files), sorted(files)[:10]
    return files


# What a process in the installed environment does: build a model with the installed library, save it, load it
# back, run it, then ask HF's kernels package for get_kernel.
INSTALLED_SESSION = f"""
import json, sys, torch
from safetensors.torch import save_file
torch.set_num_threads(1)
import sapiens2
from sapiens2 import weights, heads, processing, kernels as our_kernels, losses, hub
torch.manual_seed(0)
model = heads.build_task_model(sapiens2.Sapiens2Config(**{TINY}), heads.HeadConfig('seg', (8,), (8,), 4))
weights.save(model, sys.argv[1] + '/seg.safetensors')
loaded = weights.load(sys.argv[1] + '/seg.safetensors').eval()
x = torch.randn(1, 3, 64, 48, generator=torch.Generator().manual_seed(1))
with torch.no_grad():
    save_file({{'logits': loaded(x).logits}}, sys.argv[1] + '/logits.safetensors')
from kernels import get_kernel
import kernels
print(json.dumps({{'hf_kernels': kernels.__file__, 'ours': our_kernels.__file__, 'sapiens2': sapiens2.__file__,
                  'weights': weights.__file__, 'version': sapiens2.__version__,
                  'bare_names': [n for n in ('weights', 'heads', 'processing', 'losses', 'hub') if n in sys.modules],
                  'get_kernel': callable(get_kernel)}}))
"""


def checkout_logits(folder: Path) -> torch.Tensor:
    """The checkout's library on the file the installed one saved, with the same input."""
    from sapiens2 import weights
    model = weights.load(folder / "seg.safetensors").eval()
    x = torch.randn(1, 3, 64, 48, generator=torch.Generator().manual_seed(1))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the installed process ran; restored, so later tests keep their threads
    try:
        with torch.no_grad():
            return model(x).logits
    finally:
        torch.set_num_threads(threads)


def test_wheel_installs_one_namespace_beside_transformers_and_hf_kernels(fresh, wheel, tmp_path):
    before_names, before_bin = fresh.top_level(), {p.name for p in fresh.bin.iterdir()}
    hf_before = hf_kernels_files(fresh)

    fresh.pip("install", wheel, cwd=tmp_path)  # its dependencies are there already: only its own files land
    new_names = fresh.top_level() - before_names
    new_bin = {p.name for p in fresh.bin.iterdir()} - before_bin
    assert new_names and all(name.startswith("sapiens2") for name in new_names), new_names
    assert new_names == {"sapiens2", "sapiens2_app", f"sapiens2-{sapiens2.__version__}.dist-info"}, new_names
    assert new_bin == {"sapiens2"}, new_bin
    assert hf_kernels_files(fresh) == hf_before, "installing sapiens2 changed HF kernels' files"

    # The installed tree is the checkout's files, laid out by the build's one table, byte for byte.
    layout = load_build_backend().installed_files()
    for installed_path, source in layout.items():
        assert (fresh.site / installed_path).read_bytes() == (ROOT / source).read_bytes(), installed_path
    installed = {p.relative_to(fresh.site).as_posix() for name in ("sapiens2", "sapiens2_app")
                 for p in (fresh.site / name).rglob("*") if p.is_file() and "__pycache__" not in p.parts}
    assert installed == set(layout) | {"sapiens2/__main__.py"}

    # A process that imports sapiens2 and runs a model still gets HF's kernels, and no bare library names.
    work = tmp_path / "work"
    work.mkdir()
    done = run([fresh.python, "-c", INSTALLED_SESSION, work], cwd=work)
    facts = json.loads(done.stdout.strip().splitlines()[-1])
    assert Path(facts["hf_kernels"]).parent == fresh.site / "kernels"
    assert Path(facts["ours"]).parent == fresh.site / "sapiens2" / "kernels"
    assert Path(facts["sapiens2"]) == fresh.site / "sapiens2" / "__init__.py"
    assert facts["get_kernel"] and facts["bare_names"] == [] and facts["version"] == sapiens2.__version__
    # Same code, same machine, one thread each: the only difference allowed is none, up to fp32 rounding of
    # a matmul that a library may block differently per process (a few ulp of values of order 1).
    ours, installed_logits = checkout_logits(work), load_file(work / "logits.safetensors")["logits"]
    assert ours.shape == installed_logits.shape and ours.shape[:2] == (1, 4)
    assert (ours - installed_logits).abs().max() <= 8 * torch.finfo(torch.float32).eps * ours.abs().max()

    # The one command, with the scripts' arguments and exit codes.
    photo = ROOT / "assets" / "astronaut.jpg"
    done = run([fresh.bin / "sapiens2", "predict", "seg", photo, "-o", work / "out", "--random-init", "always",
                "--random-backbone", "0.1b", "--size", "64x48"], cwd=work)
    assert (work / "out" / "astronaut.seg.png").is_file() and "RANDOM" in done.stderr
    bad = subprocess.run([fresh.bin / "sapiens2", "predict", "seg"], cwd=work, capture_output=True, text=True)
    assert bad.returncode == 2 and "(see sapiens2 predict --help)" in bad.stderr, bad.stderr
    unknown = subprocess.run([fresh.python, "-m", "sapiens2", "nope"], cwd=work, capture_output=True, text=True)
    assert unknown.returncode == 2 and "no command 'nope'" in unknown.stderr
    assert run([fresh.python, "-m", "sapiens2", "--version"], cwd=work).stdout.strip() == (
        f"sapiens2 {sapiens2.__version__}")
    for command in ("train", "export", "serve"):
        assert f"usage: sapiens2 {command}" in run([fresh.bin / "sapiens2", command, "--help"], cwd=work).stdout

    fresh.pip("uninstall", "-y", "sapiens2", cwd=tmp_path)
    assert fresh.top_level() == before_names and {p.name for p in fresh.bin.iterdir()} == before_bin
    assert hf_kernels_files(fresh) == hf_before, "uninstalling sapiens2 changed HF kernels' files"


def test_editable_install_exposes_only_sapiens2_names(fresh, tmp_path):
    before_names = fresh.top_level()
    hf_before = hf_kernels_files(fresh)
    fresh.pip("install", "--no-deps", "-e", ROOT, cwd=tmp_path)
    try:
        new_names = fresh.top_level() - before_names
        assert new_names and all(name.startswith("sapiens2") for name in new_names), new_names
        probe = ("import json, importlib.util, sapiens2\nfrom sapiens2 import weights, kernels as ours\n"
                 "import kernels\nprint(json.dumps({'sapiens2': sapiens2.__file__, 'weights': weights.__file__,"
                 " 'ours': ours.__file__, 'hf': kernels.__file__,"
                 " 'bare_weights': importlib.util.find_spec('weights') is not None}))")
        facts = json.loads(run([fresh.python, "-c", probe], cwd=tmp_path).stdout.strip().splitlines()[-1])
        assert Path(facts["sapiens2"]) == ROOT / "sapiens2.py" and Path(facts["weights"]) == ROOT / "weights.py"
        assert Path(facts["ours"]) == ROOT / "kernels" / "__init__.py"
        assert Path(facts["hf"]).parent == fresh.site / "kernels"  # the checkout's kernels/ is not on sys.path
        assert not facts["bare_weights"]
    finally:
        fresh.pip("uninstall", "-y", "sapiens2", cwd=tmp_path)
    assert fresh.top_level() == before_names
    assert hf_kernels_files(fresh) == hf_before


def test_extras_install_what_the_hints_name():
    """Each optional feature's one-line hint names the packages of its extra, so `pip install 'sapiens2[video]'`
    and the hint install the same things."""
    backend = load_build_backend()
    extras = backend.project_table()["optional-dependencies"]
    names = {extra: {dep.split(";")[0].split(">")[0].split("=")[0].strip() for dep in deps}
             for extra, deps in extras.items()}
    from sapiens2_app.predict import video
    hints = {"video": video.INSTALL_HINT, "export": _export_hint(), "hub": _hub_hint()}
    for extra, hint in hints.items():
        assert f"sapiens2[{extra}]" in hint, hint
        assert set(hint.split("pip install ")[1].split("(")[0].split()) == names[extra], (extra, hint)
    assert names["video"] | names["export"] | names["hub"] <= names["test"]


def _export_hint() -> str:
    from sapiens2_app.export.checks import ONNX_HINT
    return ONNX_HINT


def _hub_hint() -> str:
    from sapiens2 import hub
    return hub.INSTALL_HINT


# ----------------------------------------------------------------------------------------------------------------
# sapiens2.py copied alone
# ----------------------------------------------------------------------------------------------------------------

def import_copy(folder: Path, name: str):
    """The sapiens2.py in folder, imported under another name beside the checkout's (its kernels: name.kernels)."""
    spec = importlib.util.spec_from_file_location(name, folder / "sapiens2.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def test_plain_kernels_equal_the_references_bit_for_bit():
    """PlainKernels and kernels/' references run the same ops in the same order: equal bits, in every dtype."""
    g = torch.Generator().manual_seed(0)
    plain = sapiens2.PlainKernels
    for dtype, rope_dtype in ((torch.float32, torch.bfloat16), (torch.float32, torch.float32),
                              (torch.bfloat16, torch.bfloat16), (torch.float64, torch.float64)):
        q = torch.randn(2, 4, 1 + 8 + 12, 16, generator=g).to(dtype)
        k = torch.randn(2, 2, 1 + 8 + 12, 16, generator=g).to(dtype)
        v = torch.randn(2, 2, 1 + 8 + 12, 16, generator=g).to(dtype)
        wq, wk = (torch.rand(16, generator=g) + 0.5 for _ in range(2))
        cos, sin = (torch.rand(12, 16, generator=g).to(rope_dtype) for _ in range(2))
        assert torch.equal(plain.rms_norm_reference(q, wq), kernels.rms_norm_reference(q, wq))
        assert torch.equal(plain.rope_reference(q, cos, sin), kernels.rope_reference(q, cos, sin))
        for a, b in zip(plain.qk_norm_rope(q, k, wq, wk, cos, sin), kernels.qk_norm_rope_reference(q, k, wq, wk,
                                                                                                   cos, sin)):
            assert torch.equal(a, b)
        assert torch.equal(plain.attention(q, k, v), kernels.attention_reference(q, k, v))
        assert torch.equal(plain.attention(q, k, v, 0.3), kernels.attention_reference(q, k, v, 0.3))
        assert torch.equal(plain.attention_probs(q, k), kernels.attention_probs(q, k))
        assert torch.equal(plain.attention_probs(q, k, 0.3), kernels.attention_probs(q, k, 0.3))


def test_sapiens2_py_copied_alone_runs_equal_to_the_checkout(tmp_path):
    alone = tmp_path / "alone"
    alone.mkdir()
    shutil.copy(ROOT / "sapiens2.py", alone)
    # In a folder of its own, with nothing else on the path: it imports, and a forward runs on PlainKernels.
    script = (f"import json, sys, torch\nimport sapiens2\ntorch.manual_seed(0)\n"
              f"model = sapiens2.Sapiens2(sapiens2.Sapiens2Config(**{TINY})).eval()\n"
              "from safetensors.torch import save_file\n"
              "save_file(model.state_dict(), 'model.safetensors')\n"
              "with torch.no_grad():\n    out = model(torch.ones(1, 3, 64, 48))\n"
              "print(json.dumps({'plain': sapiens2.kernels is sapiens2.PlainKernels, 'shape': list(out.tokens.shape),"
              " 'modules': sorted(m for m in sys.modules if m.split('.')[0] in ('weights', 'heads', 'processing', "
              "'kernels', 'PIL', 'sapiens2_app', 'transformers'))}))")
    (alone / "run_alone.py").write_text(script)
    # -E -s: no PYTHONPATH, no user site; the script's folder (this one) is the only source of sapiens2
    done = run([sys.executable, "-E", "-s", "run_alone.py"], cwd=alone)
    facts = json.loads(done.stdout.strip().splitlines()[-1])
    assert facts["plain"] and facts["modules"] == [] and facts["shape"][1] == 1 + 8 + 12

    # Beside the checkout's, in this process: the same weights give the same outputs bit for bit (same ops, same
    # order: PlainKernels is the references' math).
    copy = import_copy(alone, "sapiens2_copied_alone")
    try:
        assert copy.kernels is copy.PlainKernels
        theirs = copy.Sapiens2(copy.Sapiens2Config(**TINY_CONFIG)).eval()
        ours = sapiens2.Sapiens2(sapiens2.Sapiens2Config(**TINY_CONFIG)).eval()
        state = load_file(alone / "model.safetensors")
        theirs.load_state_dict(state)
        ours.load_state_dict(state)
        x = torch.randn(2, 3, 64, 48, generator=torch.Generator().manual_seed(2))
        with torch.no_grad():
            a, b = theirs(x, attentions=[-1]), ours(x, attentions=[-1])
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.attentions[1], b.attentions[1])
    finally:
        del sys.modules["sapiens2_copied_alone"]


def test_sapiens2_py_with_kernels_beside_it_uses_them(tmp_path):
    shutil.copy(ROOT / "sapiens2.py", tmp_path)
    shutil.copytree(ROOT / "kernels", tmp_path / "kernels", ignore=shutil.ignore_patterns("__pycache__"))
    copy = import_copy(tmp_path, "sapiens2_with_kernels")
    try:
        assert copy.kernels.__name__ == "sapiens2_with_kernels.kernels"
        assert Path(copy.kernels.__file__) == tmp_path / "kernels" / "__init__.py"
        assert "kernels" not in sys.modules or Path(sys.modules["kernels"].__file__).parent != tmp_path / "kernels"
    finally:
        for name in [m for m in sys.modules if m.split(".")[0] == "sapiens2_with_kernels"]:
            del sys.modules[name]


def test_a_wheel_from_the_sdist_is_the_wheel_from_the_checkout(wheel, tmp_path):
    """`python -m build` makes the sdist, then the wheel from it: the same files, byte for byte, as `pip wheel .`."""
    import tarfile
    import zipfile
    backend = load_build_backend()
    sdist = tmp_path / backend.build_sdist(str(tmp_path))
    with tarfile.open(sdist) as archive:
        archive.extractall(tmp_path / "unpacked", filter="data")
    source, = (tmp_path / "unpacked").iterdir()
    run([sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", "wheel", "--no-deps", "-w",
         tmp_path / "dist", source], cwd=tmp_path)
    from_sdist, = (tmp_path / "dist").glob("sapiens2-*.whl")
    with zipfile.ZipFile(wheel) as a, zipfile.ZipFile(from_sdist) as b:
        assert a.namelist() == b.namelist()
        assert all(a.read(name) == b.read(name) for name in a.namelist())
