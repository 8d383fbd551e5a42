"""Can decode attention run beside a prefill forward's GEMMs on separate SMs? (GPU only)

    python benchmarks/overlap_probe.py [--cycles 16] [--rows 320] [--tokens 8192]

The job's decode cycles read K/V at the bandwidth while its prefill forwards are compute-bound;
run one after the other they cost the sum (as the job's floor counts them); at once, on disjoint
SMs, they could cost nearer the larger of the two. This times the two
halves of one such pair on Llama-3.1-8B shapes, each captured as a CUDA graph:
  gemm: one prefill forward's GEMMs (32 layers x qkv, o, gate_up, down) at --tokens tokens;
  attn: --cycles decode cycles' attention (32 layers each) over --rows rows in a paged cache,
        contexts uniform 100-1,100 (the kernel the job runs, benchmarks/attention_kernel.py's case);
alone, in sequence, on two ordinary streams at once, and on green contexts: attention on n SMs
and the GEMMs on the remaining SMs (a driver split, so the two sets are disjoint), for a few n.
Milliseconds are medians of --reps replays; 'ideal' is the larger of the two halves alone.
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).parent))
from attention_kernel import PagedCase          # noqa: E402

from specbatch.bench.floor import copy_bandwidth     # noqa: E402
from specbatch.bench.job import matmul_rate          # noqa: E402

HIDDEN, INTER, QKV = 4096, 14336, 6144
LAYERS = 32


def capture(fn: Callable[[], None]) -> torch.cuda.CUDAGraph:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()                                        # compile / allocate outside the capture
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    torch.cuda.synchronize()
    return g


def capture_on(fn: Callable[[], None], stream: torch.cuda.Stream) -> torch.cuda.CUDAGraph:
    """Capture fn on `stream` (a green context's: its kernels keep that context's SMs)."""
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=stream):
        fn()
    torch.cuda.synchronize()
    return g


def timed(launch: Callable[[], None], reps: int) -> float:
    """Median ms of launch() between two events on the current stream (launch joins its streams)."""
    launch()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        launch()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b))
    return statistics.median(out)


def together(pairs: list[tuple[torch.cuda.Stream, Callable[[], None]]]) -> None:
    """Launch each fn on its stream, ordered after and joined back into the current stream."""
    cur = torch.cuda.current_stream()
    for s, _ in pairs:
        s.wait_stream(cur)
    for s, fn in pairs:
        with torch.cuda.stream(s):
            fn()
    for s, _ in pairs:
        cur.wait_stream(s)


class Driver:
    """Green contexts through the driver API: split the device's SMs into n and the rest."""

    def __init__(self, device: int = 0):
        self.cu = ctypes.CDLL("libcuda.so.1")
        self.dev = ctypes.c_int()
        self._ok(self.cu.cuDeviceGet(ctypes.byref(self.dev), device), "cuDeviceGet")

    def _ok(self, rc: int, what: str) -> None:
        if rc != 0:
            raise RuntimeError(f"{what} returned CUresult {rc}")

    def split(self, n: int) -> tuple[torch.cuda.ExternalStream, torch.cuda.ExternalStream, int, int]:
        full = ctypes.create_string_buffer(1024)        # CUdevResource, sized generously
        group = ctypes.create_string_buffer(1024)
        rest = ctypes.create_string_buffer(1024)
        self._ok(self.cu.cuDeviceGetDevResource(self.dev, full, 1), "cuDeviceGetDevResource")  # 1 = SM
        groups = ctypes.c_uint(1)
        self._ok(self.cu.cuDevSmResourceSplitByCount(group, ctypes.byref(groups), full, rest,
                                                     ctypes.c_uint(0), ctypes.c_uint(n)),
                 "cuDevSmResourceSplitByCount")
        streams, counts = [], []
        for res in (group, rest):
            counts.append(ctypes.c_uint.from_buffer(res, 96).value)     # CUdevSmResource.smCount
            desc, ctx, stream = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
            self._ok(self.cu.cuDevResourceGenerateDesc(ctypes.byref(desc), res, ctypes.c_uint(1)),
                     "cuDevResourceGenerateDesc")
            self._ok(self.cu.cuGreenCtxCreate(ctypes.byref(ctx), desc, self.dev, ctypes.c_uint(1)),
                     "cuGreenCtxCreate")
            self._ok(self.cu.cuGreenCtxStreamCreate(ctypes.byref(stream), ctx, ctypes.c_uint(1),
                                                    ctypes.c_int(0)), "cuGreenCtxStreamCreate")
            streams.append(torch.cuda.ExternalStream(stream.value))
        return streams[0], streams[1], counts[0], counts[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cycles", type=int, default=16, help="decode cycles' attention per replay")
    ap.add_argument("--rows", type=int, default=320, help="decode rows per cycle")
    ap.add_argument("--tokens", type=int, default=8192, help="prefill tokens per forward")
    ap.add_argument("--sms", default="16,24,32,48,64", help="SM counts to give attention")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--width", type=int, default=1, help="new tokens per decode row (verify width)")
    args = ap.parse_args()
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    bw, rate = copy_bandwidth(dev), matmul_rate(dev, torch.bfloat16)
    print(f"{torch.cuda.get_device_name(dev)} ({sms} SMs), torch {torch.__version__}; "
          f"copy {bw / 1e9:.0f} GB/s, matmul {rate / 1e12:.0f} TFLOP/s")

    bf = torch.bfloat16
    sets = 4                                         # distinct layer weights, rotated over 32 layers
    w = [[torch.randn(o, i, device=dev, dtype=bf) * 0.02 for o, i in
          ((QKV, HIDDEN), (HIDDEN, HIDDEN), (2 * INTER, HIDDEN), (HIDDEN, INTER))] for _ in range(sets)]
    x = torch.randn(args.tokens, HIDDEN, device=dev, dtype=bf)
    qkv = torch.empty(args.tokens, QKV, device=dev, dtype=bf)
    o = torch.empty(args.tokens, HIDDEN, device=dev, dtype=bf)
    gu = torch.empty(args.tokens, 2 * INTER, device=dev, dtype=bf)

    def forward() -> None:
        for layer in range(LAYERS):
            wq, wo, wg, wd = w[layer % sets]
            torch.mm(x, wq.t(), out=qkv)
            torch.mm(x, wo.t(), out=o)
            torch.mm(x, wg.t(), out=gu)
            torch.mm(gu[:, :INTER], wd.t(), out=o)

    case = PagedCase(args.rows, args.width, dev)

    def cycles() -> None:
        for c in range(args.cycles):
            for layer in range(LAYERS):
                case.kernel((c * LAYERS + layer) % case.layers)

    flops = 2 * args.tokens * LAYERS * (QKV * HIDDEN + HIDDEN * HIDDEN + 2 * INTER * HIDDEN + INTER * HIDDEN)
    kv = case.read_bytes * LAYERS * args.cycles
    g_gemm, g_attn = capture(forward), capture(cycles)
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream(priority=-1)
    t_gemm = timed(g_gemm.replay, args.reps)
    t_attn = timed(g_attn.replay, args.reps)
    print(f"gemm alone {t_gemm:7.1f} ms ({flops / t_gemm / 1e9:.0f} TFLOP/s, {flops / rate / t_gemm * 1e3:.0%} of matmul); "
          f"attn alone {t_attn:7.1f} ms ({kv / t_attn / 1e6:.0f} GB/s, {kv / bw / t_attn * 1e3:.0%} of copy)")
    print(f"in sequence {t_gemm + t_attn:7.1f} ms; ideal (the larger) {max(t_gemm, t_attn):7.1f} ms")
    t_two = timed(lambda: together([(s1, g_gemm.replay), (s2, g_attn.replay)]), args.reps)
    print(f"two streams (attention at high priority) {t_two:7.1f} ms")

    try:
        import torch.cuda.green_contexts as gc      # torch's own: attention on n SMs, GEMMs on all
        keep = []                                    # a green context lives as long as its object
        for n in (int(v) for v in args.sms.split(",")):
            ctx = gc.GreenContext.create(num_sms=n, device_id=dev.index or 0)
            keep.append(ctx)
            a = ctx.Stream()
            ta = timed(lambda: together([(a, g_attn.replay)]), args.reps)
            tt = timed(lambda: together([(s1, g_gemm.replay), (a, g_attn.replay)]), args.reps)
            print(f"torch green context: attention on {n} SMs alone {ta:7.1f} ms, beside the GEMMs "
                  f"on all SMs {tt:7.1f} ms ({(t_gemm + t_attn) / tt:.2f}x the sequence)")
    except Exception as e:                           # noqa: BLE001 - a probe: say why, go on
        print(f"torch green contexts: {type(e).__name__}: {e}")
        torch.cuda.synchronize()
    try:                                             # cuBLASLt leaves n SMs to the attention
        torch.backends.cuda.preferred_blas_library("cublaslt")
        for n in (int(v) for v in args.sms.split(",")):
            try:
                torch._C._set_sm_carveout_experimental(n)
                g_c = capture(forward)
            finally:
                torch._C._set_sm_carveout_experimental(None)
            tg = timed(g_c.replay, args.reps)
            tt = timed(lambda: together([(s1, g_c.replay), (s2, g_attn.replay)]), args.reps)
            print(f"cuBLASLt carveout {n} SMs: GEMMs alone {tg:7.1f} ms, beside attention {tt:7.1f} ms "
                  f"({(t_gemm + t_attn) / tt:.2f}x the sequence)")
    except Exception as e:                           # noqa: BLE001
        print(f"carveout: {type(e).__name__}: {e}")
        torch.cuda.synchronize()
    finally:                                         # the driver splits below run on the default
        torch.backends.cuda.preferred_blas_library("default")
    try:
        drv = Driver(dev.index or 0)
    except Exception as e:                           # noqa: BLE001 - a probe: say why and stop
        print(f"driver green contexts unavailable: {e}")
        return
    print(f"{'attn SMs':>8s} {'gemm SMs':>8s} {'attn alone':>10s} {'gemm alone':>10s} {'ideal':>7s} "
          f"{'together':>8s} {'vs seq':>7s}")
    # graphs replayed into green-context streams; where the driver refuses that, eager launches
    for label in ("graphs captured on the green streams", "eager"):
        print(label)
        for n in (int(v) for v in args.sms.split(",")):
            try:
                a, g, na, ng = drv.split(n)
                attn_fn, gemm_fn = cycles, forward
                if label != "eager":
                    attn_fn, gemm_fn = capture_on(cycles, a).replay, capture_on(forward, g).replay
                ta = timed(lambda: together([(a, attn_fn)]), args.reps)
                tg = timed(lambda: together([(g, gemm_fn)]), args.reps)
                tt = timed(lambda: together([(g, gemm_fn), (a, attn_fn)]), args.reps)
                print(f"{na:8d} {ng:8d} {ta:10.1f} {tg:10.1f} {max(ta, tg):7.1f} {tt:8.1f} "
                      f"{(t_gemm + t_attn) / tt:6.2f}x")
            except Exception as e:                   # noqa: BLE001
                print(f"{n:8d}: failed: {e}")
                torch.cuda.synchronize()


if __name__ == "__main__":
    main()
