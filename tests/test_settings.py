"""The settings registry (hpdl.settings): every HPDL_* name in the source is in it and read through it, the
generated docs/settings.md is current, `hpdl info --env` lists every setting, a misspelt name gets a warning that
names the nearest setting, and a bad value is an error that names the variable. One process, no ranks."""

from __future__ import annotations

import ast
import functools
import os
import re
import subprocess
import sys
import warnings

import pytest

import hpdl
from hpdl import settings

SRC = os.path.dirname(os.path.abspath(hpdl.__file__))
ROOT = os.path.dirname(os.path.dirname(SRC))
NAME = re.compile(r"(?<![A-Za-z0-9_])HPDL_[A-Z0-9_]+")


def _sources() -> list[str]:
    found = []
    for folder, dirs, files in os.walk(SRC):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        found += [os.path.join(folder, f) for f in files if f.endswith((".py", ".c"))]
    return sorted(found)


@functools.cache
def _tree(path: str) -> ast.Module:
    with open(path) as handle:
        return ast.parse(handle.read(), path)


def _path(module: str) -> str:
    return os.path.join(os.path.dirname(SRC), *module.split(".")) + ".py"


def _relative(path: str) -> str:
    return os.path.relpath(path, ROOT).replace(os.sep, "/")


def test_every_hpdl_name_in_the_source_is_a_registered_setting() -> None:
    """grep the package: a name that is no setting (or a prefix, `HPDL_SHM_MIN_{op}`, that matches none) fails."""
    missing = []
    for path in _sources():
        if os.path.basename(path) == "settings.py":  # the table itself (and its examples of wrong names)
            continue
        with open(path) as handle:
            for number, line in enumerate(handle, 1):
                for name in NAME.findall(line):
                    known = (
                        any(s.startswith(name) for s in settings.SETTINGS)
                        if name.endswith("_")
                        else name in settings.SETTINGS
                    )
                    if not known:
                        missing.append(f"{_relative(path)}:{number}: {name}")
    assert not missing, "add these to hpdl.settings (name, type, default, doc):\n" + "\n".join(missing)


def test_each_setting_is_named_by_the_module_said_to_read_it() -> None:
    """The table's `reader` is where the name is read (renaming or moving a read must update the table)."""
    wrong = []
    for entry in settings.SETTINGS.values():
        with open(_path(entry.reader)) as handle:
            body = handle.read()
        op = entry.name.rpartition("_MIN_")[0] + "_MIN_" if entry.name.startswith("HPDL_SHM_MIN_") else ""
        imported = [  # a constant of another module that holds the name (`from ...environment import STORE_FD`)
            alias.name
            for node in _tree(_path(entry.reader)).body
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("hpdl.")
            for alias in node.names
            if os.path.exists(_path(node.module or ""))
            and _constants(_tree(_path(node.module or ""))).get(alias.name) == entry.name
        ]
        if entry.name not in body and not (op and op in body) and not imported:
            wrong.append(f"{entry.name}: not in {entry.reader}")
    assert not wrong, wrong


def _constants(tree: ast.Module) -> dict[str, str]:
    """Module-level `NAME = "HPDL_..."`: reads through such a constant count as reads of the name."""
    found = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    found[target.id] = node.value.value
    return found


def _environ_reads(path: str) -> list[tuple[int, str]]:
    """(line, name) of every os.environ / env-mapping read of a user setting (`.get`, `.pop`, `getenv`, `[...]`,
    `in`) that does not go through hpdl.settings. The launcher's own hand-overs (kind "launcher") are exempt."""
    tree = _tree(path)
    constants = _constants(tree)

    def name_of(node: ast.AST) -> str:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            value = node.value
        elif isinstance(node, ast.Name):
            value = constants.get(node.id, "")
        else:
            return ""
        return value if re.fullmatch(r"HPDL_[A-Z0-9_]+", value) else ""

    reads = []
    for node in ast.walk(tree):
        candidates: list[ast.AST] = []
        if isinstance(node, ast.Call):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
            if called in ("get", "pop", "getenv") and node.args:
                candidates = [node.args[0]]
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
            candidates = [node.slice]
        elif isinstance(node, ast.Compare) and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops):
            candidates = [node.left]
        for candidate in candidates:
            name = name_of(candidate)
            if name and settings.SETTINGS.get(name, settings.SETTINGS["HPDL_TIMEOUT"]).kind != "launcher":
                reads.append((node.lineno, name))
    return reads


