"""The engine: `engine.py` (model, pool, drafter; rows in, records out), `cycle.py` (the cycle,
top to bottom), `graphs.py` (CUDA-graph capture and replay), `profile.py` (stage timings)."""
from .engine import WAIT, Engine, EngineOptions, resolve_device
from .profile import CycleTime

__all__ = ["WAIT", "CycleTime", "Engine", "EngineOptions", "resolve_device"]
