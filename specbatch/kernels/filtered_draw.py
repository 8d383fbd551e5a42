"""A seeded draw from the top-k / top-p filtered distribution without building it: the token of
`draw(softmax(apply_top_k_top_p(x, top_k, top_p)))` (specbatch.sampling), for rows that need
only the token (plain sampling: no drafts to accept, no logprobs).

The race draws argmax e_v / E_v over the kept entries (e_v = exp(x_v - max), E_v the seeded
exponential of kernels/draw.py). Both filters keep a prefix of the order (logit desc, index asc),
so a token is kept iff the mass of the entries before it is below top_p times the mass of the
top-k set (the top entry always stays). Hence: race over the top-k set; if the winner is not
kept, every entry after it is dropped too, so race again over the entries before it; repeat.
A winner is kept with probability about top_p, and each rejection leaves a random share of the
entries, so a row takes about two reads of its logits more than the plain draw. The top-k set,
where a row has one, is bounded by its k-th largest logit from torch.topk (k up to KCAP), else by
the radix descent of kernels/top_k_top_p.py.

A row whose whole top-k set (every entry at or above its k-th largest, ties included) lies among
the KCAP largest that torch.topk returned reads nothing more: the race, the masses and the
rejections run over those candidates alone (the seeded exponential belongs to the vocabulary
index, so the winner is the full read's). That is every top-k row but those whose ties at the
k-th logit reach past the KCAP-th (or whose k is KCAP), and rows whose max is not finite: those
read their row.

Differences from the reference are rounding only: the mass comparison at the top-p boundary (as
in kernels/top_k_top_p.py), and the race compares e_v / E_v where the reference divides the
normalised probability, so two entries within an ulp of each other may trade places.

The logits are read in their own dtype and divided by the row's temperature as they load (IEEE
division: the floats of torch's `logits.float() / t`), so no scaled float32 copy is made.

Layout: one program a row (the rejections are data-dependent), reading it in blocks of BLOCK.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import INTERPRET, libm
from .draw import first_max, keep_first_max, race_weight
from .top_k_top_p import _in_prefix, _keys, _load, _top_k_bound, top_candidates

BLOCK = 2048          # H100, 512 rows: 1024 -> 2048 took top-p draws 1.57 -> 1.04 ms; 4096 spills on float32
NUM_WARPS = 8


@triton.jit
def _vocab_id(ids_ptr, o, m, HAS_IDS: tl.constexpr):
    """Columns o's vocabulary indices: ids[o] for a compact row, else o itself."""
    if HAS_IDS:
        return tl.load(ids_ptr + o, mask=m, other=0).to(tl.int32)
    return o


@triton.jit
def _race(base, V, t, M, rkey, bound_key, bound_ties, ids_ptr, HAS_IDS: tl.constexpr, PRECISE: tl.constexpr,
          BLOCK: tl.constexpr):
    """The race winner among the allowed entries (key > bound_key, or key == bound_key among the
    first bound_ties in index order) and the allowed entries' mass."""
    lane = tl.arange(0, BLOCK)
    best = tl.full([BLOCK], -1.0, tl.float32)
    at = tl.zeros([BLOCK], tl.int32)
    z = tl.zeros([BLOCK], tl.float32)
    seen = tl.full([], 0, tl.int32)
    for start in range(0, V, BLOCK):
        o = start + lane
        m = o < V
        x = _load(base, o, m, t)
        ok, seen = _in_prefix(_keys(x), m, bound_key, bound_ties, seen)
        e = libm.exp(x - M, PRECISE)
        z += tl.where(ok, e, 0.0)
        w = race_weight(e, rkey, _vocab_id(ids_ptr, o, m, HAS_IDS), PRECISE)
        best, at = keep_first_max(best, at, tl.where(ok, w, -1.0), o)
    return first_max(best, at)[1], tl.sum(z, axis=0)


