"""Triton slot-cache attention vs the torch path, timed inside CUDA graphs (GPU only).

    python benchmarks/attention_kernel.py [--sweep]

Llama-3.1-8B attention shapes (32 query / 8 kv heads, head_dim 128, bf16) for decode (T=1),
chain verify (T=4, causal) and a tree of 8 nodes, at batch 1/8/64 and context 1024/4096 (every
slot full). Per case: microseconds per call for `kernels.attention.slot_attention` (default split
plan) and `models.attention.attend`, and the K/V bytes read over the time as a fraction of copy
bandwidth. Calls rotate over enough layer planes of one cache tensor to overflow L2, as a model's
layers do, so every call reads from HBM. --sweep instead times split counts for decode and a
four-token verify at 1-16 rows, to tune the defaults in kernels/attention.py. --paged times the
job's operating point instead: a paged cache (64-row pages in shuffled order), 64 to 512 rows of mixed contexts
(uniform 100 to 1,100 rows: mean ~600), decode and chain verify of 2 and 4 tokens, each also
with its programs started longest first (`longest_first`), then equal contexts. --prefill times
packed prefill forwards of 8,192 tokens as the engine builds them (one sequence a prompt token,
query tiles of 32 tokens x 4 heads, each token reading its prompt's earlier rows) against the
causal FLOPs at the measured matmul rate, for the default tile shape and, with --sweep, other
(BLOCK_N, warps, stages).
"""
from __future__ import annotations

import argparse
import functools
import itertools

import torch
import triton

from specbatch.bench.timing import graph_us as _graph_us
from specbatch.bench.floor import copy_bandwidth
from specbatch.bench.job import JobMix, lognormal_lengths, matmul_rate
from specbatch import kernels
from specbatch.kernels import attention as kattn
from specbatch.models.attention import AttnMetadata, attend

HQ, HKV, D = 32, 8, 128
DTYPE = torch.bfloat16
MODES = [("decode", 1), ("chain", 4), ("tree", 8)]
BATCHES = [1, 8, 64]
CONTEXTS = [1024, 4096]


