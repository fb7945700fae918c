"""The fenced blocks of README.md and docs/*.md, what each one is, and the checks that need no ranks.

tests/test_docs.py states the convention and runs the blocks; this module finds and classifies them, and,
run as a script (`python doc_blocks.py`), checks the fragments and dry-parses the long commands in a process
of its own (imports of accelerate or Lightning, and the patched argparse, stay out of pytest's process):
it prints one JSON object, block or line id -> the problems found (an empty list: none).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import glob
import importlib
import io
import json
import os
import re
import shlex
import sys
import textwrap
from dataclasses import dataclass, field
from typing import Any, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ["README.md", *sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))]

SHELL = {"", "bash", "sh", "shell", "console"}
"""Fence languages of command blocks (one command a line). `text` is printed text: never run."""
FILE_LANGUAGES = {"python", "toml", "json"}
"""Fence languages a named block may be written as a file in."""

FENCE = re.compile(r"^(\s*)(```+)\s*([\w+-]*)\s*$")
MARKER = re.compile(r"^\s*<!--\s*(fragment|file)\s*(?::\s*(.*?))?\s*-->\s*$")
NAMED = re.compile(r"`([\w.-]+\.(?:py|toml|json))`")
"""A file name in backticks, in a line ending with ':' just before the block (its first such name)."""

EXCLUDED = {"srun": "needs a Slurm allocation (slurmctld, slurmd): there is none on a CI machine"}
"""Launchers no machine of the suite has: their lines are listed in tests/test_docs.py's EXCLUDED_LINES."""

LONG = [
    (r"^hpdl tune\b", "tests/test_tune.py", '"tune", "-n", "2", "--quick"', "every size, 15 s per count of ranks"),
    (r"^hpdl bench dask\b", "tests/test_dask_bench.py", "hpdl bench dask --quick", "5-10 minutes (--quick there)"),
    (r"^hpdl bench train --strategy hybrid\b", "tests/test_mesh_bench.py", "--strategy hybrid --quick", "a benchmark"),
    (r"^hpdl plan calibrate\b", "tests/test_plan_cli.py", '"calibrate", "--quick"', "measures this machine"),
    (r"^hpdl plan validate\b", "tests/test_plan_cli.py", '"validate", "--quick"', "trains every plan of 4 models"),
    (r"^hpdl launch .*examples/lab_ml\.py", "tests/test_examples.py", '"lab_ml.py"', "a lab, run in its shared job"),
]
"""Commands of run blocks that are long benchmarks or jobs another test runs with small sizes: here they are
dry-parsed (their own argument parser reads them, so a renamed command or option fails) and not run."""

MODULES = {
    "hpdl": "hpdl",
    "torch": "torch",
    "nn": "torch.nn",
    "F": "torch.nn.functional",
    "dist": "torch.distributed",
    "hvd": "hpdl.horovod",
    "np": "numpy",
}
"""Names of modules a block may use: a fragment that imports something must import these too, and their
attribute paths (hpdl.parallel.zero, hvd.Compression.fp16) must exist even in a fragment that imports none."""


@dataclass
class Block:
    doc: str  # README.md, docs/comm.md
    index: int  # the block's place in its file, from 0
    line: int  # the opening fence's line, from 1
    language: str
    code: str  # dedented
    marker: Optional[str] = None  # "fragment" or "file"
    note: str = ""  # the marker's text after ':'
    name: Optional[str] = None  # the file the block is (named by the text before it, or by a file marker)

    @property
    def id(self) -> str:
        return f"{self.doc}#{self.index}"

    @property
    def kind(self) -> str:
        """file, script-ranks, script-python, shell, fragment or text (what the suite does with it)."""
        if self.language == "text":
            return "text"
        if self.marker == "fragment":
            return "fragment"
        if self.name is not None:
            return "file"
        if self.language == "python":
            return "script-ranks" if re.search(r"\bhpdl\.init\(", self.code) else "script-python"
        if self.language in SHELL:
            return "shell"
        return "unknown"

    def lines(self) -> list[Line]:
        """A shell block's commands, with what the suite does with each."""
        found = []
        for offset, text in enumerate(self.code.splitlines(), start=1):
            if not text.strip() or text.lstrip().startswith("#"):
                continue
            found.append(Line(self, self.line + offset, text.strip()))
        return found


@dataclass
class Line:
    block: Block
    line: int
    text: str
    argv: list[str] = field(init=False)

    def __post_init__(self) -> None:
        self.argv = command_words(self.text)

    @property
    def id(self) -> str:
        return f"{self.block.doc}:{self.line}"

    @property
    def action(self) -> str:
        """run, dry-parse (a long command, or an hpdl line of a fragment), excluded, or unchecked."""
        if self.argv[:1] and self.argv[0] in EXCLUDED:
            return "excluded"
        if self.block.kind == "fragment":
            return "dry-parse" if self.argv[:1] == ["hpdl"] else "unchecked"
        if self.covered_by() is not None:
            return "dry-parse"
        return "run"

    def covered_by(self) -> Optional[tuple[str, str, str]]:
        """(the test that runs this long command, what its source says where it does, why not here), or None."""
        joined = " ".join(self.argv)
        for pattern, test, evidence, why in LONG:
            if re.search(pattern, joined):
                return test, evidence, why
        return None

    def shell_text(self) -> str:
        """The line as a shell runs it: `[--quick]` (an optional flag the text offers) taken."""
        return re.sub(r"\[(--?[\w-]+)\]", r"\1", self.text)


