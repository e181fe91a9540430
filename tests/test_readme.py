"""Documented snippets that promise to run as written do: extracted from docs/research.md and run in order, each seeing the
names the ones before it made, in a scratch folder (offline: they make their own random checkpoint)."""

import ast
import re
import runpy

import pytest
import torch

from sapiens2 import kernels
from conftest import ROOT


def python_snippets(section_title: str, page: str = "docs/research.md", next_heading: str = "\n## ") -> list[str]:
    """The ```python blocks of `page`'s section `## {section_title}...`, up to the next heading `next_heading`."""
    text = (ROOT / page).read_text()
    start = text.index(f"\n## {section_title}")
    end = text.find(next_heading, start + 1)
    return re.findall(r"```python\n(.*?)```", text[start:end if end != -1 else None], re.S)


def imported_packages(code: str) -> set[str]:
    """The top-level packages a snippet imports (`from sapiens2.kernels import x` -> sapiens2)."""
    names = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("page, section", [("README.md", "Python API"), ("docs/research.md", "For researchers")])
def test_library_examples_import_only_the_library(page, section):
    """A library user's examples run on the library alone (torch and sapiens2); the app's pictures have their own
    section, which says they are the app's."""
    snippets = python_snippets(section, page, next_heading="\n#")  # up to the next heading of any level
    assert snippets, f"no python examples in {page}'s {section}"
    assert [imported_packages(code) - {"torch", "sapiens2"} for code in snippets] == [set()] * len(snippets)


def run_snippet(code: str, path, names: dict) -> dict:
    """Run one snippet as a script that starts with `names` defined; returns its names at the end."""
    path.write_text(code)
    return runpy.run_path(str(path), init_globals=names)


@pytest.fixture
def in_scratch_folder(tmp_path, monkeypatch):
    """The repository's assets/ next to the snippets' outputs; kernels.attention restored after (a snippet swaps it)."""
    (tmp_path / "assets").symlink_to(ROOT / "assets")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(kernels, "attention", kernels.attention)
    return tmp_path


def test_researcher_section_runs_as_written(in_scratch_folder):
    snippets = python_snippets("For researchers")
    assert len(snippets) == 2
    names = run_snippet(snippets[0], in_scratch_folder / "snippet1.py", {})
    out = names["out"]  # the shapes its comments state
    assert out.layers[0].shape == (1, 64, 16, 12) and out.layer_cls[0].shape == (1, 64)
    assert out.layer_registers[0].shape == (1, 8, 64) and out.attentions[3].shape == (1, 4, 201, 201)
    assert names["cls_map"].shape == (16, 12)

    names = run_snippet(snippets[1], in_scratch_folder / "snippet2.py", names)
    assert kernels.attention is names["my_attention"] and names["features"].shape == (1, 64, 16, 12)
    with torch.no_grad():  # block 2 skipped: the output is blocks 0, 1, 3 (the kept original blocks) alone
        tokens, h, w = names["backbone"].embed(names["inputs"].pixel_values)
        rope = names["backbone"].rope_embed(h, w, tokens.device, tokens.dtype)
        for i in (0, 1, 3):
            tokens = names["backbone"].blocks[i](tokens, rope)
        expected = names["backbone"].ln1(tokens)[:, 9:]
    assert torch.equal(names["features"].flatten(2).transpose(1, 2), expected)  # the same ops in the same order
