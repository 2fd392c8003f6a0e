"""What a released vLLM accepts, read from its own code: the unpacked pure-Python files of its wheel
(`bash e2e/build/vllm-wheels.sh` puts them in ${XPYD_CACHE:-~/.cache/xpyd}/vllm-src/<version>/).

Nothing of vLLM is imported into the test process. Its config classes (`KVTransferConfig`,
`KVEventsConfig`: `validate_configs`) are loaded in a subprocess per release, without torch: `vllm`,
`vllm.config` and `vllm.utils` are registered as bare packages (their `__init__` imports torch),
`torch` and `vllm.platforms` are stubs, and the configs are validated with
`pydantic.TypeAdapter(cls).validate_json`, the call vLLM's CLI parser makes
(`vllm/engine/arg_utils.py`). The CLI flags, the environment variables and the connector registry
are read with `ast`.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

#: The releases at the API's version boundaries; the same list as e2e/build/vllm-wheels.sh pins.
RELEASES = ("0.13.0", "0.16.0", "0.18.0", "0.23.0", "0.24.0", "0.32.0", "0.33.0")

FETCH = "bash e2e/build/vllm-wheels.sh"

#: The files the loaders read, relative to a release root.
KV_TRANSFER = "vllm/config/kv_transfer.py"
ENVS = "vllm/envs.py"
ARG_UTILS = "vllm/engine/arg_utils.py"
FACTORY = "vllm/distributed/kv_transfer/kv_connector/factory.py"
#: Where the `vllm serve` front-end arguments live, by release (openai/ up to 0.24, then moved).
CLI_ARGS = (
    "vllm/entrypoints/openai/cli_args.py",
    "vllm/entrypoints/launchers/cli_args.py",
    "vllm/entrypoints/common/cli_args.py",
)
#: Dataclasses whose fields become `vllm serve` flags (`--field-name`, and `--no-field-name` for a bool).
ARG_CLASSES = ("EngineArgs", "AsyncEngineArgs", "FrontendArgs", "BaseFrontendArgs")


def cache_dir() -> Path:
    return Path(os.environ.get("XPYD_CACHE") or Path.home() / ".cache" / "xpyd")


def release_root(version: str) -> Path:
    """The unpacked release; fails (never skips) with what to run when it is missing."""
    root = cache_dir() / "vllm-src" / version
    missing = [rel for rel in (KV_TRANSFER, ENVS, ARG_UTILS, FACTORY) if not (root / rel).is_file()]
    if missing:
        raise AssertionError(f"vLLM {version} is not unpacked in {root} (missing {', '.join(missing)}): "
                             f"run `{FETCH}` (or `make tools`)")
    return root


# ---- vLLM's config classes, in a subprocess ---------------------------------------------------------

_VALIDATE = r"""
import dataclasses, importlib.util, json, sys, types
root, rel, name, attributes = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
configs = json.loads(sys.stdin.read())
def package(name, path):
    module = types.ModuleType(name)
    module.__path__ = [path]
    sys.modules[name] = module
package("vllm", f"{root}/vllm")
package("vllm.config", f"{root}/vllm/config")
package("vllm.utils", f"{root}/vllm/utils")
sys.modules["torch"] = types.ModuleType("torch")
platforms = types.ModuleType("vllm.platforms")
platforms.current_platform = types.SimpleNamespace(device_type="cuda")
sys.modules["vllm.platforms"] = platforms
spec = importlib.util.spec_from_file_location(rel.removesuffix(".py").replace("/", "."), f"{root}/{rel}")
module = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = module
spec.loader.exec_module(module)
import pydantic
cls = getattr(module, name)
adapter = pydantic.TypeAdapter(cls)
results = []
for text in configs:
    try:
        value = adapter.validate_json(text)
        results.append({attribute: getattr(value, attribute) for attribute in attributes} if attributes else None)
    except pydantic.ValidationError as error:
        results.append(str(error))
