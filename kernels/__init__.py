"""Triton kernels (GPU fast path), installed as `specbatch.kernels`; never a top-level `kernels`.

Hugging Face publishes a package named `kernels` that transformers probes for. Installed, this
directory is only `specbatch.kernels`. Run from a checkout whose root is on sys.path
(`python -c ...` in the repo root), it could be found as `kernels` too: then it hands over to the
Hugging Face package when one is installed, and otherwise stays an empty module without
`__file__`, which transformers reads as a stray namespace directory, not an installed package.
"""
if __name__ == "kernels":
    import importlib.machinery
    import importlib.util
    import os
    import sys

    _root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _paths = [p for p in sys.path if os.path.abspath(p or os.curdir) != _root]
    _spec = importlib.machinery.PathFinder.find_spec("kernels", _paths)
    if _spec is None or _spec.loader is None:
        __file__ = None                     # noqa: A001
    else:
        _module = importlib.util.module_from_spec(_spec)
        sys.modules["kernels"] = _module    # the import system returns what sys.modules holds
        _spec.loader.exec_module(_module)
else:
    import contextlib as _contextlib
    import importlib.util as _importlib_util

    _HAVE_TRITON = _importlib_util.find_spec("triton") is not None
    _enabled = True

    def active(t) -> bool:
        """Whether the Triton path serves tensor `t`: CUDA, triton installed, not switched off."""
        return _enabled and _HAVE_TRITON and t.is_cuda

    @_contextlib.contextmanager
    def torch_only():
        """Run the torch reference path everywhere inside the block (GPU tests compare the two)."""
        global _enabled
        before, _enabled = _enabled, False
        try:
            yield
        finally:
            _enabled = before
