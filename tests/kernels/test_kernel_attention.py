"""The Triton slot-cache attention kernel against the eager torch path (`models.attention.attend`).

CPU cases run in the Triton interpreter (conftest sets TRITON_INTERPRET=1 without CUDA): small
sizes, every mask kind, GQA, odd head_dim, splits, sliding window, programs in any order. GPU cases (`pytest -m gpu`):
real head shapes, ragged contexts up to 4096, every dtype, and replay of a captured CUDA graph
after the lengths change in place (how the engine runs it).
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("triton")

from specbatch.kernels.counters import _buffers  # noqa: E402
from specbatch.kernels.attention import choose_splits, longest_first, slot_attention  # noqa: E402
from specbatch.models.attention import AttnMetadata, QueryTiles, attend  # noqa: E402
from specbatch.speculative.tree import ancestor_mask  # noqa: E402

TOL = {torch.float32: (2e-5, 1e-5), torch.float16: (5e-3, 5e-3), torch.bfloat16: (2e-2, 2e-2)}  # atol, rtol


def _random_parents(B: int, T: int, gen: torch.Generator) -> torch.Tensor:
    """[B, T] parents of random trees in depth-first-compatible order: node i's parent is < i."""
    p = torch.full((B, T), -1, dtype=torch.int64)
    for i in range(1, T):
        p[:, i] = torch.randint(0, i, (B,), generator=gen)
    return p


def _depths(parents: torch.Tensor) -> torch.Tensor:
    d = torch.zeros_like(parents)
    for i in range(1, parents.shape[1]):
        d[:, i] = d.gather(1, parents[:, i:i + 1]).squeeze(1) + 1
    return d


def build_case(B: int, T: int, Hq: int, Hkv: int, D: int, dtype: torch.dtype, prefix: list[int],
               mode: str, *, write_offset: int = 0, device: str = "cpu", seed: int = 0) -> dict:
    """A cache with random rows everywhere, NaN in every row no query may read, and the metadata.

    mode: "causal" (region write_offset + T), "tree" (ancestor mask, M = T) or "draft" (an EAGLE3
    draft step: T beams at region rows write_offset + j, each seeing one node per earlier level).
    """
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    pre = torch.tensor(prefix, dtype=torch.int64)
    t = torch.arange(T)
    tree_mask = None
    if mode == "causal":
        M = write_offset + T
        positions = pre[:, None] + write_offset + t
    elif mode == "tree":
        assert write_offset == 0
        M = T
        parents = _random_parents(B, T, gen)
        tree_mask = ancestor_mask(parents, T)
        positions = pre[:, None] + _depths(parents)
    else:
        assert write_offset % T == 0
        M = write_offset + T
        level = write_offset // T
        tree_mask = torch.zeros(B, T, M, dtype=torch.bool)
        tree_mask[:, t, write_offset + t] = True
        for lv in range(level):
            pick = torch.randint(0, T, (B, T), generator=gen)
            tree_mask.scatter_(2, lv * T + pick[:, :, None], True)
        positions = (pre + level)[:, None].expand(B, T)
    S = B + 2                                   # two slots nobody reads
    L = max(prefix) + M + 7
    kv = torch.randn(2, S, L, Hkv, D, device=device).to(dtype)
    slots = torch.randperm(S, generator=gen)[:B]
    poisoned = kv.clone()
    unused = torch.ones(S, dtype=torch.bool)
    unused[slots] = False
    poisoned[:, unused.to(device)] = float("nan")
    for b in range(B):
        poisoned[:, int(slots[b]), prefix[b] + M:] = float("nan")
    dev = torch.device(device)
    slots, pre, positions = slots.to(dev), pre.to(dev), positions.contiguous().to(dev)
    tree_mask = tree_mask.to(dev) if tree_mask is not None else None
    meta = AttnMetadata(slots=slots, positions=positions, prefix_lens=pre, kv_len=max(prefix) + M,
                        tree_mask=tree_mask, write_offset=write_offset)
    q = torch.randn(B, T, Hq, D, device=dev).to(dtype)
    return dict(q=q, kv=poisoned, kv_ref=kv, meta=meta, scale=D ** -0.5)


def run_kernel(case: dict, *, window: int | None = None, out: torch.Tensor | None = None,
               **kw) -> torch.Tensor:
    m = case["meta"]
    return slot_attention(case["q"], case["kv"][0], case["kv"][1], m.slots, m.prefix_lens, case["scale"],
                          tree_mask=m.tree_mask, write_offset=m.write_offset, positions=m.positions,
                          sliding_window=window, out=out, **kw)


