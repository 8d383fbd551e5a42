"""The engine: `engine.py` (model, pool, drafter; rows in, records out), `cycle.py` (the cycle,
top to bottom), `graphs.py` (CUDA-graph capture and replay), `profile.py` (stage timings)."""
from .engine import Engine, EngineOptions, resolve_device
from .profile import CycleTime

__all__ = ["CycleTime", "Engine", "EngineOptions", "resolve_device"]
