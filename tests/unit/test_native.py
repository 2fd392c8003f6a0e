"""The compiled build of the simulator's hot loop: when it loads, and that `make test` runs it."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest

from xpyd.common import native

pytestmark = pytest.mark.unit


def test_make_test_runs_the_simulator_compiled() -> None:
    # `make test` builds it first (`make native`); a source edited since would load pure Python.
    if native.build_dir() is None:
        assert native.compiled() == []
        return
    assert native.compiled() == list(native.MODULES), native.state()[1]


def manifest(**changes: Any) -> dict[str, Any]:
    out = native.fingerprint()
    out.update(changes)
    return out


def with_source(module: str, digest: str) -> dict[str, Any]:
    wanted = native.fingerprint()
    return {**wanted, "sources": {**wanted["sources"], module: digest}}


@pytest.mark.parametrize(("built", "reason"), [
    (manifest(), None),
    (manifest(format=0), "its manifest has format 0, not 1"),
    (manifest(ext_suffix=".cpython-312-x86_64-linux-gnu.so"),
     "it was built for '.cpython-312-x86_64-linux-gnu.so', this interpreter loads"),
    (manifest(sources=None), "its manifest lists no sources"),
    (with_source("xpyd.sim.core", "0" * 64), "xpyd.sim.core changed since it was built"),
    (with_source("xpyd.traces", "1" * 64), "xpyd.traces changed since it was built"),
    ({**manifest(), "sources": {}}, "xpyd.api.naming, xpyd.autoscaler.observation, xpyd.common.bunching, "
                                    "xpyd.kvcache.chains, xpyd.kvcache.index, "
                                    "xpyd.kvcache.pool, xpyd.kvcache.scoring, "
                                    "xpyd.perf.model, xpyd.perf.shapes, xpyd.sim.core, xpyd.sim.policy, "
                                    "xpyd.sim.simulator, xpyd.traces changed since it was built"),
])
def test_a_build_serves_only_the_sources_and_interpreter_it_was_made_from(built: dict[str, Any],
                                                                          reason: str | None) -> None:
    found = native.mismatch(built, native.fingerprint())
    if reason is None:
        assert found is None
    else:
        assert found is not None and found.startswith(reason)


def test_the_fingerprint_is_each_compiled_and_imported_sources_sha256() -> None:
    import hashlib

    sources = native.fingerprint()["sources"]
    assert sorted(sources) == sorted((*native.MODULES, *native.IMPORTED))
    core = Path(__file__).resolve().parents[2] / "operator" / "xpyd" / "sim" / "core.py"
    assert sources["xpyd.sim.core"] == hashlib.sha256(core.read_bytes()).hexdigest()


def test_imported_lists_every_module_of_the_package_the_compiled_ones_import() -> None:
    import ast

    imported: set[str] = set()
    for module in native.MODULES:
        for node in ast.walk(ast.parse(native.source_of(module).read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("xpyd."):
                imported.add(str(node.module))
            elif isinstance(node, ast.Import):
                imported |= {alias.name for alias in node.names if alias.name.startswith("xpyd.")}
    assert imported - set(native.MODULES) == set(native.IMPORTED)


@pytest.mark.parametrize(("setting", "expected"), [
    ("off", None), ("0", None), ("OFF", None), ("false", None), ("no", None),
    ("/somewhere/else", Path("/somewhere/else")),
])
def test_xpyd_native_turns_the_build_off_or_moves_it(monkeypatch: pytest.MonkeyPatch, setting: str,
                                                     expected: Path | None) -> None:
    monkeypatch.setenv("XPYD_NATIVE", setting)
    assert native.build_dir() == expected


def test_the_default_build_lives_beside_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.delenv("XPYD_NATIVE", raising=False)
    assert native.build_dir() == Path(sys.prefix) / "xpyd-native"


def write_manifest(directory: Path, content: str) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / native.MANIFEST).write_text(content)


def test_state_says_which_build_loads_and_why_not(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    build = tmp_path / "build"
    monkeypatch.setenv("XPYD_NATIVE", str(build))
    assert native.state() == (None, f"no compiled build in {build} (`make native` makes one)")

    write_manifest(build, json.dumps(native.fingerprint()))
    assert native.state() == (build, f"compiled modules from {build}")

    write_manifest(build, json.dumps(with_source("xpyd.sim.simulator", "f" * 64)))
    assert native.state() == (None, f"the compiled build in {build} is stale: xpyd.sim.simulator changed since "
                                    "it was built (`make native` rebuilds it)")

    write_manifest(build, "{not json")
    directory, why = native.state()
    assert directory is None and why.startswith(f"the compiled build in {build} is stale: its manifest cannot be "
                                                "read (Expecting property name")

    write_manifest(build, "[]")
    assert native.state() == (None, f"the compiled build in {build} is stale: its manifest is not a JSON object "
                                    "(`make native` rebuilds it)")

    monkeypatch.setenv("XPYD_NATIVE", "off")
    assert native.state() == (None, "XPYD_NATIVE turns the compiled modules off")


def test_packages_search_the_build_first_only_when_it_is_usable(monkeypatch: pytest.MonkeyPatch,
                                                               tmp_path: Path) -> None:
    source = [str(Path(native.__file__).parents[1] / "sim")]
    monkeypatch.setenv("XPYD_NATIVE", str(tmp_path))
    try:
        native._active.cache_clear()
        write_manifest(tmp_path, json.dumps(native.fingerprint()))
        assert native.package_path("xpyd.sim", list(source)) == [str(tmp_path / "xpyd" / "sim"), *source]

        native._active.cache_clear()
        write_manifest(tmp_path, json.dumps(with_source("xpyd.perf.model", "e" * 64)))
        with pytest.warns(RuntimeWarning, match="xpyd.perf.model changed since it was built.*pure-Python"):
            assert native.package_path("xpyd.perf", list(source)) == source

        native._active.cache_clear()
        (tmp_path / native.MANIFEST).unlink()
        with warnings.catch_warnings():
            warnings.simplefilter("error")   # no build: pure Python, without a warning
            assert native.package_path("xpyd.sim", list(source)) == source
    finally:
        native._active.cache_clear()   # the next caller reads the real build again


def test_the_command_line(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("XPYD_NATIVE", str(tmp_path))
    assert native.main(["status"]) == 0
    assert capsys.readouterr().out == f"no compiled build in {tmp_path} (`make native` makes one)\n"

    write_manifest(tmp_path, json.dumps(native.fingerprint()))
    assert native.main(["build"]) == 0     # up to date: compiles nothing
    assert capsys.readouterr().out == (f"up to date: xpyd.sim.core, xpyd.sim.simulator, xpyd.perf.model, "
                                       f"xpyd.kvcache.pool, xpyd.kvcache.chains, xpyd.kvcache.index, "
                                       f"xpyd.kvcache.scoring in {tmp_path}\n")

    for bad in ([], ["build", "--fast"], ["status", "extra"], ["compile"]):
        assert native.main(bad) == 2
        assert capsys.readouterr().err == "usage: python -m xpyd.common.native build [--force] | status\n"

    monkeypatch.setenv("XPYD_NATIVE", "off")
    assert native.main(["build"]) == 2
    assert "nothing to build" in capsys.readouterr().err
