"""What the operator renders, checked against vLLM's own released code (issue 12).

For every sample (and a few variants of the spec) and every release of `vllm_release.RELEASES` the
API accepts it with, the engines' `--kv-transfer-config` must validate with that release's
KVTransferConfig and carry only its fields (0.13 ignores unknown keys silently), every `vllm serve`
flag must exist in that release, and every `VLLM_*` variable must be one the release reads. The
API's connector boundaries are checked against the release's connector registry. The releases come
from `bash e2e/build/vllm-wheels.sh` (`make tools`); without them these tests fail, they never skip.
"""

from __future__ import annotations

import json
import re
import subprocess
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conformance import vllm_release
from tests.conformance.vllm_release import RELEASES
from tests.linters import shellcheck_command
from tests.servings import serving
from xpyd.api.load import SpecError, load_servings, parse_serving
from xpyd.api.models import Connector
from xpyd.render import render

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
SAMPLES = sorted((ROOT / "manifests" / "samples").glob("*.yaml"))
KV_FLAG = "--kv-transfer-config"


def minor(release: str) -> str:
    """`0.24.0` -> `0.24`, the form `engine.vllmVersion` is written in."""
    return ".".join(release.split(".")[:2])


#: Specs beyond the samples, so that every optional flag, key and variable the renderer has is
#: rendered at least once (merged over tests.servings.serving(); the release is set per case).
VARIANTS: dict[str, dict[str, Any]] = {
    "parallel-and-model-flags": {
        "model": {"name": "m", "maxModelLen": 8192, "source": {"hub": {"revision": "main"}}},
        "prefill": {"pipelineParallelSize": 2, "dataParallelSize": 2}},
    "nixl-cpu-buffer-ucx-devices": {"kvTransfer": {"bufferDevice": "cpu", "nixl": {"backends": ["UCX", "Mooncake"]},
                                                   "ucx": {"tls": "rc,cuda_copy", "netDevices": "mlx5_0:1"},
                                                   "rdma": {}}},
    "nixl-lease": {"kvTransfer": {"extraConfig": {"kv_lease_duration": 60}}},
    "nixl-push-dp": {"kvTransfer": {"connector": "NixlPushConnector"}, "prefill": {"dataParallelSize": 2}},
    "mooncake-tcp-device-workers": {"kvTransfer": {"connector": "MooncakeConnector", "mooncake": {
        "protocol": "tcp", "deviceName": "mlx5_0", "numWorkers": 4, "bootstrapPort": 9000}}},
    "p2pnccl-get": {"kvTransfer": {"connector": "P2pNcclConnector", "p2pNccl": {"sendType": "GET"}}},
    "lmcache-tp2": {"kvTransfer": {"connector": "LMCacheConnectorV1", "lmcache": {"configMapRef": {"name": "c"}}},
                    "prefill": {"tensorParallelSize": 2}, "decode": {"tensorParallelSize": 2}},
}

#: What is rendered, by case name: each sample's file, each variant as YAML.
SOURCES: dict[str, str] = {
    **{sample.stem: sample.read_text() for sample in SAMPLES},
    **{f"variant-{name}": yaml.safe_dump(serving(spec)) for name, spec in VARIANTS.items()},
}


