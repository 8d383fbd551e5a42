"""CUDA-graph capture runs with the garbage collector paused (after one collection at an engine's
start; none before a capture mid-job): an earlier engine's graphs freed by the collector in the
middle of a capture break it. CPU-checkable part."""
import gc

from specbatch.engine.graphs import _no_collection


def test_capture_pauses_the_collector_and_restores_it():
    assert gc.isenabled()
    with _no_collection():
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:
        with _no_collection():
            pass
        assert not gc.isenabled()            # a caller that had it off keeps it off
    finally:
        gc.enable()


def test_a_capture_mid_job_pauses_the_collector_without_collecting(monkeypatch):
    calls = []
    monkeypatch.setattr(gc, "collect", lambda *a: calls.append(a) or 0)
    with _no_collection(collect=False):
        assert not gc.isenabled()
    assert gc.isenabled() and calls == []
    with _no_collection():
        pass
    assert len(calls) == 1
