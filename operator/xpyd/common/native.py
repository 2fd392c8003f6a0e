"""The simulator's hot loop compiled with mypyc, used only while it matches its source.

`xpyd sim`, the oracle's search, the evaluation and the engine emulator spend nearly all their time
in a few modules (`MODULES`: the engine model, the replay loop, the performance model, the prefix
cache's block pool and trace keys). `build()` compiles them with mypyc into a directory beside the
interpreter (`<sys.prefix>/xpyd-native`, or `$XPYD_NATIVE`), never into the source tree, and writes
a manifest of the SHA-256 of each source it compiled. The packages `xpyd.sim`, `xpyd.perf` and
`xpyd.kvcache` put that directory first on their `__path__` (so the compiled modules shadow the
sources) only when the manifest matches: the same interpreter ABI, and every compiled source and
every module of the package they import byte-identical. Otherwise (no build, a source edited since,
another Python) the pure-Python modules load as they are, with one warning when a build exists but
is stale. Both give the same results (a test replays a trace through each).

    python -m xpyd.common.native build     # compile (what `make native` runs; quick when up to date)
    python -m xpyd.common.native status    # which modules load compiled, or why none does

`XPYD_NATIVE=off` forces pure Python; `XPYD_NATIVE=DIR` uses DIR for the build.

What the compiled modules' code must not do (mypyc's rules; the tests run the compiled build, so a
breach fails there first): read `vars()` or `__dict__` of their classes (they have none), find files
through their own `__file__` (it names the build), be subclassed or monkeypatched from outside, or
pickle or deep-copy their frozen dataclasses (a compiled one restores its fields through the
`__setattr__` that freezing forbids; results cross process boundaries as plain data instead).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import sys
import sysconfig
import tempfile
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

MODULES = ("xpyd.sim.core", "xpyd.sim.simulator", "xpyd.perf.model", "xpyd.kvcache.pool", "xpyd.kvcache.chains",
           "xpyd.kvcache.index", "xpyd.kvcache.scoring")
"""Compiled together (one mypyc group): calls between them stay native."""

IMPORTED = ("xpyd.api.naming", "xpyd.autoscaler.observation", "xpyd.common.bunching", "xpyd.perf.shapes",
            "xpyd.sim.policy", "xpyd.traces")
"""The package's modules that `MODULES` import: mypyc compiles against their types, so a change of
theirs makes the build stale too (a test keeps this list complete)."""

GROUP = "xpyd.sim.native"   # mypyc's shared library becomes xpyd/sim/native__mypyc.<ext>, inside the build
FORMAT = 1
MANIFEST = "manifest.json"
OFF = ("0", "off", "false", "no")

_ROOT = Path(__file__).resolve().parents[2]   # the directory holding the `xpyd` package


def build_dir() -> Path | None:
    """Where the compiled modules live, or None when `XPYD_NATIVE` turns them off."""
    setting = os.environ.get("XPYD_NATIVE", "").strip()
    if setting.lower() in OFF:
        return None
    return Path(setting) if setting else Path(sys.prefix) / "xpyd-native"


def source_of(module: str) -> Path:
    """The source file of a module of the package (one of `MODULES` or `IMPORTED`)."""
    return _ROOT.joinpath(*module.split(".")).with_suffix(".py")


def fingerprint() -> dict[str, Any]:
    """What a build must have been made from to be used: this interpreter's extension ABI and the
    SHA-256 of each compiled source and of each module they import."""
    return {"format": FORMAT, "ext_suffix": sysconfig.get_config_var("EXT_SUFFIX"),
            "sources": {module: hashlib.sha256(source_of(module).read_bytes()).hexdigest()
                        for module in (*MODULES, *IMPORTED)}}


def mismatch(manifest: Mapping[str, Any], wanted: Mapping[str, Any]) -> str | None:
    """Why a build with `manifest` cannot serve sources and interpreter with fingerprint `wanted`, or
    None when it can."""
    if manifest.get("format") != wanted["format"]:
        return f"its manifest has format {manifest.get('format')!r}, not {wanted['format']}"
    if manifest.get("ext_suffix") != wanted["ext_suffix"]:
        return f"it was built for {manifest.get('ext_suffix')!r}, this interpreter loads {wanted['ext_suffix']!r}"
    built = manifest.get("sources")
    if not isinstance(built, dict):
        return "its manifest lists no sources"
    changed = sorted(module for module, digest in wanted["sources"].items() if built.get(module) != digest)
    if changed:
        return f"{', '.join(changed)} changed since it was built"
    return None


def _read_manifest(directory: Path) -> dict[str, Any] | str | None:
    """The build's manifest, None when there is none, or why it cannot be read."""
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as error:
        return f"its manifest cannot be read ({error})"
    return manifest if isinstance(manifest, dict) else "its manifest is not a JSON object"


