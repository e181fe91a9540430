"""sapiens2_app/ in folders by concern: each folder imports only the library, common/, and the folders it builds on.

The rules are the table below; each folder's __init__.py says the same in words. Imports are read from the source
(ast), lazy ones inside functions and TYPE_CHECKING blocks included, so the test imports nothing and takes no time.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
APP = ROOT / "sapiens2_app"

# folder -> the other app folders it may import. Every folder may import the library (sapiens2, ...).
ALLOWED = {
    "common": set(),
    "detector": {"common"},
    "augment": {"common"},
    "predict": {"common", "detector"},  # pose needs person boxes
    "train": {"common", "augment", "predict", "detector"},  # a teacher predicts as predict.py does
    "serve": {"common", "predict"},  # every job runs predict's inference and outputs
    "export": {"common", "predict"},  # the model is loaded as predict.py loads it
}
MAX_MODULES = 15  # a folder a reader can take in at once
MAX_LINES = 450  # the design rule (README, layout): one module per concern, a few hundred lines, ~450 at most


def imported_names(path: Path) -> set[str]:
    """What a file imports, as dotted names (`from sapiens2_app.predict import video` -> sapiens2_app.predict.video,
    `from sapiens2 import weights` -> sapiens2.weights)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def app_imports(path: Path) -> set[str]:
    return {name for name in imported_names(path) if name.split(".")[0] == "sapiens2_app"}


def folder_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 and parts[1] in ALLOWED else None


def test_the_app_is_the_folders_of_the_table():
    folders = {p.name for p in APP.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders == set(ALLOWED), f"sapiens2_app/ has folders {sorted(folders)}; the table has {sorted(ALLOWED)}"
    loose = sorted(p.name for p in APP.glob("*.py") if p.name not in ("__init__.py", "commands.py"))
    assert not loose, f"sapiens2_app/: {loose} belong in one of the folders {sorted(ALLOWED)}"
    for folder in ALLOWED:
        modules = [p for p in (APP / folder).glob("*.py") if p.name != "__init__.py"]
        assert (APP / folder / "__init__.py").is_file(), f"sapiens2_app/{folder}/ has no __init__.py"
        assert len(modules) <= MAX_MODULES, f"sapiens2_app/{folder}/ has {len(modules)} modules (> {MAX_MODULES})"


def test_every_app_module_is_at_most_max_lines():
    """A module past MAX_LINES holds more than one concern: split it by concern, not by line count."""
    lengths = {path: len(path.read_text(encoding="utf-8").splitlines()) for path in sorted(APP.rglob("*.py"))}
    over = [f"sapiens2_app/{path.relative_to(APP).as_posix()}: {count} lines"
            for path, count in lengths.items() if count > MAX_LINES]
    assert not over, f"app modules over {MAX_LINES} lines (split them by concern):\n" + "\n".join(over)


def test_each_folder_imports_only_what_its_rule_allows():
    wrong = []
    for folder, allowed in ALLOWED.items():
        for path in sorted((APP / folder).glob("*.py")):
            for module in sorted(app_imports(path)):
                target = folder_of(module)
                if target != folder and target not in allowed:
                    wrong.append(f"sapiens2_app/{folder}/{path.name} imports {module}")
    assert not wrong, "imports across the folder rules (tests/test_app_layout.py ALLOWED):\n" + "\n".join(wrong)


def test_the_cross_concern_arrows_stay_away():
    """Arrows the folders allow but the concerns do not: the shared command-line and file code loads no model
    (weights.py), the random draws know no pixel operation, and the metrics augment nothing (the affine map that
    takes a crop's keypoints to the photo is processing.apply_affine)."""
    rules = {"common/*.py": ("sapiens2.weights",), "augment/random_draws.py": ("sapiens2_app.",),
             "train/pose_metrics.py": ("sapiens2_app.augment",), "train/agreement.py": ("sapiens2_app.augment",)}
    wrong = [f"sapiens2_app/{path.relative_to(APP).as_posix()} imports {name}"
             for pattern, banned in rules.items() for path in sorted(APP.glob(pattern))
             for name in sorted(imported_names(path)) if name.startswith(banned)]
    assert not wrong, "\n".join(wrong)


def test_the_folder_rules_have_no_circle():
    """A -> B and B -> A (or longer) in the table would let two folders grow into one."""
    def reaches(start: str, seen: tuple[str, ...]) -> None:
        for nxt in ALLOWED[start]:
            assert nxt not in seen, f"circle in the folder rules: {' -> '.join(seen + (nxt,))}"
            reaches(nxt, seen + (nxt,))
    for folder in ALLOWED:
        reaches(folder, (folder,))


def test_the_library_never_imports_the_app():
    library = [ROOT / "sapiens2.py", *ROOT.glob("kernels/*.py"),
               *(ROOT / name for name in ("heads.py", "processing.py", "weights.py", "losses.py", "hub.py"))]
    wrong = [f"{path.relative_to(ROOT)} imports {sorted(app_imports(path))}" for path in library if app_imports(path)]
    assert not wrong, "\n".join(wrong)
