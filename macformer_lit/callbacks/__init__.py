"""Lightning callbacks: throughput/memory, host-memory release, NaN forensics, pre-emption,
feature redraw, attention telemetry, torch.compile, and the standard set every CLI run gets."""

from .compile import CompileModel
from .memory import ReleaseHostMemory
from .monitor import ThroughputMemoryMonitor
from .nan_guard import NaNGuard
from .redraw import FeatureRedraw
from .standard import StandardCallbacks
from .telemetry import AttentionTelemetry

__all__ = [
    "AttentionTelemetry",
    "CompileModel",
    "FeatureRedraw",
    "NaNGuard",
    "ReleaseHostMemory",
    "StandardCallbacks",
    "ThroughputMemoryMonitor",
]
