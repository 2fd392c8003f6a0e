"""The README's first command until `xpyd demo` lands: the most complete real run that exists.

1. builds the local control plane's binaries if they are missing (cached in ~/.cache/xpyd);
2. starts the local cluster (real API server on loopback, fake GPU nodes, pod runtime);
3. installs the operator with the Helm chart (it runs as a pod process with its own RBAC);
4. applies the NIXL sample and waits until the operator reports it Ready;
5. replays a window of the Azure conversation trace through `xpyd sim` for the same pool sizes;
6. prints a summary and tears everything down (`--keep` leaves the cluster up).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from xpyd.cluster.binaries import locate_binaries
from xpyd.cluster.controlplane import ClusterError, ControlPlane

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "build" / "demo"
SAMPLE = ROOT / "manifests" / "samples" / "nixl.yaml"
TRACE = ROOT / "tests" / "fixtures" / "traces" / "azure_conv_2023_head200.csv"


def step(message: str) -> None:
    print(f"==> {message}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--keep", action="store_true", help="leave the cluster running for kubectl exploration")
    args = parser.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()

    step("locating the control-plane binaries (building them on first use: ~16 min on 2 cores)")
    binaries = locate_binaries()
    plane = ControlPlane(OUT / "cluster", binaries)
    step("starting the local cluster")
    try:
        state = plane.up(progress=lambda message: print(f"    {message}", flush=True))
    except ClusterError as error:
        print(f"demo failed while starting the cluster: {error}", file=sys.stderr)
        return 1
    env = {**os.environ, "KUBECONFIG": str(state.kubeconfig),
           "PATH": f"{binaries.bin_dir}:{os.environ.get('PATH', '/usr/bin:/bin')}"}

    def tool(*argv: str, quiet: bool = False) -> str:
        result = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300, check=False)
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(argv[:3])} failed:\n{result.stderr}")
        if not quiet:
            print(result.stdout.rstrip())
        return result.stdout

    kubectl, helm = str(binaries.kubectl), str(binaries.helm)
    try:
        step("helm install xpyd-operator (the operator runs as a pod process with the chart's RBAC)")
        tool(helm, "install", "xpyd-operator", str(ROOT / "charts" / "xpyd-operator"), "-n", "xpyd-system",
             "--create-namespace", "--wait", "--timeout", "90s", quiet=True)
        tool(kubectl, "get", "pods", "-n", "xpyd-system", "-o", "wide")
        step(f"kubectl apply -f {SAMPLE.relative_to(ROOT)}")
        tool(kubectl, "create", "secret", "generic", "hf-token", "--from-literal=token=hf_demo", quiet=True)
        tool(kubectl, "apply", "-f", str(SAMPLE))
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            obj = json.loads(tool(kubectl, "get", "xpyd", "llama-8b", "-o", "json", quiet=True))
            ready = [c for c in obj.get("status", {}).get("conditions", []) if c["type"] == "Ready"]
            if ready and ready[0]["status"] == "True":
                break
            time.sleep(1)
        else:
            raise RuntimeError("llama-8b did not become Ready in 90 s: see `kubectl describe xpyd llama-8b`")
        tool(kubectl, "get", "xpyd", "-o", "wide")
        tool(kubectl, "get", "pods", "-o", "wide")
        tool(kubectl, "get", "events", "--field-selector", "involvedObject.kind=DisaggregatedServing")

        step("replaying 200 requests of the Azure conversation trace through the simulated 1P/2D pool")
        report, plot = OUT / "sim-report.json", OUT / "sim.png"
        subprocess.run([sys.executable, "-m", "xpyd.cli", "sim", "--trace", str(TRACE), "--profile",
                        "h200_llama31_8b_fp8_tp1", "--policy", "static", "--prefill", "1", "--decode", "2",
                        "--report", str(report), "--plot", str(plot)], check=True, timeout=120)
        print(f"\ndemo finished in {time.monotonic() - started:.0f} s; simulation report {report.relative_to(ROOT)}, "
              f"plot {plot.relative_to(ROOT)}")
    except (RuntimeError, subprocess.SubprocessError) as error:
        print(f"demo failed: {error}\nlogs: {plane.logs}", file=sys.stderr)
        return 1
    finally:
        if args.keep:
            print(f"cluster left running: export KUBECONFIG={state.kubeconfig}; "
                  f"PATH={binaries.bin_dir}:$PATH; stop it with `xpyd cluster down --state-dir {plane.state_dir}`")
        else:
            step("tearing the cluster down")
            plane.down(progress=lambda message: None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
