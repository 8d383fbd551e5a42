"""Triton kernels (GPU fast path). Installed as specbatch.kernels; never a top-level `kernels`."""
