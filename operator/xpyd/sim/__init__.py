"""Simulation without GPUs: the measured performance model, the vLLM engine emulator and the
trace-replay cluster simulator."""

from xpyd.common.native import package_path

__path__ = package_path(__name__, __path__)   # the compiled build first, when it matches the sources
