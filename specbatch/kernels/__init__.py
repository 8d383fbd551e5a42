"""Triton kernels (GPU fast path), under the specbatch namespace (never a top-level `kernels`:
Hugging Face publishes a package of that name, which transformers probes for).

`active(t)` is the switch every caller asks: CUDA, triton installed, not inside `torch_only()`."""
import contextlib as _contextlib
import importlib.util as _importlib_util
import os as _os

_HAVE_TRITON = _importlib_util.find_spec("triton") is not None
# Kernels run in Triton's interpreter (the CPU tests). Its dot multiplies bf16 bit patterns as
# integers (triton 3.9 create_dot): kernels with bf16 dots upcast their operands to fp32 there.
INTERPRET = _os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on", "y")
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