def pod_templates(obj: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(where, pod template) of a workload: a Deployment's, a LeaderWorkerSet's leader and worker."""
    name = obj["metadata"]["name"]
    if obj["kind"] == "Deployment":
        return [(name, obj["spec"]["template"])]
    if obj["kind"] == "LeaderWorkerSet":
        group = obj["spec"]["leaderWorkerTemplate"]
        return [(f"{name} {part}", group[part]) for part in ("leaderTemplate", "workerTemplate")]
    return []


@cache
def engine_containers(source: str, release: str) -> list[tuple[str, dict[str, Any]]]:
    """(`<serving>/<workload>`, container) of every vLLM engine the case renders for the release."""
    out = []
    for s in load_servings(SOURCES[source], source, vllm_version=minor(release)):
        for obj in render(s.metadata.name, s.metadata.namespace, s.spec):
            for where, template in pod_templates(obj):
                for container in template["spec"]["containers"]:
                    if container.get("command", [])[-2:] == ["vllm", "serve"]:
                        out.append((f"{s.metadata.name}/{where}", container))
    return out


def accepted(source: str, release: str) -> bool:
    try:
        load_servings(SOURCES[source], source, vllm_version=minor(release))
    except SpecError:
        return False
    return True


#: (case, release) for every release the API accepts the case with (its own rules decide).
CASES = [(source, release) for source in SOURCES for release in RELEASES if accepted(source, release)]
IDS = [f"{source}-{release}" for source, release in CASES]


def flag_name(arg: str) -> str:
    return arg.split("=", 1)[0]


def kv_configs(source: str, release: str) -> list[tuple[str, str]]:
    """(where, JSON text) of every `--kv-transfer-config=...` the source's engines get."""
    rendered = []
    for where, container in engine_containers(source, release):
        for arg in container.get("args", []):
            if flag_name(arg) == KV_FLAG:
                assert "=" in arg, f"{where}: {KV_FLAG} without =JSON"
                rendered.append((where, arg.split("=", 1)[1]))
    return rendered


@cache
def kv_check(release: str) -> tuple[frozenset[str], dict[str, str | None]]:
    """The release's KVTransferConfig fields, and its verdict on every config any source renders
    for it (one subprocess per release)."""
    texts = sorted({text for source, r in CASES if r == release for _, text in kv_configs(source, release)})
    check = vllm_release.validate_kv_transfer_configs(release, texts)
    return check.fields, dict(zip(texts, check.errors, strict=True))


@pytest.mark.parametrize(("source", "release"), CASES, ids=IDS)
def test_kv_transfer_config_is_accepted_whole(source: str, release: str) -> None:
    rendered = kv_configs(source, release)
    assert rendered, f"{source} renders no {KV_FLAG} for vLLM {release}"
    fields, verdicts = kv_check(release)
    problems = []
    for where, text in rendered:
        error = verdicts[text]
        if error is not None:
            problems.append(f"{where}: vLLM {release} refuses {text}:\n{error}")
        unknown = sorted(set(json.loads(text)) - fields)
        if unknown:
            problems.append(f"{where}: {unknown} are not fields of vLLM {release}'s KVTransferConfig "
                            f"(dropped or refused): {text}")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize(("source", "release"), CASES, ids=IDS)
def test_engine_flags_exist(source: str, release: str) -> None:
    known = vllm_release.serve_flags(release)
    problems = []
    for where, container in engine_containers(source, release):
        for arg in container.get("args", []):
            if arg.startswith("--") and flag_name(arg) not in known:
                problems.append(f"{where}: vLLM {release} has no {flag_name(arg)} (rendered {arg[:80]})")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize(("source", "release"), CASES, ids=IDS)
def test_engine_vllm_env_vars_are_read(source: str, release: str) -> None:
    known = vllm_release.env_vars(release)
    problems = []
    for where, container in engine_containers(source, release):
        for var in container.get("env", []):
            if var["name"].startswith("VLLM_") and var["name"] not in known:
                problems.append(f"{where}: vLLM {release} does not read {var['name']} (not in vllm/envs.py)")
    assert not problems, "\n".join(problems)


def test_every_case_is_checked_on_some_release() -> None:
    unchecked = [source for source in SOURCES if not any(source == s for s, _ in CASES)]
    assert not unchecked, f"cases no release of {RELEASES} accepts: {unchecked}"


def connector_serving(connector: Connector, release: str) -> dict[str, Any]:
    kv: dict[str, Any] = {"connector": str(connector)}
    if connector is Connector.LMCACHE:
        kv["lmcache"] = {"configMapRef": {"name": "cfg"}}
    return serving({"kvTransfer": kv, "engine": {"vllmVersion": minor(release)}})


def api_accepts(connector: Connector, release: str) -> tuple[bool, str]:
    try:
        parse_serving(connector_serving(connector, release), "conformance")
    except SpecError as error:
        return False, str(error)
    return True, ""


@pytest.mark.parametrize("release", RELEASES)
def test_connectors_the_api_allows_are_registered(release: str) -> None:
    registered = vllm_release.registered_connectors(release)
    allowed = [c for c in Connector if api_accepts(c, release)[0]]
    assert allowed, f"the API allows no connector on vLLM {release}"
    missing = [str(c) for c in allowed if str(c) not in registered]
    assert not missing, f"the API allows {missing} on vLLM {release}, whose factory.py does not register them"


@pytest.mark.parametrize("release", RELEASES)
def test_removed_and_new_connectors_are_refused(release: str) -> None:
    registered = vllm_release.registered_connectors(release)
    for connector in (Connector.P2P_NCCL, Connector.NIXL_PUSH):
        ok, message = api_accepts(connector, release)
        if str(connector) not in registered:
            assert not ok, f"the API allows {connector} on vLLM {release}, which does not register it"
            assert str(connector) in message and "vllmVersion" in message, message
    # The boundaries the API draws (xpyd.vllm) are where the registry changes.
    newer = tuple(int(x) for x in release.split(".")[:2]) >= (0, 24)
    assert (str(Connector.P2P_NCCL) in registered) is not newer, registered
    assert (str(Connector.NIXL_PUSH) in registered) is newer, registered


def test_the_checks_bite() -> None:
    """The loader really validates: 0.16 refuses an unknown key, 0.13 takes it silently (which is why
    the fields are compared too), and a flag or variable that no release has is not found."""
    bogus = '{"kv_connector":"NixlConnector","kv_role":"kv_producer","kv_bogus":1}'
    assert vllm_release.validate_kv_transfer_configs("0.16.0", [bogus]).errors[0] is not None
    old = vllm_release.validate_kv_transfer_configs("0.13.0", [bogus])
    assert old.errors == (None,)
    assert "kv_bogus" not in old.fields
    assert "kv_role" in old.fields
    assert "--shutdown-timeout" not in vllm_release.serve_flags("0.16.0")
    assert "--shutdown-timeout" in vllm_release.serve_flags("0.18.0")
    assert "--no-enable-prefix-caching" in vllm_release.serve_flags("0.33.0")
    assert "VLLM_NIXL_ABORT_REQUEST_TIMEOUT" in vllm_release.env_vars("0.18.0")
    assert "VLLM_NIXL_ABORT_REQUEST_TIMEOUT" not in vllm_release.env_vars("0.23.0")


def test_missing_releases_fail_with_what_to_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XPYD_CACHE", str(tmp_path))
    with pytest.raises(AssertionError, match=re.escape("run `bash e2e/build/vllm-wheels.sh`")):
        vllm_release.release_root("0.33.0")


SCRIPT = ROOT / "e2e" / "build" / "vllm-wheels.sh"


def test_script_pins_the_releases_checked() -> None:
    match = re.search(r"^VLLM_RELEASES=\(([^)]*)\)", SCRIPT.read_text(), re.MULTILINE)
    assert match, f"no VLLM_RELEASES=(...) in {SCRIPT}"
    assert tuple(match.group(1).split()) == RELEASES


def test_script_shellcheck() -> None:
    command = shellcheck_command()
    assert command is not None, "shellcheck is missing: install the dev dependencies (pip install -e '.[dev]')"
    result = subprocess.run([*command, str(SCRIPT)], capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


#: (connector, extra-config key) -> (releases, why) the key is rendered but no code of the connector
#: in the release reads it. A pin, not a waiver: the test fails when this changes either way.
UNREAD_EXTRA_KEYS: dict[tuple[str, str], tuple[frozenset[str], str]] = {
    ("LMCacheConnectorV1", "lmcache_rpc_port"): (
        frozenset(RELEASES),
        "read by the LMCache package's own vLLM adapter (not in vLLM's wheel, unverified here)"),
}


def test_extra_config_keys_are_read() -> None:
    """Every kv_connector_extra_config key rendered appears as a string literal in the connector's
    own module directory of the release (a heuristic: it finds keys, not how they are read)."""
    unread: dict[tuple[str, str], set[str]] = {}
    for source, release in CASES:
        for _, text in kv_configs(source, release):
            config = json.loads(text)
            strings = vllm_release.connector_strings(release, config["kv_connector"])
            for key in config.get("kv_connector_extra_config", {}):
                if key not in strings:
                    unread.setdefault((config["kv_connector"], key), set()).add(release)
    expected = {key: set(releases) for key, (releases, _) in UNREAD_EXTRA_KEYS.items()}
    assert unread == expected, f"extra-config keys no code of the release reads: {unread}"
