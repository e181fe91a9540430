"""The repository speaks to its users, about their machines: no file describes the tools or the machines the project
was built with (a GPU "lent" by a "device tool", its "lease", what it "carries" back). A GPU script says what it
needs and what it writes, for anyone with a GPU of their own."""

import re
import subprocess

from conftest import ROOT

BUILT_WITH = re.compile(r"device tool|device machine|\blent\b|\blends\b|\blease\b|carry=\[", re.IGNORECASE)


def repository_files() -> list[str]:
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True)
    if listed.returncode == 0 and listed.stdout:
        return [name for name in listed.stdout.split("\0") if name]
    skipped = (".git", ".venv", "__pycache__")  # an export without git: every file under the root
    return [str(p.relative_to(ROOT)) for p in ROOT.rglob("*")
            if p.is_file() and not any(part.startswith(skipped) for part in p.relative_to(ROOT).parts)]


def test_no_file_speaks_of_the_machines_it_was_built_on():
    found = []
    for name in repository_files():
        if name == "tests/test_wording.py":
            continue
        try:
            text = (ROOT / name).read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):  # binary files (fixtures, pictures) say nothing
            continue
        for number, line in enumerate(text.splitlines(), 1):
            if BUILT_WITH.search(line):
                found.append(f"{name}:{number}: {line.strip()[:120]}")
    assert not found, "words about the machines the project was built on:\n" + "\n".join(found)
