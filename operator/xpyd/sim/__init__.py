"""Simulation without GPUs: the measured performance model, the vLLM engine emulator and the
trace-replay cluster simulator."""