print(json.dumps({"fields": [f.name for f in dataclasses.fields(cls)], "results": results}))
"""


@dataclass(frozen=True)
class ConfigCheck:
    #: The fields of the release's config class.
    fields: frozenset[str]
    #: Per config given: pydantic's message (a str) when the release refuses it, else the attributes
    #: asked for of the validated config (None when none were asked for).
    results: tuple[str | dict[str, Any] | None, ...]


def validate_configs(version: str, rel: str, class_name: str, configs: list[str],
                     attributes: Sequence[str] = ()) -> ConfigCheck:
    """Validate each JSON text with the release's own config dataclass `class_name` of `rel` (a file of
    vllm/config/), as its CLI parser does (`pydantic.TypeAdapter(cls).validate_json`)."""
    root = release_root(version)
    assert (root / rel).is_file(), f"vLLM {version} has no {rel}"
    done = subprocess.run([sys.executable, "-c", _VALIDATE, str(root), rel, class_name, json.dumps(list(attributes))],
                          input=json.dumps(configs), capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, f"loading vLLM {version}'s {class_name} failed:\n{done.stderr}"
    out = json.loads(done.stdout.strip().splitlines()[-1])
    return ConfigCheck(frozenset(out["fields"]), tuple(out["results"]))


@dataclass(frozen=True)
class KVCheck:
    #: The fields of the release's KVTransferConfig.
    fields: frozenset[str]
    #: Per config given: None when the release accepts it, else pydantic's message.
    errors: tuple[str | None, ...]


def validate_kv_transfer_configs(version: str, configs: list[str]) -> KVCheck:
    """Validate each `--kv-transfer-config` JSON text with the release's own KVTransferConfig."""
    check = validate_configs(version, KV_TRANSFER, "KVTransferConfig", configs)
    return KVCheck(check.fields, tuple(None if result is None else str(result) for result in check.results))


# ---- read with ast -------------------------------------------------------------------------------

def _parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), str(path))


def _literal_flags(tree: ast.Module) -> set[str]:
    """The option strings of every `add_argument("--x", ...)` call with literal names."""
    flags = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument":
            for arg in node.args:
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and arg.value.startswith("--"):
                    flags.add(arg.value)
    return flags


def _dataclass_flags(tree: ast.Module) -> set[str]:
    """`--field-name` for every field of the argument classes, and `--no-field-name` for booleans
    (vLLM adds them with argparse.BooleanOptionalAction)."""
    flags = set()
    for node in ast.walk(tree):
        if not (isinstance(node, ast.ClassDef) and node.name in ARG_CLASSES):
            continue
        for item in node.body:
            if not (isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)):
                continue
            name, annotation = item.target.id, ast.unparse(item.annotation)
            if name.startswith("_") or "ClassVar" in annotation:
                continue
            flag = name.replace("_", "-")
            flags.add(f"--{flag}")
            if "bool" in annotation:
                flags.add(f"--no-{flag}")
    return flags


@cache
def serve_flags(version: str) -> frozenset[str]:
    """The long options `vllm serve` of the release accepts."""
    root = release_root(version)
    flags: set[str] = set()
    for rel in (ARG_UTILS, *CLI_ARGS):
        if (root / rel).is_file():
            tree = _parse(root / rel)
            flags |= _literal_flags(tree) | _dataclass_flags(tree)
    return frozenset(flags)


@cache
def env_vars(version: str) -> frozenset[str]:
    """The keys of `environment_variables` in the release's vllm/envs.py."""
    for node in _parse(release_root(version) / ENVS).body:
        target = node.target if isinstance(node, ast.AnnAssign) else (
            node.targets[0] if isinstance(node, ast.Assign) else None)
        if isinstance(target, ast.Name) and target.id == "environment_variables":
            assert isinstance(node.value, ast.Dict)  # type: ignore[union-attr]
            return frozenset(k.value for k in node.value.keys  # type: ignore[union-attr]
                             if isinstance(k, ast.Constant) and isinstance(k.value, str))
    raise AssertionError(f"vLLM {version}: no environment_variables dict in {ENVS}")


@cache
def registered_connectors(version: str) -> frozenset[str]:
    """The names registered with `KVConnectorFactory.register_connector("Name", ...)`."""
    names = set()
    for node in ast.walk(_parse(release_root(version) / FACTORY)):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == "register_connector" and node.args
                and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            names.add(node.args[0].value)
    assert names, f"vLLM {version}: no register_connector calls in {FACTORY}"
    return frozenset(names)


@cache
def connector_strings(version: str, connector: str) -> frozenset[str]:
    """Every string literal of the files next to the connector's module (the module path its
    `register_connector` call names, not its sub-packages): the keys its code can read from
    kv_connector_extra_config."""
    root = release_root(version)
    module = None
    for node in ast.walk(_parse(root / FACTORY)):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == "register_connector" and len(node.args) >= 2
                and isinstance(node.args[0], ast.Constant) and node.args[0].value == connector
                and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
            module = node.args[1].value
    assert module, f"vLLM {version} does not register {connector}"
    path = root / (module.replace(".", "/") + ".py")
    if not path.is_file():  # a package
        path = root / module.replace(".", "/") / "__init__.py"
    files = list(path.parent.glob("*.py"))
    if connector == "LMCacheConnectorV1":  # vLLM's bundled copy of LMCache's adapter, where it has one
        files += (path.parent / "lmcache_integration").glob("*.py")
    strings = set()
    for file in files:
        for node in ast.walk(_parse(file)):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                strings.add(node.value)
    return frozenset(strings)