def test_every_read_goes_through_the_registry() -> None:
    found = {}
    for path in _sources():
        if path.endswith(".py") and os.path.basename(path) != "settings.py":
            for line, name in _environ_reads(path):
                found.setdefault((_relative(path), name), f"{_relative(path)}:{line}")
    assert not found, "read these through hpdl.settings (flag, number, text):\n" + "\n".join(sorted(found.values()))


def test_docs_settings_md_is_generated_from_the_registry() -> None:
    with open(os.path.join(ROOT, "docs", "settings.md")) as handle:
        committed = handle.read()
    assert committed == settings.markdown(), "regenerate it: hpdl info --env --markdown > docs/settings.md"
    for name in settings.SETTINGS:
        assert f"`{name}`" in committed


def test_hpdl_info_env_lists_every_setting_with_its_value_and_the_unknown_ones() -> None:
    env = dict(os.environ, HPDL_SHM="0", HPDL_TIMOUT="5")
    done = subprocess.run(
        [sys.executable, "-m", "hpdl.cli.main", "info", "--env"], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    rows = {line.split()[0]: line for line in done.stdout.splitlines()[1:]}
    assert set(settings.SETTINGS) <= set(rows), set(settings.SETTINGS) - set(rows)
    assert rows["HPDL_SHM"].split()[1] == "0", rows["HPDL_SHM"]
    assert rows["HPDL_TIMEOUT"].split()[1:3] == ["(unset)", "300:"], rows["HPDL_TIMEOUT"]
    assert "HPDL_TIMOUT: not an hpdl setting, ignored (did you mean HPDL_TIMEOUT?)" in done.stdout, done.stdout


def test_a_misspelt_name_warns_once_with_the_nearest_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(settings, "_warned", set())
    env = {"HPDL_TIMOUT": "5", "HPDL_SHM_MB": "8", "HPDL_TEST_POOL": "a label", "HPDL_QQQQQQQQ": "1"}
    with pytest.warns(RuntimeWarning) as caught:
        said = settings.warn_unknown(env)
    assert [str(w.message) for w in caught] == said
    assert said == [
        "HPDL_QQQQQQQQ is not an hpdl setting and is ignored (`hpdl info --env` lists them all)",
        "HPDL_TIMOUT is not an hpdl setting and is ignored (did you mean HPDL_TIMEOUT? `hpdl info --env` lists "
        "them all)",
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert settings.warn_unknown(env) == []  # once per process
        assert settings.warn_unknown({"HPDL_TIMOT": "5", "HPDL_JOB_DIR": "/tmp/j"}) == []  # a rank of hpdl launch


def test_hpdl_launch_says_an_unknown_name_once_and_a_bad_value_before_any_rank_starts(monkeypatch, capsys) -> None:
    from hpdl.cli.launch import bad_setting

    monkeypatch.setattr(settings, "_warned", set())
    monkeypatch.delenv("HPDL_JOB_DIR", raising=False)
    monkeypatch.setenv("HPDL_SHM_PEICE_MB", "2")
    monkeypatch.setenv("HPDL_FUSION_MB", "lots")
    assert bad_setting() == "HPDL_FUSION_MB='lots' must be a number of megabytes"
    assert capsys.readouterr().err == (
        "hpdl launch: warning: HPDL_SHM_PEICE_MB is not an hpdl setting and is ignored (did you mean "
        "HPDL_SHM_PIECE_MB? `hpdl info --env` lists them all)\n"
    )


def test_unknown_names_and_bad_values_are_said_when_hpdl_is_asked_for_not_at_import() -> None:
    """`import hpdl` (and the torch backend's modules) neither warns nor fails: the warning comes with `hpdl.init`,
    and a bad HPDL_TORCH_POLL_US (once read at import) with the first use of the progress settings."""
    probe = (
        "import warnings; warnings.simplefilter('always'); import hpdl, hpdl.interop.torch_backend.progress as p; "
        "print('imported', flush=True); hpdl.init('self'); print('started', flush=True); p.timings()"
    )
    env = dict(os.environ, HPDL_CHEK_EVERY="4", HPDL_TORCH_POLL_US="soon")
    env.pop("HPDL_JOB_DIR", None)
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    assert done.stdout.split() == ["imported", "started"], done.stdout + done.stderr
    assert done.stderr.count("HPDL_CHEK_EVERY is not an hpdl setting") == 1, done.stderr
    assert "did you mean HPDL_CHECK_EVERY?" in done.stderr, done.stderr
    assert "ValueError: HPDL_TORCH_POLL_US='soon' must be a number of microseconds" in done.stderr, done.stderr


@pytest.mark.parametrize(
    "name, value, said",
    [
        ("HPDL_TIMEOUT", "abc", "HPDL_TIMEOUT='abc' must be a number of seconds"),
        ("HPDL_TIMEOUT", "-1", "HPDL_TIMEOUT='-1' must be positive"),
        ("HPDL_TIMEOUT", "nan", "HPDL_TIMEOUT='nan' must be a number of seconds"),
        ("HPDL_CHECK_EVERY", "1.5", "HPDL_CHECK_EVERY='1.5' must be a number of collectives (0: off)"),
        ("HPDL_DASK_POLL_MAX_US", "5", "HPDL_DASK_POLL_MAX_US='5' must be between 10 and 1000000"),
        ("HPDL_DASK_MPI_CHUNK", str(2**31), "HPDL_DASK_MPI_CHUNK='2147483648' must be at most 2147483647"),
        ("HPDL_DASK_MPI_INLINE", "-3", "HPDL_DASK_MPI_INLINE='-3' must be non-negative"),
        ("HPDL_TORCH_SPIN_US", "fast", "HPDL_TORCH_SPIN_US='fast' must be a number of microseconds"),
        ("HPDL_BACKEND", "nccl", "HPDL_BACKEND='nccl': choose one of mpi, torch, self"),
    ],
)
def test_a_bad_value_is_an_error_that_names_the_variable(monkeypatch, name, value, said) -> None:
    """Through the modules that read them (not only the registry), and in `problems()`, which `hpdl launch` says."""
    from hpdl.comm.agreement import default_every
    from hpdl.comm.base import default_timeout
    from hpdl.dask.frames import chunk_bytes, inline_limit
    from hpdl.dask.progress import poll_cap
    from hpdl.interop.torch_backend.progress import timings
    from hpdl.runtime.environment import detect

    readers = {
        "HPDL_TIMEOUT": default_timeout,
        "HPDL_CHECK_EVERY": lambda: default_every("mpi"),
        "HPDL_DASK_POLL_MAX_US": poll_cap,
        "HPDL_DASK_MPI_CHUNK": chunk_bytes,
        "HPDL_DASK_MPI_INLINE": inline_limit,
        "HPDL_TORCH_SPIN_US": lambda: timings.__wrapped__(),
        "HPDL_BACKEND": detect,
    }
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=re.escape(said)):
        readers[name]()
    assert any(problem.startswith(said) for problem in settings.problems()), settings.problems()


@pytest.mark.parametrize("value", ["", "0", "off", "No", " false ", "1", "yes", "on", None])
def test_shm_enabled_reads_yes_no_as_every_flag_does(monkeypatch, value) -> None:
    from hpdl.comm import shm
    from hpdl.comm.env import env_flag

    if value is None:
        monkeypatch.delenv("HPDL_SHM", raising=False)
    else:
        monkeypatch.setenv("HPDL_SHM", value)
    assert shm.enabled() == env_flag("HPDL_SHM", True) == (value is None or value.strip().lower() not in settings.FALSE)


def test_an_unregistered_name_is_a_programming_error_that_says_where_to_add_it() -> None:
    from hpdl.comm.env import env_flag

    with pytest.raises(LookupError, match=r"HPDL_DEBG is not a registered hpdl setting \(did you mean HPDL_DEBUG\?\)"):
        env_flag("HPDL_DEBG")
