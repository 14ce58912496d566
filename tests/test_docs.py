"""The code blocks of the README, of docs/ and of jax_arx's docstrings, as
written.

Every block says what it is, so that nothing meant to run is left unchecked:

- Markdown (``README.md``, ``docs/*.md``), by the fence's info string:

  - ``python``: a whole program; run as written on the CPU in 2 processes,
    ``python -m jax_arx.launch -n 2 block.py``, which must succeed without
    falling back to ``jax.lax``;
  - ``python fragment``: part of a program (a function to paste into one);
    compiled, not run;
  - ``bash``: commands CI runs as written: every command line of the block
    is a line of ``.ci/run``;
  - ``bash no-run``: commands for another machine (GPUs, RDMA hardware);
    checked by ``bash -n``, not run;
  - ``text``: output, listings, formulas; not code.

  A block with another info string, or none, fails the test.
- Docstrings of the ``jax_arx`` package: a reST literal block (after a line
  ending in ``::``) is a whole program, run as a ``python`` block is;
  ``.. code-block:: text`` marks one that is not code.

CI runs this file on the lowest jax the package supports and on the newest
(``.ci/run``), besides the suite's own run.
"""

from __future__ import annotations

import ast
import dataclasses
import pathlib
import re
import subprocess
import sys
import textwrap

import pytest

import launched

REPO = pathlib.Path(__file__).resolve().parents[1]
MARKDOWN = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
PACKAGE = REPO / "jax_arx"
KINDS = ("python", "python fragment", "bash", "bash no-run", "text")


@dataclasses.dataclass(frozen=True)
class Block:
    where: str  # file:line of the block's first line
    kind: str  # one of KINDS, or what the file said instead
    code: str


def markdown_blocks(path: pathlib.Path) -> list[Block]:
    """The fenced blocks of a Markdown file, indented ones (in list items)
    included, their text dedented by the fence's indentation."""
    blocks, lines, i = [], path.read_text().splitlines(), 0
    while i < len(lines):
        m = re.match(r"^(\s*)```(.*)$", lines[i])
        if not m:
            i += 1
            continue
        indent, info, start = m.group(1), m.group(2).strip(), i + 1
        i += 1
        while i < len(lines) and lines[i].strip() != "```":
            i += 1
        body = [line[len(indent) :] if line.startswith(indent) else line for line in lines[start:i]]
        blocks.append(Block(f"{path.relative_to(REPO)}:{start}", info, "\n".join(body) + "\n"))
        i += 1
    return blocks


def docstring_blocks(path: pathlib.Path) -> list[Block]:
    """The literal blocks of a module's docstrings (module, classes,
    functions): ``python`` after ``::``, or the ``.. code-block::`` language."""
    blocks = []
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        doc = ast.get_docstring(node, clean=True)
        if not doc:
            continue
        lines = doc.splitlines()
        for i, line in enumerate(lines):
            directive = re.match(r"^\s*\.\. code-block::\s*(.*)$", line)
            if directive:
                kind = directive.group(1).strip()
            elif line.rstrip().endswith("::"):
                kind = "python"
            else:
                continue
            j = i + 1
            while j < len(lines) and not lines[j].strip():
                j += 1
            base = len(lines[i]) - len(lines[i].lstrip())
            body = []
            while j < len(lines) and (not lines[j].strip() or len(lines[j]) - len(lines[j].lstrip()) > base):
                body.append(lines[j])
                j += 1
            line_no = getattr(node, "lineno", 1)
            blocks.append(
                Block(
                    f"{path.relative_to(REPO)}:{line_no} (docstring)",
                    kind,
                    textwrap.dedent("\n".join(body)).strip() + "\n",
                )
            )
    return blocks


def all_blocks() -> list[Block]:
    blocks = [b for path in MARKDOWN for b in markdown_blocks(path)]
    return blocks + [b for path in sorted(PACKAGE.glob("*.py")) for b in docstring_blocks(path)]


BLOCKS = all_blocks()


def _ids(blocks):
    return [f"{b.where}[{b.kind}]" for b in blocks]


def test_every_block_says_what_it_is():
    unmarked = [f"{b.where}: ```{b.kind}" for b in BLOCKS if b.kind not in KINDS]
    assert not unmarked, (
        "blocks whose info string is none of " + ", ".join(KINDS) + " (see this file's "
        "docstring):\n  " + "\n  ".join(unmarked)
    )
    assert any(b.kind == "python" for b in BLOCKS)


RUN = [b for b in BLOCKS if b.kind == "python"]


@pytest.mark.parametrize("block", RUN, ids=_ids(RUN))
def test_python_block_runs_as_written(core_built, tmp_path, block):
    script = tmp_path / "block.py"
    script.write_text(block.code)
    # cwd outside the source tree: the installed jax_arx is imported.
    p = launched.run_launcher(
        [sys.executable, "-m", "jax_arx.launch", "-n", "2", "--cpu-devices", "1", str(script)],
        launched.clean_env(),
        tmp_path,
        timeout=300,
    )
    detail = f"{block.where}: status {p.returncode}\n--- stdout\n{p.stdout[-4000:]}\n--- stderr\n{p.stderr[-4000:]}"
    assert p.returncode == 0, detail
    assert "using jax.lax" not in p.stderr, detail  # the example runs jax_arx, not the fallback


FRAGMENTS = [b for b in BLOCKS if b.kind == "python fragment"]


@pytest.mark.parametrize("block", FRAGMENTS, ids=_ids(FRAGMENTS))
def test_python_fragment_compiles(block):
    compile(block.code, block.where, "exec")


def _ci_lines() -> set[str]:
    return {line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines()}


def _commands(code: str) -> list[str]:
    return [line.strip() for line in code.splitlines() if line.strip() and not line.strip().startswith("#")]


CI_COMMANDS = [b for b in BLOCKS if b.kind == "bash"]


@pytest.mark.parametrize("block", CI_COMMANDS, ids=_ids(CI_COMMANDS))
def test_bash_block_runs_in_ci_as_written(block):
    missing = [c for c in _commands(block.code) if c not in _ci_lines()]
    assert not missing, f"{block.where}: commands .ci/run does not run as written: {missing}"


OTHER_MACHINES = [b for b in BLOCKS if b.kind == "bash no-run"]


@pytest.mark.parametrize("block", OTHER_MACHINES, ids=_ids(OTHER_MACHINES))
def test_bash_no_run_block_parses(block):
    p = subprocess.run(["bash", "-n"], input=block.code, capture_output=True, text=True)
    assert p.returncode == 0, f"{block.where}: {p.stderr}"