def state() -> tuple[Path | None, str]:
    """The build directory the compiled modules load from (None: pure Python), and a sentence why."""
    directory = build_dir()
    if directory is None:
        return None, "XPYD_NATIVE turns the compiled modules off"
    manifest = _read_manifest(directory)
    if manifest is None:
        return None, f"no compiled build in {directory} (`make native` makes one)"
    reason = manifest if isinstance(manifest, str) else mismatch(manifest, fingerprint())
    if reason is not None:
        return None, f"the compiled build in {directory} is stale: {reason} (`make native` rebuilds it)"
    return directory, f"compiled modules from {directory}"


@functools.cache
def _active() -> Path | None:
    directory, why = state()
    if directory is None and "stale" in why:
        warnings.warn(f"{why}; running the pure-Python simulator", RuntimeWarning, stacklevel=3)
    return directory


def package_path(package: str, path: list[str]) -> list[str]:
    """The `__path__` for `package` (`xpyd.sim`, `xpyd.perf` or `xpyd.kvcache`): the compiled build's
    directory of it first when the build is usable, else `path` unchanged."""
    directory = _active()
    if directory is None:
        return path
    return [str(directory.joinpath(*package.split("."))), *path]


def compiled() -> list[str]:
    """The `MODULES` that are loaded from the compiled build (after importing them)."""
    import importlib

    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    return [module for module in MODULES if str(importlib.import_module(module).__file__).endswith(suffix)]


def build(directory: Path, *, force: bool = False) -> bool:
    """Compile `MODULES` into `directory` (replaced whole) unless it already holds a usable build;
    True when it compiled. Needs mypy (a dev dependency) and a C compiler."""
    wanted = fingerprint()
    manifest = _read_manifest(directory)
    if not force and isinstance(manifest, dict) and mismatch(manifest, wanted) is None:
        return False
    from mypyc.build import mypycify  # only here: the operator's image has no mypy
    from setuptools import setup  # type: ignore[import-untyped]

    directory.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="xpyd-native-") as scratch:
        staging = Path(scratch) / "lib"
        cwd = Path.cwd()
        os.chdir(_ROOT)   # mypyc names modules by their path from here
        try:
            extensions = mypycify([str(source_of(module).relative_to(_ROOT)) for module in MODULES],
                                  opt_level="3", group_name=GROUP, target_dir=str(Path(scratch) / "c"))
            setup(name="xpyd-native", ext_modules=extensions,
                  script_args=["--quiet", "build_ext", "--build-lib", str(staging),
                               "--build-temp", str(Path(scratch) / "temp")])
        finally:
            os.chdir(cwd)
        (staging / MANIFEST).write_text(json.dumps(wanted, indent=2, sort_keys=True) + "\n")
        if directory.exists():
            shutil.rmtree(directory)
        shutil.move(str(staging), directory)
    return True


def main(argv: list[str] | None = None) -> int:
    """`build [--force]` or `status`."""
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["status"] and len(args) == 1:
        sys.stdout.write(state()[1] + "\n")
        return 0
    if args[:1] == ["build"] and set(args[1:]) <= {"--force"}:
        directory = build_dir()
        if directory is None:
            sys.stderr.write("XPYD_NATIVE turns the compiled modules off: nothing to build\n")
            return 2
        made = build(directory, force="--force" in args)
        sys.stdout.write(f"{'compiled' if made else 'up to date:'} {', '.join(MODULES)} in {directory}\n")
        return 0
    sys.stderr.write("usage: python -m xpyd.common.native build [--force] | status\n")
    return 2


if __name__ == "__main__":
    sys.exit(main())