def reference(case: dict, window: int | None = None) -> torch.Tensor:
    return attend(case["q"], case["kv_ref"][0], case["kv_ref"][1], case["meta"], case["scale"], window)


def check(case: dict, window: int | None = None, **kw) -> None:
    q = case["q"]
    out = torch.full_like(q, float("nan"))               # poisoned: every element must be written
    got = run_kernel(case, window=window, out=out, **kw)
    assert got is out and got.dtype == q.dtype
    atol, rtol = TOL[q.dtype]
    torch.testing.assert_close(got.float(), reference(case, window).float(), atol=atol, rtol=rtol)


# --------------------------------------------------------------------------- CPU (interpreter)

CPU_CASES = [
    # (B, T, Hq, Hkv, D, dtype, prefix, mode, write_offset, num_splits, window)
    (3, 1, 8, 2, 16, torch.float32, [0, 37, 130], "causal", 0, 1, None),       # decode, G=4
    (3, 1, 8, 2, 16, torch.float32, [0, 37, 130], "causal", 0, 3, None),
    (2, 3, 4, 2, 24, torch.bfloat16, [70, 5], "causal", 0, 1, None),           # chain, odd D
    (2, 3, 4, 2, 24, torch.float32, [70, 0], "causal", 2, 3, None),            # rows before the new ones
    (2, 5, 2, 2, 16, torch.float32, [90, 3], "tree", 0, 3, None),              # G=1 tree
    (2, 5, 4, 1, 16, torch.bfloat16, [0, 66], "tree", 0, 1, None),             # G=4 tree
    (2, 2, 4, 2, 24, torch.float32, [40, 129], "draft", 4, 1, None),           # draft step, M > T
    (2, 2, 4, 2, 24, torch.float16, [40, 129], "draft", 4, 3, None),
    (2, 2, 4, 2, 16, torch.float32, [150, 20], "causal", 0, 3, 60),            # sliding window
    (2, 3, 4, 2, 16, torch.float32, [150, 7], "tree", 0, 2, 100),
]


@pytest.mark.interpreter
@pytest.mark.parametrize("B,T,Hq,Hkv,D,dtype,prefix,mode,off,splits,window", CPU_CASES)
def test_matches_torch_interpreter(B, T, Hq, Hkv, D, dtype, prefix, mode, off, splits, window):
    case = build_case(B, T, Hq, Hkv, D, dtype, prefix, mode, write_offset=off)
    check(case, window, num_splits=splits)


@pytest.mark.interpreter
def test_default_splits_and_empty_splits_interpreter():
    # max_rows far above the slots' real rows: most splits get no blocks and must add nothing
    case = build_case(2, 2, 4, 2, 16, torch.float32, [10, 100], "causal")
    check(case, max_rows=64 * 12)                        # 6 splits, 2 blocks of rows
    check(case, num_splits=7)


@pytest.mark.interpreter
def test_the_last_split_merges_and_leaves_the_counters_zero_interpreter():
    # one counter buffer shared by calls (a forward's layers), as attend passes it; spare entries untouched
    counters = torch.zeros(3 * 2 + 5, dtype=torch.int32)
    for mode, splits, prefix in (("causal", 3, [0, 37, 130]), ("tree", 4, [90, 3, 61]), ("causal", 7, [5, 200, 64])):
        case = build_case(3, 1 if mode == "causal" else 4, 8, 2, 16, torch.float32, prefix, mode)
        check(case, num_splits=splits, counters=counters)
        assert not counters.any()
    check(case, num_splits=5)                            # the device's shared buffer, left zero too
    assert not _buffers[("attention", case["q"].device)][-1].any()
    with pytest.raises(ValueError, match="counters"):
        run_kernel(case, num_splits=3, counters=torch.zeros(5, dtype=torch.int32))        # too few
    with pytest.raises(ValueError, match="counters"):
        run_kernel(case, num_splits=3, counters=torch.zeros(6, dtype=torch.int64))


def test_rejects_a_tree_over_one_query_tile():
    q = torch.zeros(1, 33, 8, 16)
    kv = torch.zeros(2, 2, 64, 2, 16)
    lens = torch.zeros(1, dtype=torch.int64)
    with pytest.raises(ValueError, match="query rows"):
        slot_attention(q, kv[0], kv[1], lens, lens, 1.0, tree_mask=torch.ones(1, 33, 33, dtype=torch.bool))