def planes(read_bytes: int, dev: torch.device) -> int:
    """Layer planes to rotate over so that one graph replay reads ~3x the L2 cache from HBM."""
    l2 = getattr(torch.cuda.get_device_properties(dev), "L2_cache_size", 50 << 20)
    return min(max(2, -(-3 * l2 // read_bytes)), 32)


class Case:
    """A cache [2 * layers, B + 1, ctx + T, Hkv, D] with every slot full, and one query per layer."""

    def __init__(self, B: int, mode: str, T: int, ctx: int, dev: torch.device):
        self.B, self.T, self.ctx = B, T, ctx
        self.read_bytes = 2 * B * (ctx + T) * HKV * D * DTYPE.itemsize     # K and V, rows read
        self.layers = planes(self.read_bytes, dev)
        self.data = torch.randn(2 * self.layers, B + 1, ctx + T, HKV, D, device=dev, dtype=DTYPE)
        self.q = torch.randn(B, T, HQ, D, device=dev, dtype=DTYPE)
        self.out = torch.empty_like(self.q)
        slots = torch.arange(B, device=dev)
        prefix = torch.full((B,), ctx, device=dev)
        positions = prefix[:, None] + torch.arange(T, device=dev)
        tree = None
        if mode == "tree":        # a binary-ish tree: node i's parent is (i - 1) // 2
            idx = torch.arange(T, device=dev)
            anc = idx[:, None] == idx[None, :]
            for i in range(1, T):
                anc[i] |= anc[(i - 1) // 2]
            tree = anc.expand(B, T, T).contiguous()
        self.meta = AttnMetadata(slots=slots, positions=positions, prefix_lens=prefix,
                                 kv_len=ctx + T, tree_mask=tree)

    def kernel(self, layer: int, **kw) -> torch.Tensor:
        m = self.meta
        return kattn.slot_attention(self.q, self.data[2 * layer], self.data[2 * layer + 1], m.slots,
                                    m.prefix_lens, D ** -0.5, tree_mask=m.tree_mask,
                                    max_rows=m.kv_len, out=self.out, **kw)

    def torch(self, layer: int) -> torch.Tensor:
        with kernels.torch_only():          # attend dispatches to the kernel on CUDA otherwise
            return attend(self.q, self.data[2 * layer], self.data[2 * layer + 1], self.meta, D ** -0.5)


def graph_us(fn, layers: int, replays: int = 50) -> float:
    """Median microseconds per fn(layer) call, one graph holding one call per layer."""
    return _graph_us([functools.partial(fn, i) for i in range(layers)], replays)


def sweep(dev: torch.device, bw: float) -> None:
    """Decode and a four-token verify at few rows: time against the split count (the default
    plan marked), where a launch's latency, not its bytes, decides."""
    print("\nsweep: splits at few rows (* = the default plan)")
    for B, T, ctx in ((1, 1, 1024), (1, 4, 1024), (4, 4, 1024), (16, 1, 1024), (1, 1, 4096), (8, 1, 4096)):
        case = Case(B, "decode" if T == 1 else "chain", T, ctx, dev)
        G = HQ // HKV
        block_n = kattn._config(min(kattn.MAX_QUERY_ROWS, max(16, triton.next_power_of_2(T * G))),
                                D, DTYPE.itemsize)[0]
        default = kattn.choose_splits(B * HKV, ctx + T, block_n, dev)
        cells = []
        for splits in sorted({1, 2, 4, 8, 16, 32, 64, default}):
            us = graph_us(lambda i: case.kernel(i, num_splits=splits), case.layers)
            cells.append(f"{splits}{'*' if splits == default else ''}: {us:.2f}")
        print(f"  B {B:2d} T {T} ctx {ctx:5d} ({case.read_bytes / bw * 1e6:5.2f} us at bandwidth): " + "  ".join(cells))


class PagedCase:
    """B rows of mixed context lengths in a paged cache [pages, P, Hkv, D] per layer plane."""

    P = 64

    def __init__(self, B: int, T: int, dev: torch.device, seed: int = 0, lengths: tuple[int, int] = (100, 1100)):
        g = torch.Generator().manual_seed(seed)
        ctx = torch.randint(lengths[0], lengths[1] + 1, (B,), generator=g)
        self.B, self.T = B, T
        rows = int((ctx + T).sum())
        self.read_bytes = 2 * rows * HKV * D * DTYPE.itemsize
        width = -(-int(ctx.max() + T) // self.P)
        pages = B * width + 1
        self.layers = planes(self.read_bytes, dev)
        self.data = torch.randn(2 * self.layers, pages, self.P, HKV, D, device=dev, dtype=DTYPE)
        self.table = (torch.randperm(pages - 1, generator=g)[:B * width] + 1).view(B, width).to(dev)
        self.q = torch.randn(B, T, HQ, D, device=dev, dtype=DTYPE)
        self.out = torch.empty_like(self.q)
        self.slots = torch.arange(B, device=dev)
        self.prefix = ctx.to(dev)
        self.max_rows = int(ctx.max()) + T

    def kernel(self, layer: int, **kw) -> torch.Tensor:
        return kattn.slot_attention(self.q, self.data[2 * layer], self.data[2 * layer + 1], self.slots,
                                    self.prefix, D ** -0.5, max_rows=self.max_rows, out=self.out,
                                    page_table=self.table, **kw)


def paged_configs(dev: torch.device, bw: float) -> None:
    """Decode and a width-2 verify at job batch sizes over (BLOCK_N, warps, stages), to check the
    default tile against this GPU (the split plan as the engine chooses it)."""
    print("\npaged tile sweep, mixed contexts 100-1100: us and fraction of bandwidth (* = default)")
    default = kattn._config
    configs = [(bn, w, st) for bn in (32, 64, 128) for w in (2, 4, 8) for st in (2, 3, 4)]
    for T, B in ((1, 128), (1, 320), (1, 512), (2, 320)):
        case = PagedCase(B, T, dev)
        floor_us = case.read_bytes / bw * 1e6
        base = default(max(16, T * HQ // HKV), D, DTYPE.itemsize)
        cells = []
        for cfg in configs:
            kattn._config = lambda *a, cfg=cfg: cfg
            try:
                us = graph_us(case.kernel, case.layers)
            except Exception as e:          # out of shared memory / registers: say so, go on
                cells.append((cfg, float("nan"), type(e).__name__))
                continue
            finally:
                kattn._config = default
            cells.append((cfg, us, ""))
        cells.sort(key=lambda c: (c[1] != c[1], c[1]))
        print(f"T {T} B {B:4d} floor {floor_us:8.1f} us; default {base}")
        for cfg, us, err in cells[:8] + [c for c in cells[8:] if c[0] == base]:
            mark = "*" if cfg == base else " "
            print(f"  {mark}{cfg}: " + (err or f"{us:8.1f} us {floor_us / us:6.1%}"))
        del case
        torch.cuda.empty_cache()


def paged(dev: torch.device, bw: float) -> None:
    print("\npaged, mixed contexts 100-1100 (the job's decode and verify); 'longest first': the "
          "programs started in longest_first's order (found once a forward: 'order us')")
    print(f"{'T':>2s} {'B':>4s} {'GB read':>8s} {'floor us':>9s} {'splits':>6s} {'triton us':>10s} {'of bw':>6s} "
          f"{'longest first':>13s} {'of bw':>6s} {'order us':>8s}   (then other split counts: us, of bw)")
    rows = [(T, B, (100, 1100)) for T, B in itertools.product((1, 2, 4), (16, 32, 64, 128, 320, 512))]
    rows += [(1, B, (1024, 1024)) for B in (64, 128, 320)]
    for T, B, lengths in rows:
        if lengths[0] == lengths[1] and B == 64:
            print("equal contexts, 1,024 rows each")
        case = PagedCase(B, T, dev, lengths=lengths)
        floor_us = case.read_bytes / bw * 1e6
        block_n, _, _ = kattn._config(max(16, T * HQ // HKV), D, DTYPE.itemsize)
        splits = kattn.choose_splits(B * HKV, case.max_rows, block_n, dev)
        k_us = graph_us(case.kernel, case.layers)
        order = kattn.longest_first(case.prefix, HKV)
        if order is None:
            o_us = sort_us = float("nan")
        else:
            o_us = graph_us(functools.partial(case.kernel, order=order), case.layers)
            sort_us = _graph_us([functools.partial(kattn.longest_first, case.prefix, HKV)], 50)
        other = [(n, graph_us(functools.partial(case.kernel, num_splits=n), case.layers))
                 for n in (1, 2, 4, 8) if n != splits and B <= 128]
        print(f"{T:2d} {B:4d} {case.read_bytes / 1e9:8.3f} {floor_us:9.2f} {splits:6d} {k_us:10.2f} "
              f"{floor_us / k_us:6.1%} {o_us:13.2f} {floor_us / o_us:6.1%} {sort_us:8.2f}   "
              + "  ".join(f"{n}: {us:.1f} {floor_us / us:.0%}" for n, us in other))
        del case
        torch.cuda.empty_cache()


class PrefillCase:
    """One packed prefill forward as the engine builds it: every prompt token a sequence of one new
    token at its position, runs of C tokens of one prompt grouped into query tiles, in a paged
    cache; tokens attend causally within their prompt."""

    P = 64

    def __init__(self, lengths: list[int], dev: torch.device, seed: int = 0, C: int = 32):
        g = torch.Generator().manual_seed(seed)
        self.C = C
        P = self.P
        slots, pos, start, count = [], [], [], []
        for i, L in enumerate(lengths):
            for a in range(0, L, C):
                start.append(len(pos) + a)
                count.append(min(C, L - a))
            slots += [i] * L
            pos += list(range(L))
        self.R = len(start)
        # causal FLOPs: QK^T and PV, 2 x 2 x D each per (query head, key) pair; token at p sees p + 1 keys
        self.flops = 4 * D * HQ * sum(p + 1 for p in pos)
        width = -(-max(lengths) // P)
        pages = len(lengths) * width + 1
        self.read_bytes = 2 * sum(lengths) * HKV * D * DTYPE.itemsize
        self.layers = 4
        self.data = torch.randn(2 * self.layers, pages, P, HKV, D, device=dev, dtype=DTYPE)
        self.table = (torch.randperm(pages - 1, generator=g)[:len(lengths) * width] + 1).view(-1, width).to(dev)
        self.q = torch.randn(len(pos), 1, HQ, D, device=dev, dtype=DTYPE)
        self.out = torch.empty_like(self.q)
        self.slots = torch.tensor(slots, device=dev)
        self.prefix = torch.tensor(pos, device=dev)
        self.start, self.count = torch.tensor(start, device=dev), torch.tensor(count, device=dev)
        self.max_rows = max(lengths)

    def kernel(self, layer: int, **kw) -> torch.Tensor:
        return kattn.slot_attention(self.q, self.data[2 * layer], self.data[2 * layer + 1], self.slots,
                                    self.prefix, D ** -0.5, max_rows=self.max_rows, out=self.out,
                                    page_table=self.table, tile_start=self.start, tile_count=self.count,
                                    tile_size=self.C, **kw)


def job_lengths(tokens: int, seed: int = 0) -> list[int]:
    """Prompt lengths of the job mix (`bench --job`'s defaults) until `tokens` are reached (the
    last one cut short)."""
    mix = JobMix()
    # at least one token each: `tokens` lengths always suffice
    drawn = iter(lognormal_lengths(tokens, mix.prompt_median, mix.prompt_sigma, mix.prompt_max,
                                   torch.Generator().manual_seed(seed)))
    out, used = [], 0
    while used < tokens:
        out.append(min(next(drawn), tokens - used))
        used += out[-1]
    return out


def prefill(dev: torch.device, rate: float, sweep: bool, tiles: list[int]) -> None:
    print(f"\npacked prefill forwards of 8,192 tokens, query tiles of {tiles} tokens (matmul rate {rate / 1e12:.0f} TFLOP/s)")
    shapes = {"32x256": [256] * 32, "8x1024": [1024] * 8, "5x1536+": [1536] * 5 + [512],
              "2x4096": [4096] * 2, "job mix": job_lengths(8192)}
    default = kattn._config
    configs = [None]
    if sweep:
        configs += [(bn, w, st) for bn in (32, 64, 128) for w in (4, 8) for st in (2, 3)]
    for (name, lengths), C in itertools.product(shapes.items(), tiles):
        case = PrefillCase(lengths, dev, C=C)
        for cfg in configs:
            if cfg is not None:
                kattn._config = lambda *a, cfg=cfg: cfg
            try:
                us = graph_us(case.kernel, case.layers, replays=20)
            except Exception as e:          # out of shared memory / registers: say so, go on
                print(f"  {name:8s} {cfg}: failed ({type(e).__name__})")
                continue
            finally:
                kattn._config = default
            floor_us = case.flops / rate * 1e6
            rows = min(kattn.MAX_QUERY_ROWS, max(16, triton.next_power_of_2(C * HQ // HKV)))
            label = "default " + str(default(rows, D, DTYPE.itemsize)) if cfg is None else str(cfg)
            print(f"  {name:8s} C {C:3d} tiles {case.R:4d} {label:22s} {us:9.1f} us/layer  floor {floor_us:7.1f}  "
                  f"{floor_us / us:6.1%} of the rate  (x32 layers: {us * 32 / 1e3:6.2f} ms)")
        del case
        torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true", help="time split counts for decode / verify at 1-16 rows")
    ap.add_argument("--paged", action="store_true",
                    help="only the paged job shapes (decode / verify, 64-512 rows; --sweep: tile shapes)")
    ap.add_argument("--prefill", action="store_true", help="only packed prefill forwards (--sweep: tile shapes too)")
    ap.add_argument("--tiles", default="32", help="--prefill: prompt tokens a query tile (comma-separated)")
    args = ap.parse_args()
    dev = torch.device("cuda")
    bw = copy_bandwidth(dev)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    print(f"{torch.cuda.get_device_name(dev)} ({sms} SMs); copy bandwidth {bw / 1e9:.0f} GB/s; "
          f"Hq {HQ} Hkv {HKV} D {D} {DTYPE}; kernels from {kattn.__file__}")
    if args.paged:
        paged_configs(dev, bw) if args.sweep else paged(dev, bw)
        return
    if args.prefill:
        prefill(dev, matmul_rate(dev, DTYPE), args.sweep, [int(c) for c in args.tiles.split(",")])
        return
    if args.sweep:
        sweep(dev, bw)
        return
    print(f"{'mode':6s} {'B':>3s} {'ctx':>5s} {'splits':>6s} {'floor us':>9s} "
          f"{'triton us':>10s} {'of bw':>6s} {'torch us':>9s} {'of bw':>6s}")
    for (mode, T), B, ctx in itertools.product(MODES, BATCHES, CONTEXTS):
        case = Case(B, mode, T, ctx, dev)
        got, ref = case.kernel(0), case.torch(0)
        err = (got.float() - ref.float()).abs().max().item()
        assert err < 2e-2, f"kernel disagrees with torch: {err}"
        block_n, _, _ = kattn._config(max(16, T * HQ // HKV), D, DTYPE.itemsize)
        splits = kattn.choose_splits(B * HKV, ctx + T, block_n, dev)
        floor_us = case.read_bytes / bw * 1e6
        k_us = graph_us(case.kernel, case.layers)
        try:
            t_us = graph_us(case.torch, case.layers)
        except RuntimeError as e:          # the torch path not capturable in some build: say so
            print(f"  (torch path not captured: {e})")
            t_us = float("nan")
        print(f"{mode:6s} {B:3d} {ctx:5d} {splits:6d} {floor_us:9.2f} {k_us:10.2f} {floor_us / k_us:6.1%} "
              f"{t_us:9.2f} {floor_us / t_us:6.1%}")
        del case
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
