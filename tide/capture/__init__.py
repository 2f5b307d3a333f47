"""Hidden-state capture: the engine's tap (stages rows only) and the capture worker process.

``CaptureTap`` is imported lazily: the worker process imports this package too and must not pay
for (or depend on) torch, which the tap needs."""
from tide.capture.sampling import SamplingPolicy

__all__ = ["CaptureTap", "SamplingPolicy"]


def __getattr__(name: str):
    if name == "CaptureTap":
        from tide.capture.tap import CaptureTap

        return CaptureTap
    raise AttributeError(f"module 'tide.capture' has no attribute {name!r}")
