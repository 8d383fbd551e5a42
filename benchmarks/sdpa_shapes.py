"""Why eager bf16 decode was slow: SDPA with a boolean mask and a key length that changes every step.

    python benchmarks/sdpa_shapes.py

Times 200 decode-like attention calls (B=16, 4 heads / 2 KV heads, d=64, one query, a bool mask)
whose key length grows by one per call, per dtype and SDPA backend set, then the same with the key
length rounded up to a multiple of 128.
"""
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

B, HQ, HKV, D = 16, 4, 2, 64


def run(dtype, backends, bucket):
    q = torch.randn(B, HQ, 1, D, device="cuda", dtype=dtype)
    kv = torch.randn(B, HKV, 2048, D, device="cuda", dtype=dtype)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with sdpa_kernel(backends):
        for L in range(300, 500):
            Lb = -(-L // bucket) * bucket
            mask = torch.ones(B, 1, 1, Lb, dtype=torch.bool, device="cuda")
            mask[..., L:] = False
            F.scaled_dot_product_attention(q, kv[:, :, :Lb], kv[:, :, :Lb], attn_mask=mask, enable_gqa=True)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / 200 * 1e6


all_backends = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
no_cudnn = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
for dtype in (torch.float32, torch.bfloat16):
    for name, backends in (("default", all_backends), ("no cuDNN", no_cudnn)):
        for bucket in (1, 128):
            run(dtype, backends, bucket)            # warm-up pass (plans for these shapes built)
            print(f"{str(dtype):15s} {name:9s} bucket {bucket:3d}: {run(dtype, backends, bucket):8.1f} us/call (warm)")
# cold: fresh key lengths never seen before
for dtype in (torch.float32, torch.bfloat16):
    for name, backends in (("default", all_backends), ("no cuDNN", no_cudnn)):
        q = torch.randn(B, HQ, 1, D, device="cuda", dtype=dtype)
        kv = torch.randn(B, HKV, 4096, D, device="cuda", dtype=dtype)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with sdpa_kernel(backends):
            for L in range(1000 + (0 if name == "default" else 500), 1100 + (0 if name == "default" else 500)):
                mask = torch.ones(B, 1, 1, L, dtype=torch.bool, device="cuda")
                F.scaled_dot_product_attention(q, kv[:, :, :L], kv[:, :, :L], attn_mask=mask, enable_gqa=True)
        torch.cuda.synchronize()
        print(f"{str(dtype):15s} {name:9s} new lengths: {(time.perf_counter() - t0) / 100 * 1e6:8.1f} us/call (cold)")