def command_words(text: str) -> list[str]:
    """The command's words: comments, leading VAR=value assignments and placeholders like `[args]` dropped,
    `[--quick]` taken."""
    text = re.sub(r"\[(--?[\w-]+)\]", r"\1", text)
    text = re.sub(r"\[[^\]]*\]", "", text)
    try:
        words = shlex.split(text, comments=True)
    except ValueError:
        return text.split()
    while words and re.match(r"^[A-Za-z_]\w*=", words[0]):
        words.pop(0)
    return words


def blocks(doc: str) -> list[Block]:
    lines = open(os.path.join(ROOT, doc), encoding="utf-8").read().splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        indent, fence, language = opening.groups()
        end = i + 1
        while end < len(lines) and lines[end].strip() != fence:
            end += 1
        code = textwrap.dedent("\n".join(lines[i + 1 : end])) + "\n"
        block = Block(doc, len(found), i + 1, language.lower(), code)
        before = [text for text in lines[max(0, i - 6) : i] if text.strip()]
        if before and (marker := MARKER.match(before[-1])):
            block.marker, block.note = marker.group(1), marker.group(2) or ""
            before.pop()
            if block.marker == "file":
                block.name = block.note
        if block.name is None and block.language in FILE_LANGUAGES and before and before[-1].rstrip().endswith(":"):
            named = NAMED.search(before[-1])
            block.name = named.group(1) if named else None
        found.append(block)
        i = end + 1
    return found


def all_blocks() -> list[Block]:
    return [block for doc in DOCS for block in blocks(doc)]


# --------------------------------------------------------------------------- checks without ranks


def fragment_problems(code: str) -> list[str]:
    """A fragment is not complete code, but it must compile, its imports must import, a fragment that imports
    anything must import the modules it uses (`torch`, `nn`, ...), and the attribute paths of modules it
    names (`hpdl.parallel.zero`) must exist."""
    try:
        tree = ast.parse(code)
    except SyntaxError as error:
        return [f"SyntaxError: {error}"]
    problems: list[str] = []
    bound: dict[str, Any] = {}
    imports = [node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))]
    for imported in imports:
        for alias in imported.names:
            try:
                if isinstance(imported, ast.Import):
                    module = importlib.import_module(alias.name)
                    if alias.asname:
                        bound[alias.asname] = module
                    else:
                        top = alias.name.split(".")[0]
                        bound[top] = importlib.import_module(top)
                else:
                    module = importlib.import_module(imported.module or "")
                    name = alias.asname or alias.name
                    if hasattr(module, alias.name):
                        bound[name] = getattr(module, alias.name)
                    else:
                        bound[name] = importlib.import_module(f"{imported.module}.{alias.name}")
            except Exception as error:  # ImportError, or whatever importing the module raised
                problems.append(f"line {imported.lineno}: {ast.unparse(imported)}: {type(error).__name__}: {error}")
    assigned = {
        target.id
        for node in ast.walk(tree)
        for target in (node.targets if isinstance(node, ast.Assign) else [])
        if isinstance(target, ast.Name)
    }
    used = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)}
    if imports:
        for name in sorted(used & set(MODULES) - set(bound) - assigned):
            problems.append(f"uses `{name}` without importing it (a NameError when run)")
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        attribute = node
        path: list[str] = []
        value: ast.expr = attribute
        while isinstance(value, ast.Attribute):
            path.insert(0, value.attr)
            value = value.value
        if not isinstance(value, ast.Name) or value.id in assigned:
            continue
        if value.id in bound:
            target = bound[value.id]
        elif value.id in MODULES:
            try:
                target = importlib.import_module(MODULES[value.id])
            except ImportError:
                continue
        else:
            continue
        if isinstance(attribute.ctx, ast.Store):
            path = path[:-1]
        for depth, attr in enumerate(path):
            if not hasattr(target, attr):
                if isinstance(target, type(sys)) and _is_submodule(target, attr):
                    target = importlib.import_module(f"{target.__name__}.{attr}")
                    continue
                problems.append(f"line {attribute.lineno}: {value.id}.{'.'.join(path[: depth + 1])} does not exist")
                break
            target = getattr(target, attr)
    return sorted(set(problems))


def _is_submodule(module: Any, name: str) -> bool:
    try:
        importlib.import_module(f"{module.__name__}.{name}")
        return True
    except ImportError:
        return False


class _Parsed(BaseException):
    """Raised by the patched ArgumentParser.parse_args once a command's own parser has read its line."""


def dry_parse(argv: list[str]) -> list[str]:
    """Run `hpdl ARGV` up to its own argument parsing, and stop there: [] if the parser took the line."""
    from hpdl.cli import main

    original = argparse.ArgumentParser.parse_args

    def parse_args(self: argparse.ArgumentParser, args: Any = None, namespace: Any = None) -> Any:
        original(self, args, namespace)
        raise _Parsed

    argparse.ArgumentParser.parse_args = parse_args  # type: ignore[method-assign,assignment]
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors), contextlib.redirect_stdout(io.StringIO()):
            code: Any = main.main(argv[1:])
    except _Parsed:
        return []
    except SystemExit as stop:
        code = stop.code
    finally:
        argparse.ArgumentParser.parse_args = original  # type: ignore[method-assign]
    return [f"`{' '.join(argv)}` was not parsed (exit {code}): {errors.getvalue().strip()}"]


def check_all() -> dict[str, list[str]]:
    """Every fragment's problems by block id, every dry-parsed line's by line id."""
    results: dict[str, list[str]] = {}
    for block in all_blocks():
        if block.kind == "fragment" and block.language == "python":
            results[block.id] = fragment_problems(block.code)
        if block.kind in ("fragment", "shell"):
            for line in block.lines():
                if line.action == "dry-parse":
                    results[line.id] = dry_parse(line.argv)
    return results


if __name__ == "__main__":
    os.chdir(sys.argv[1] if len(sys.argv) > 1 else ROOT)
    print(json.dumps(check_all()))
