"""Hidden-state capture: the engine's tap (enqueue only) and the Kafka producer thread."""
from tide.capture.sampling import SamplingPolicy
from tide.capture.tap import CaptureTap

__all__ = ["CaptureTap", "SamplingPolicy"]