@triton.jit
def _before(base, V, t, M, c, PRECISE: tl.constexpr, BLOCK: tl.constexpr):
    """Entry c's key, the mass and count of the entries before it (logit desc, index asc) and
    its rank among the entries of its key."""
    lane = tl.arange(0, BLOCK)
    kc = _keys(_load(base, c, True, t))
    a = tl.zeros([BLOCK], tl.float32)
    n = tl.zeros([BLOCK], tl.int32)
    r = tl.zeros([BLOCK], tl.int32)
    for start in range(0, V, BLOCK):
        o = start + lane
        m = o < V
        x = _load(base, o, m, t)
        key = _keys(x)
        tie_before = m & (key == kc) & (o < c)
        pre = (m & (key > kc)) | tie_before
        a += tl.where(pre, libm.exp(x - M, PRECISE), 0.0)
        n += pre.to(tl.int32)
        r += tie_before.to(tl.int32)
    return kc, tl.sum(a, axis=0), tl.sum(n, axis=0), tl.sum(r, axis=0)


@triton.jit
def _winner(w, ok, o):
    """The lowest index o holding the largest race weight w among the ok entries."""
    s = tl.where(ok, w, -1.0)
    top = tl.max(s, axis=0)
    return tl.min(tl.where(ok & (s == top), o, 2147483647), axis=0)


@triton.jit
def _before_among(key, o, m, c):
    """Among candidates (keys, indices o, valid m): the entries before index c (logit desc,
    index asc)."""
    kc = tl.max(tl.where(m & (o == c), key, tl.zeros_like(key)), axis=0)
    return m & ((key > kc) | ((key == kc) & (o < c)))


@triton.jit
def _candidates_draw(vbase, ibase, KC, t, k, T, p, rkey, ids_ptr, HAS_IDS: tl.constexpr, PRECISE: tl.constexpr,
                     KB: tl.constexpr):
    """The draw of a row whose top-k set (key > T, or key == T among the first k - #above in
    index order) lies among its KC largest entries: values at vbase, vocabulary indices at ibase."""
    lane = tl.arange(0, KB)
    m = lane < KC
    x = tl.math.div_rn(tl.load(vbase + lane, mask=m, other=float("-inf")).to(tl.float32), t)
    o = tl.load(ibase + lane, mask=m, other=2147483647).to(tl.int32)
    key = _keys(x)
    e = libm.exp(x - tl.max(x, axis=0), PRECISE)
    w = race_weight(e, rkey, _vocab_id(ids_ptr, o, m, HAS_IDS), PRECISE)
    at_T = m & (key == T)
    ties = k - tl.sum((m & (key > T)).to(tl.int32), axis=0)
    rank = tl.sum((at_T[None, :] & (o[None, :] < o[:, None])).to(tl.int32), axis=1)   # among the T entries
    ok = m & ((key > T) | (at_T & (rank < ties)))
    Z = tl.sum(tl.where(ok, e, 0.0), axis=0)
    c = _winner(w, ok, o)
    if p < 1.0:
        before = _before_among(key, o, m, c)
        a = tl.sum(tl.where(before, e, 0.0), axis=0)
        n = tl.sum(before.to(tl.int32), axis=0)
        while (a >= p * Z) & (n > 0):                   # c dropped, and so is every entry after it
            c = _winner(w, before, o)
            before = _before_among(key, o, m, c)
            a = tl.sum(tl.where(before, e, 0.0), axis=0)
            n = tl.sum(before.to(tl.int32), axis=0)
    return c


