"""Experiment: does cuBLASLt hold a faster algorithm than torch.mm's choice at the verify row counts? (GPU only)

    python benchmarks/gemm_lt.py [--rows 256,64,128,512] [--shapes gate_up,down] [--algos 64] [--search 150]

torch.mm takes cuBLAS's first heuristic choice, and TunableOp on CUDA offers no other candidate
(results/h100-gemm-variants.md), so a better algorithm in the library would never be seen. Here
cuBLASLt (through ctypes, on the library torch already loaded) is asked for up to --algos
heuristic candidates per shape (TN product as torch issues it: weights [N, K], bf16 in and out,
fp32 accumulation, 32 MiB workspace), and each is timed in `gemm_rows.py`'s graph form (32
calls, 4 weight sets rotated) and checked against fp32 and torch.mm, as the Triton sweeps are.
`--search N` also times up to N variants of the candidates' kernels: every tile each supports, with
split-K 1-4 where it may split (AlgoCheck-valid ones, those nearest whole waves first), since the
heuristic may not offer the tile that fills the 132 SMs (gate_up at 256 rows: 224 tiles of 256 x 128,
1.7 waves). Prints, per shape and row count, torch.mm, the heuristic's first choice, and the fastest
correct candidate with its label and its waves count.
"""
from __future__ import annotations

import argparse
import ctypes

import torch

from gemm_rows import LAYERS, SETS
from gemm_triton import cases, rank_configs   # arguments, weights, cuBLAS timing, floor; the sweep

CUBLAS_COMPUTE_32F, CUDA_R_32F, CUDA_R_16BF = 68, 0, 14
DESC_TRANSA, DESC_TRANSB, PREF_MAX_WORKSPACE = 3, 4, 1
OP_N, OP_T = 0, 1
WORKSPACE = 32 << 20
CAP_SPLITK, CAP_TILE_IDS, CAP_STAGES_IDS = 0, 6, 13                  # cublasLtMatmulAlgoCapAttributes_t
CFG_ID, CFG_TILE, CFG_SPLITK, CFG_REDUCTION, CFG_SWIZZLE, CFG_STAGES = 0, 1, 2, 3, 4, 6   # ...ConfigAttributes_t


class Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class Heuristic(ctypes.Structure):
    _fields_ = [("algo", Algo), ("workspace", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


def _library() -> ctypes.CDLL:
    torch.mm(torch.ones(8, 8, device="cuda"), torch.ones(8, 8, device="cuda"))     # loads cuBLAS(Lt)
    with open("/proc/self/maps") as f:
        paths = {line.split()[-1] for line in f if "libcublasLt" in line}
    if not paths:
        raise SystemExit("libcublasLt is not loaded in this process")
    return ctypes.CDLL(sorted(paths)[0])


class LtGemm:
    """y [M, N] = x [M, K] @ w [N, K]^T through cublasLtMatmul with a chosen algorithm."""

    def __init__(self, lib: ctypes.CDLL, M: int, N: int, K: int, workspace: torch.Tensor):
        self.lib, self.ws = lib, workspace
        self.handle = ctypes.c_void_p()
        self._ok(lib.cublasLtCreate(ctypes.byref(self.handle)))
        self.desc = ctypes.c_void_p()
        self._ok(lib.cublasLtMatmulDescCreate(ctypes.byref(self.desc), CUBLAS_COMPUTE_32F, CUDA_R_32F))
        for attr, op in ((DESC_TRANSA, OP_T), (DESC_TRANSB, OP_N)):
            v = ctypes.c_int32(op)
            self._ok(lib.cublasLtMatmulDescSetAttribute(self.desc, attr, ctypes.byref(v), 4))
        # column-major view: D [N, M] = W^T-op ([K, N] stored) x X ([K, M] stored)
        self.a, self.b, self.c = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
        for lay, rows, cols in ((self.a, K, N), (self.b, K, M), (self.c, N, M)):
            self._ok(lib.cublasLtMatrixLayoutCreate(ctypes.byref(lay), CUDA_R_16BF, ctypes.c_uint64(rows),
                                                    ctypes.c_uint64(cols), ctypes.c_int64(rows)))
        self.alpha, self.beta = ctypes.c_float(1.0), ctypes.c_float(0.0)

    @staticmethod
    def _ok(status: int) -> None:
        if status != 0:
            raise RuntimeError(f"cuBLASLt status {status}")

    def heuristics(self, n: int) -> list[Heuristic]:
        pref = ctypes.c_void_p()
        self._ok(self.lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)))
        size = ctypes.c_uint64(WORKSPACE)
        self._ok(self.lib.cublasLtMatmulPreferenceSetAttribute(pref, PREF_MAX_WORKSPACE, ctypes.byref(size), 8))
        out = (Heuristic * n)()
        count = ctypes.c_int()
        self._ok(self.lib.cublasLtMatmulAlgoGetHeuristic(self.handle, self.desc, self.a, self.b, self.c, self.c,
                                                         pref, n, out, ctypes.byref(count)))
        self.lib.cublasLtMatmulPreferenceDestroy(pref)
        return [out[i] for i in range(count.value) if out[i].state == 0]

    def _get(self, algo: Algo, attr: int) -> int:
        v = ctypes.c_uint32()
        n = ctypes.c_size_t()
        self._ok(self.lib.cublasLtMatmulAlgoConfigGetAttribute(ctypes.byref(algo), attr, ctypes.byref(v), 4,
                                                               ctypes.byref(n)))
        return v.value

    def _set(self, algo: Algo, attr: int, value: int) -> None:
        v = ctypes.c_uint32(value)
        self._ok(self.lib.cublasLtMatmulAlgoConfigSetAttribute(ctypes.byref(algo), attr, ctypes.byref(v), 4))

    def _cap_list(self, algo: Algo, attr: int) -> list[int]:
        n = ctypes.c_size_t()
        self._ok(self.lib.cublasLtMatmulAlgoCapGetAttribute(ctypes.byref(algo), attr, None, 0, ctypes.byref(n)))
        buf = (ctypes.c_uint32 * max(1, n.value // 4))()
        self._ok(self.lib.cublasLtMatmulAlgoCapGetAttribute(ctypes.byref(algo), attr, buf, n.value, ctypes.byref(n)))
        return list(buf)[: n.value // 4]

    def _check(self, algo: Algo) -> Heuristic | None:
        r = Heuristic()
        if self.lib.cublasLtMatmulAlgoCheck(self.handle, self.desc, self.a, self.b, self.c, self.c,
                                            ctypes.byref(algo), ctypes.byref(r)) != 0 or r.state != 0:
            return None
        if r.workspace > WORKSPACE:
            return None
        r.algo = Algo.from_buffer_copy(algo)
        return r

    def variants(self, found: list[Heuristic]) -> list[tuple[Heuristic, str]]:
        """Each heuristic candidate's kernel family with every tile it supports and split-K 1-4
        (its stages kept where valid, else the first valid one): (result of AlgoCheck, label)."""
        out, seen = [], set()
        for h in found:
            base = Algo.from_buffer_copy(h.algo)
            algo_id, stages0 = self._get(base, CFG_ID), self._get(base, CFG_STAGES)
            tiles = self._cap_list(base, CAP_TILE_IDS)
            stages = self._cap_list(base, CAP_STAGES_IDS)
            v, n = ctypes.c_int32(), ctypes.c_size_t()
            self._ok(self.lib.cublasLtMatmulAlgoCapGetAttribute(ctypes.byref(base), CAP_SPLITK, ctypes.byref(v), 4,
                                                                ctypes.byref(n)))
            splits = (1, 2, 3, 4) if v.value else (1,)
            for tile in tiles:
                for split in splits:
                    for st in [stages0] + [x for x in stages if x != stages0]:
                        a = Algo.from_buffer_copy(base)
                        self._set(a, CFG_TILE, tile)
                        self._set(a, CFG_STAGES, st)
                        self._set(a, CFG_SPLITK, split)
                        if split > 1:
                            self._set(a, CFG_REDUCTION, 1)          # in place: no separate reduce kernel
                        r = self._check(a)
                        if r is None and split > 1:
                            self._set(a, CFG_REDUCTION, 2)          # fp32 partials in the workspace
                            r = self._check(a)
                        if r is not None:
                            key = (algo_id, tile, st, split)
                            if key not in seen:
                                seen.add(key)
                                out.append((r, f"algo {algo_id} tile {tile} stages {st} split {split}"))
                            break
        return out

    def __call__(self, x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, h: Heuristic) -> None:
        self._ok(self.lib.cublasLtMatmul(
            self.handle, self.desc, ctypes.byref(self.alpha), ctypes.c_void_p(w.data_ptr()), self.a,
            ctypes.c_void_p(x.data_ptr()), self.b, ctypes.byref(self.beta), ctypes.c_void_p(y.data_ptr()), self.c,
            ctypes.c_void_p(y.data_ptr()), self.c, ctypes.byref(h.algo), ctypes.c_void_p(self.ws.data_ptr()),
            ctypes.c_size_t(WORKSPACE), ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)))


def main() -> None:
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--algos", type=int, default=64)
    ap.add_argument("--search", type=int, default=0, help="also time up to this many tile x split-K variants")
    args, rest = ap.parse_known_args()             # the rest goes to cases()
    lib = _library()
    workspace = torch.empty(WORKSPACE, dtype=torch.uint8, device="cuda")
    for m, name, o, ws, x, y, floor, t_blas, sms, reps in cases(rest):
        lt = LtGemm(lib, m, o, x.shape[1], workspace)
        found = lt.heuristics(args.algos)
        labels = [f"heuristic #{i}" for i in range(len(found))]
        if args.search:
            extra = lt.variants(found)
            # whole waves first: efficiency = waves / ceil(waves)
            extra.sort(key=lambda v: -v[0].waves / max(1.0, float(int(v[0].waves + 0.999))))
            print(f"   {len(extra)} valid variants of the {len(found)} candidates' kernels; timing "
                  f"{min(len(extra), args.search)}", flush=True)
            for r, label in extra[: args.search]:
                found.append(r)
                labels.append(label)
        idx = list(range(len(found)))
        results = rank_configs(idx, lambda i: [lambda j=j: lt(x, ws[j % SETS], y, found[i]) for j in range(LAYERS)],
                               x, ws[0], y, reps)
        first = next((r for r in results if r[1] == 0), None)
        t, i, note = results[0]
        print(f"M {m:4d} {name:8s} floor {floor:7.1f} us  torch.mm {t_blas:7.1f} ({floor / t_blas:4.0%})  "
              f"lt first {first[0] if first else float('nan'):7.1f}  best {t:7.1f} ({floor / t:4.0%}, "
              f"{t_blas / t:4.2f}x) {labels[i]} of {len(found)}, waves {found[i].waves:.2f}, workspace "
              f"{found[i].workspace >> 10} KiB; {note}", flush=True)
        print("   next: " + ", ".join(f"{labels[r[1]]} {r[0]:.1f} ({found[r[1]].waves:.2f} waves)"
                                      for r in results[1:6]))
        bad = [r for r in results if r[0] == float("inf")]
        if bad:
            print(f"   failed {len(bad)}:", "; ".join(f"{labels[r[1]]} {r[2][:80]}" for r in bad[:3]))


if __name__ == "__main__":
    main()
