"""The performance model of one engine: measured profiles, model and GPU shapes, queueing.

A leaf: it imports nothing else of the package, and the autoscaler, the simulator, the emulator and
`xpyd plan` all size and time engines with it.
"""