@triton.jit
def _filtered_draw_kernel(x_ptr, stride_x, t_ptr, top_k_ptr, top_p_ptr, kth_ptr, vals_ptr, idx_ptr, KC,
                          keys_ptr, ids_ptr, out_ptr, V, HAS_IDS: tl.constexpr, BLOCK: tl.constexpr,
                          PRECISE: tl.constexpr, KB: tl.constexpr):
    row = tl.program_id(0)
    base = x_ptr + row.to(tl.int64) * stride_x
    t = tl.load(t_ptr + row).to(tl.float32)
    k = tl.load(top_k_ptr + row).to(tl.int32)
    p = tl.load(top_p_ptr + row).to(tl.float32)
    rkey = tl.load(keys_ptr + row).to(tl.uint32)       # the row key's low 32 bits (all it holds)
    kth = tl.load(kth_ptr + row)
    # the candidates hold the top-k set when the smallest of them is below its k-th (or they are all V)
    T = tl.max(_keys(tl.math.div_rn(kth, t)), axis=0)                  # _keys gives shape [1]
    cand = row.to(tl.int64) * KC
    last = tl.max(_keys(tl.math.div_rn(tl.load(vals_ptr + cand + KC - 1).to(tl.float32), t)), axis=0)
    # and its max is finite: a row of -inf (or one holding NaN or +inf) has no race winner among the
    # candidates (every weight NaN: token 2**31 - 1), where the full read's lanes give index 0, as torch
    top = tl.load(vals_ptr + cand).to(tl.float32)
    if (k > 0) & (k < V) & (kth == kth) & ((last < T) | (KC >= V)) & (top > float("-inf")) & (top < float("inf")):
        c = _candidates_draw(vals_ptr + cand, idx_ptr + cand, KC, t, k, T, p, rkey, ids_ptr, HAS_IDS, PRECISE, KB)
    else:
        # allowed: key > bound_key, or key == bound_key among the first bound_ties (every key is > 0)
        M, bound_key, bound_ties = _top_k_bound(base, V, t, k, kth, PRECISE, BLOCK)
        c, Z = _race(base, V, t, M, rkey, bound_key, bound_ties, ids_ptr, HAS_IDS, PRECISE, BLOCK)
        if p < 1.0:
            kc, a, n, r = _before(base, V, t, M, c, PRECISE, BLOCK)
            while (a >= p * Z) & (n > 0):               # c dropped, and so is every entry after it
                c, _ = _race(base, V, t, M, rkey, kc, r, ids_ptr, HAS_IDS, PRECISE, BLOCK)
                kc, a, n, r = _before(base, V, t, M, c, PRECISE, BLOCK)
    if HAS_IDS:
        c = tl.load(ids_ptr + c).to(tl.int32)
    tl.store(out_ptr + row, c.to(tl.int64))


def draw_filtered(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, keys: torch.Tensor,
                  temperature: torch.Tensor | None = None, find_kth: bool = True,
                  ids: torch.Tensor | None = None) -> torch.Tensor:
    """logits [R, V] (any float dtype; after min-p, if a row uses it), per-row top_k [R] (0 =
    off) and top_p [R] (1 = off), keys [R] int64 row keys (sampling.row_keys), temperature [R]
    (> 0; None: the logits are already scaled) -> tokens [R] int64: the race over the filtered
    distribution of logits.float() / temperature, read in place. Graph-capturable. `find_kth`:
    kth_largest's `find` (false when no row uses top-k). `ids` [V] int64, strictly increasing: the
    logits are the columns ids of a larger vocabulary whose other entries are -inf (a draft head's
    own vocabulary): the same draw as over that layout (the race's uniforms go by vocabulary
    index; index order is column order), returned as vocabulary indices, reading V columns."""
    x = logits if logits.stride(-1) == 1 else logits.contiguous()
    R, V = x.shape
    t = torch.ones(R, dtype=torch.float32, device=x.device) if temperature is None else temperature.float()
    out = torch.empty(R, dtype=torch.int64, device=x.device)
    if R:
        kth, vals, idx = top_candidates(x, top_k, find_kth)
        KC = vals.shape[1]
        _filtered_draw_kernel[(R,)](x, x.stride(0), t.contiguous(), top_k.contiguous(), top_p.contiguous(),
                                    kth, vals.contiguous(), idx.contiguous(), KC, keys.contiguous(),
                                    out if ids is None else ids.contiguous(), out, V, HAS_IDS=ids is not None,
                                    BLOCK=BLOCK, PRECISE=not INTERPRET, KB=triton.next_power_of_2(KC),
                                    num_warps=NUM_WARPS)
    return out
