"""The performance model of one engine: measured profiles, model and GPU shapes, queueing.

A leaf: it imports nothing else of the package but `xpyd.common`, and the autoscaler, the simulator, the emulator and
`xpyd plan` all size and time engines with it.
"""

from xpyd.common.native import package_path

__path__ = package_path(__name__, __path__)   # the compiled build first, when it matches the sources