def to_pages(kv: torch.Tensor, page: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A static cache [2, S, L, H, D] as a paged pool [2, pages, page, H, D] (pages shuffled, a
    NaN-filled spare page 0) and its page table [S, L / page]."""
    planes, S, L, H, D = kv.shape
    per = -(-L // page)
    padded = torch.full((planes, S, per * page, H, D), float("nan"), dtype=kv.dtype, device=kv.device)
    padded[:, :, :L] = kv
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(S * per, generator=gen) + 1                  # page 0 stays spare
    pool = torch.full((planes, S * per + 1, page, H, D), float("nan"), dtype=kv.dtype, device=kv.device)
    pool[:, order.to(kv.device)] = padded.reshape(planes, S * per, page, H, D)
    return pool, order.view(S, per).to(torch.int32).to(kv.device)


@pytest.mark.parametrize("B,T,Hq,Hkv,prefix,mode,off,page", [
    (3, 1, 8, 2, [0, 37, 130], "causal", 0, 16),          # decode over pages
    (2, 5, 4, 1, [0, 66], "tree", 0, 8),                   # tree verify over pages
    (2, 2, 4, 2, [40, 129], "draft", 4, 16),
    (2, 40, 8, 2, [0, 21], "causal", 0, 16),               # a prefill of 2 query tiles (160 rows)
    (1, 70, 4, 4, [13], "causal", 0, 32),                  # G = 1: 70 rows, one tile
    # pages a whole number of K/V blocks (one page lookup a block), prefixes past a block (no mask)
    (3, 1, 8, 2, [0, 37, 130], "causal", 0, 64),
    (2, 5, 4, 1, [0, 166], "tree", 0, 128),
    (2, 3, 4, 2, [70, 200], "causal", 0, 64),
])
@pytest.mark.interpreter
def test_paged_cache_and_prefill_tiles_interpreter(B, T, Hq, Hkv, prefix, mode, off, page):
    case = build_case(B, T, Hq, Hkv, 16, torch.float32, prefix, mode, write_offset=off)
    want = reference(case)
    pool, table = to_pages(case["kv"], page)
    m = case["meta"]
    got = slot_attention(case["q"], pool[0], pool[1], m.slots, m.prefix_lens, case["scale"], tree_mask=m.tree_mask,
                         write_offset=m.write_offset, positions=m.positions, page_table=table)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    # the torch path reads the same pool through the metadata's page table
    ref_pool, ref_table = to_pages(case["kv_ref"], page)
    paged = AttnMetadata(slots=m.slots, positions=m.positions, prefix_lens=m.prefix_lens, kv_len=m.kv_len,
                         tree_mask=m.tree_mask, write_offset=m.write_offset, page_table=ref_table)
    torch.testing.assert_close(attend(case["q"], ref_pool[0], ref_pool[1], paged, case["scale"]), want,
                               atol=2e-5, rtol=1e-5)


def build_tiled(parts: list[tuple[int, int]], Hq: int, Hkv: int, D: int, dtype: torch.dtype, size: int,
                device: str = "cpu", seed: int = 0) -> dict:
    """A packed prefill: part i brings tokens [a, a + n) of one prompt in its own slot, each token a
    sequence of one new token; tiles of <= size tokens, two spare tiles (count 0) and one pad token
    in no tile at the end. Rows past each part's last token are NaN (as is every unused slot)."""
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    S = len(parts) + 2
    L = max(a + n for a, n in parts) + 9
    kv = torch.randn(2, S, L, Hkv, D).to(dtype)
    slot_of = torch.randperm(S, generator=gen)[:len(parts)]
    poisoned = torch.full_like(kv, float("nan"))
    tok_slots, pos, start, count = [], [], [], []
    for (a, n), slot in zip(parts, slot_of.tolist()):
        poisoned[:, slot, : a + n] = kv[:, slot, : a + n]
        for t0 in range(a, a + n, size):
            start.append(len(pos) + t0 - a)
            count.append(min(size, a + n - t0))
        tok_slots += [slot] * n
        pos += list(range(a, a + n))
    spare = int(torch.ones(S, dtype=torch.bool).scatter(0, slot_of, False).nonzero()[0])
    tok_slots.append(spare)                                 # a pad token, in no tile
    pos.append(0)
    dev = torch.device(device)
    t = lambda x: torch.tensor(x, dtype=torch.int64, device=dev)     # noqa: E731
    positions = t(pos)
    meta = AttnMetadata(slots=t(tok_slots), positions=positions[:, None], prefix_lens=positions,
                        kv_len=max(a + n for a, n in parts))
    tiles = QueryTiles(t(start + [0, 0]), t(count + [0, 0]), size)
    q = torch.randn(len(pos), 1, Hq, D).to(dtype).to(dev)
    return dict(q=q, kv=poisoned.to(dev), kv_ref=kv.to(dev), meta=meta, tiles=tiles, scale=D ** -0.5)


def check_tiled(case: dict, page: int | None = None, order: torch.Tensor | None = None) -> None:
    q, m, tiles = case["q"], case["meta"], case["tiles"]
    N = q.shape[0] - 1                                      # the last token is the pad
    want = attend(q, case["kv_ref"][0], case["kv_ref"][1], m, case["scale"])[:N]     # one token a sequence
    kv, table = (case["kv"], None) if page is None else to_pages(case["kv"], page)
    out = torch.full_like(q, float("nan"))
    got = slot_attention(q, kv[0], kv[1], m.slots, m.prefix_lens, case["scale"], out=out, page_table=table,
                         tile_start=tiles.start, tile_count=tiles.count, tile_size=tiles.size, order=order)
    atol, rtol = TOL[q.dtype]
    torch.testing.assert_close(got[:N].float(), want.float(), atol=atol, rtol=rtol)
    assert got[N].isnan().all()                             # in no tile: not computed
    # the torch path groups by the same tiles and gives what it gives one token at a time
    tiled = dataclasses.replace(m, tiles=tiles)
    got_torch = attend(q, case["kv_ref"][0], case["kv_ref"][1], tiled, case["scale"])
    torch.testing.assert_close(got_torch[:N].float(), want.float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("parts,Hq,Hkv,size,dtype,page", [
    ([(0, 5), (0, 40), (0, 1)], 8, 2, 8, torch.float32, None),           # whole prompts, G = 4
    ([(13, 30), (0, 3)], 4, 2, 16, torch.bfloat16, None),                  # a continued prompt
    ([(0, 21), (7, 9)], 8, 1, 20, torch.float32, None),                    # 160 query rows: two a tile
    ([(0, 37), (64, 10)], 8, 2, 8, torch.float32, 16),                     # paged
    ([(0, 37), (70, 10)], 8, 2, 8, torch.float32, 64),                     # pages of whole blocks
    ([(0, 100), (90, 40)], 8, 2, 32, torch.bfloat16, 64),                  # 128-row tiles, 32-row blocks
])
@pytest.mark.interpreter
def test_query_tiles_give_what_one_token_a_sequence_gives_interpreter(parts, Hq, Hkv, size, dtype, page):
    check_tiled(build_tiled(parts, Hq, Hkv, 16, dtype, size), page)


@pytest.mark.interpreter
def test_query_tiles_in_any_order_interpreter():
    """Tiles started longest first (or in any order) give the same result; the metadata ranks
    a tile by its last sequence's prefix."""
    case = build_tiled([(0, 37), (64, 10), (0, 5)], 8, 2, 16, torch.float32, 8)
    tiles = case["tiles"]
    meta = dataclasses.replace(case["meta"], tiles=tiles)
    last = tiles.start + tiles.count - 1
    rows = meta.program_rows()
    assert rows[tiles.count > 0].tolist() == case["meta"].prefix_lens[last[tiles.count > 0]].tolist()
    order = torch.argsort(-rows, stable=True).to(torch.int32)
    check_tiled(case, order=order)
    check_tiled(case, page=16, order=order.flip(0))


def test_query_tiles_need_one_token_causal_sequences():
    q = torch.zeros(2, 2, 8, 16)
    kv = torch.zeros(2, 2, 64, 2, 16)
    lens = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(ValueError, match="one-token"):
        slot_attention(q, kv[0], kv[1], lens, lens, 1.0, tile_start=lens, tile_count=lens, tile_size=4)


@pytest.mark.interpreter
def test_query_tiles_refuse_a_window_a_tile_could_cross():
    case = build_tiled([(0, 40)], 4, 2, 16, torch.float32, 8)
    m, tiles = case["meta"], case["tiles"]
    kw = dict(positions=m.positions, tile_start=tiles.start, tile_count=tiles.count)
    with pytest.raises(ValueError, match="sliding window 8 not wider"):
        slot_attention(case["q"], case["kv"][0], case["kv"][1], m.slots, m.prefix_lens, 1.0,
                       sliding_window=8, tile_size=8, **kw)
    # a window wider than the tile: what one token a sequence gives
    got = slot_attention(case["q"], case["kv"][0], case["kv"][1], m.slots, m.prefix_lens, case["scale"],
                         sliding_window=9, tile_size=8, **kw)
    want = attend(case["q"], case["kv_ref"][0], case["kv_ref"][1], m, case["scale"], 9)
    torch.testing.assert_close(got[:-1], want[:-1], atol=2e-5, rtol=1e-5)


@pytest.mark.interpreter
@pytest.mark.parametrize("mode,splits", [("causal", 1), ("tree", 1), ("causal", 3), ("draft", 2)])
def test_any_program_order_gives_the_same_result_interpreter(mode, splits):
    case = build_case(6, 2, 4, 2, 16, torch.float32, [10, 100, 250, 0, 64, 33], mode,
                      write_offset=2 if mode == "draft" else 0)
    for order in ([5, 4, 3, 2, 1, 0], [2, 1, 4, 0, 5, 3]):
        check(case, num_splits=splits, order=torch.tensor(order, dtype=torch.int32))


@pytest.mark.interpreter
def test_attend_starts_programs_longest_first_once_a_forward_interpreter(monkeypatch):
    """The kernel path of `attend` finds the order once per metadata (every layer shares it)
    and passes it on; the result is the torch path's."""
    import specbatch.kernels as kernels_pkg
    import specbatch.kernels.attention as kattn
    B = 70                                               # 70 x 2 kv heads: more than one wave
    prefix = torch.randint(0, 90, (B,), generator=torch.Generator().manual_seed(1)).tolist()
    case = build_case(B, 1, 4, 2, 16, torch.float32, prefix, "causal")
    want = reference(case)
    calls, passed = [], []
    real_order, real_attn = kattn.longest_first, kattn.slot_attention

    def order(lengths, heads):
        calls.append(lengths.clone())
        return real_order(lengths, heads)

    def attn(*a, **kw):
        passed.append(kw["order"])
        return real_attn(*a, **kw)

    monkeypatch.setattr(kattn, "longest_first", order)
    monkeypatch.setattr(kattn, "slot_attention", attn)
    monkeypatch.setattr(kernels_pkg, "active", lambda t: True)
    for _ in range(2):                                   # two layers of one forward
        got = attend(case["q"], case["kv"][0], case["kv"][1], case["meta"], case["scale"])
        torch.testing.assert_close(got, want, **dict(zip(("atol", "rtol"), TOL[torch.float32])))
    assert len(calls) == 1 and calls[0].tolist() == prefix
    assert passed[0] is passed[1] and passed[0].tolist() == torch.argsort(-torch.tensor(prefix), stable=True).tolist()


def test_order_needs_one_entry_a_program():
    case = build_case(3, 1, 4, 2, 16, torch.float32, [10, 100, 250], "causal")
    with pytest.raises(ValueError, match="one entry per sequence"):
        run_kernel(case, order=torch.arange(2, dtype=torch.int32))


@pytest.mark.interpreter
@pytest.mark.parametrize("P,heads,top", [(17, 8, 40), (200, 1, 1_000), (300, 8, 4), (129, 2, 0)])
def test_longest_first_interpreter(P, heads, top):
    """Program indices by length, longest first, ties in index order (one block of 128 programs
    or several); None while P x heads programs fit in one wave of an H100's 132 SMs."""
    lengths = torch.randint(0, top + 1, (P,), generator=torch.Generator().manual_seed(P))
    got = longest_first(lengths, heads)
    assert got.dtype == torch.int32
    assert got.tolist() == torch.argsort(-lengths, stable=True).tolist()
    assert longest_first(lengths[:16], 8) is None                # 128 programs: one wave


def test_choose_splits():
    cpu = torch.device("cpu")
    assert choose_splits(512, 4096, 64, cpu) == 1               # batch 64 x 8 kv heads: enough programs
    assert choose_splits(8, 8192, 64, cpu) == 33                # batch 1: ~2 waves of 132 SMs
    assert choose_splits(8, 1024, 64, cpu) == 8                 # >= 2 blocks per split
    assert choose_splits(8, 40, 64, cpu) == 1


# --------------------------------------------------------------------------- GPU

GPU_SHAPES = [(32, 8, 128), (8, 2, 64)]       # (Hq, Hkv, D): Llama-3.1-8B and a small GQA model
GPU_MODES = [("causal", 1, 0), ("causal", 4, 0), ("tree", 8, 0), ("draft", 4, 8)]


def _ragged(B: int, ctx: int, seed: int) -> list[int]:
    if B == 1:
        return [ctx]
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(0, ctx + 1, (B,), generator=g).tolist()
    lens[0], lens[-1] = 0, ctx
    return lens


def _gpu_matrix():
    """(shape, mode, dtype): every mode in bf16 / fp32 at the 8B shape, fp16 for decode and tree,
    bf16 at the small shape (each combination is a compile: keep the count down)."""
    big, small = GPU_SHAPES
    for mode in GPU_MODES:
        for dtype in (torch.bfloat16, torch.float32):
            yield big, mode, dtype
        if mode[0] == "tree" or mode[1] == 1:
            yield big, mode, torch.float16
        yield small, mode, torch.bfloat16


@pytest.mark.gpu
@pytest.mark.parametrize("B", [1, 7, 64])
@pytest.mark.parametrize("shape,mode,dtype", list(_gpu_matrix()), ids=str)
def test_matches_torch_gpu(shape, mode, dtype, B):
    (Hq, Hkv, D), (kind, T, off) = shape, mode
    case = build_case(B, T, Hq, Hkv, D, dtype, _ragged(B, 4096, B + T), kind, write_offset=off,
                      device="cuda", seed=B * 10 + T)
    check(case, max_rows=case["kv"].shape[2])            # the engine's graph-mode bound
    check(case, num_splits=1)
    order = torch.randperm(B, generator=torch.Generator().manual_seed(B)).to("cuda", torch.int32)
    check(case, max_rows=case["kv"].shape[2], order=order)          # programs in any order


@pytest.mark.gpu
def test_longest_first_gpu():
    lengths = torch.randint(0, 3000, (512,), generator=torch.Generator().manual_seed(0)).cuda()
    lengths[::7] = 100                                   # ties
    assert longest_first(lengths, 8).tolist() == torch.argsort(-lengths.cpu(), stable=True).tolist()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=str)
def test_query_tiles_gpu(dtype, shape):
    Hq, Hkv, D = shape
    size = 128 // (Hq // Hkv)
    parts = [(0, 300), (0, 1), (512, 700), (0, 33), (37, 64)]
    case = build_tiled(parts, Hq, Hkv, D, dtype, size, device="cuda", seed=5)
    check_tiled(case)
    check_tiled(case, page=64)
    check_tiled(case, page=64, order=torch.arange(case["tiles"].start.shape[0] - 1, -1, -1,
                                                  device="cuda", dtype=torch.int32))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_sliding_window_gpu(dtype):
    case = build_case(7, 4, 32, 8, 128, dtype, _ragged(7, 4096, 3), "causal", device="cuda")
    check(case, window=1024, max_rows=case["kv"].shape[2])


@pytest.mark.gpu
@pytest.mark.parametrize("mode,T,off", [("causal", 4, 0), ("tree", 8, 0)], ids=lambda x: str(x))
def test_cuda_graph_replay_with_new_lengths(mode, T, off):
    B, ctx = 7, 4096
    case = build_case(B, T, 32, 8, 128, torch.bfloat16, [ctx] * B, mode, write_offset=off, device="cuda")
    m = case["meta"]
    L = case["kv"].shape[2]
    case["kv"] = case["kv_ref"]                          # lengths change: no fixed NaN pattern
    out = torch.full_like(case["q"], float("nan"))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):                      # compile outside the capture
        run_kernel(case, out=out, max_rows=L)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run_kernel(case, out=out, max_rows=L)
    for lens in [_ragged(B, ctx, 1), [1, 2, 3, 64, 65, 129, 0], _ragged(B, ctx // 8, 2)]:
        new = torch.tensor(lens, device="cuda")
        m.prefix_lens.copy_(new)                         # in place, as the engine does
        m.kv_len = max(lens) + (T if mode == "tree" else off + T)
        case["q"].copy_(torch.randn_like(case["q"]))
        out.fill_(float("nan"))
        graph.replay()
        torch.testing.assert_close(out.float(), reference(case).float(), atol=2e-2, rtol=2e-2)
