"""Sampling parameters and batch-invariant seeded sampling.

Randomness is counter-based: the uniform used for vocabulary entry v of the token at sequence
position p of a request with seed s is a hash of (s, p, salt, v). A request therefore samples
the same tokens whatever else shares its batch, on CPU or GPU, after a resume, and the whole
computation is fixed-shape tensor arithmetic (no per-row torch.Generator), so it can be
captured in a CUDA graph. Ints stay below 2**63 at every step, so no signed overflow.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import kernels
from .host import to_device
from .params import SamplingParams

FLOAT32_MAX = float(torch.finfo(torch.float32).max)

_MASK32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, m: int) -> torch.Tensor:
    """(x * m) mod 2**32 for 0 <= x < 2**32, with every intermediate < 2**49."""
    lo, hi = m & 0xFFFF, m >> 16
    return (x * lo + ((x * hi) & 0xFFFF) * 65536) & _MASK32


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit avalanche hash (lowbias32) on int64 tensors holding values in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def split_seed(seed: int) -> tuple[int, int]:
    """Any Python int -> two 32-bit halves (low, high) of its value mod 2**64."""
    s = seed % (1 << 64)
    return s & _MASK32, s >> 32


def row_keys(seed_lo: torch.Tensor, seed_hi: torch.Tensor, positions: torch.Tensor,
             salt: int = 0) -> torch.Tensor:
    """[R] per-row hash keys of (seed, position, salt); positions < 2**32."""
    k = mix32(seed_lo ^ mix32(seed_hi ^ mix32((positions & _MASK32) ^ mix32(torch.full_like(positions, salt)))))
    return k


def uniforms(keys: torch.Tensor, width: int) -> torch.Tensor:
    """keys [R] -> uniforms [R, width] in (0, 1), float32, one per vocabulary entry."""
    v = mix32(torch.arange(width, device=keys.device, dtype=torch.int64) ^ 0x9E3779B9)
    x = mix32(keys[:, None] ^ v[None, :])
    # 23 bits: (k + 0.5) / 2**23 is exact in float32, so u stays strictly inside (0, 1)
    # (24 bits would round the top value up to 1.0, making -log(u) zero).
    return ((x >> 9).float() + 0.5) * (1.0 / (1 << 23))


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """logits [R, V] (after temperature) with per-row min_p [R] (0 = off) -> tokens whose
    probability is below min_p times the top token's masked (vLLM's min-p: before top-k/top-p)."""
    probs = logits.softmax(dim=-1)
    keep_from = min_p[:, None] * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(probs < keep_from, float("-inf"))


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                      any_top_k: bool = True) -> torch.Tensor:
    """logits [R, V] with per-row top_k [R] (0 = off) then top_p [R] (1 = off) -> masked logits.
    Ties are ordered by index (a stable sort), so which of equal logits a filter keeps is fixed.
    `any_top_k` false: no row uses top-k (a host fact that spares the kernels a torch.topk)."""
    if kernels.active(logits):                  # the same prefixes without a sort (kernels/top_k_top_p.py)
        from .kernels.top_k_top_p import top_k_top_p

        return top_k_top_p(logits, top_k, top_p, find_kth=any_top_k)
    V = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)
    rank = torch.arange(V, device=logits.device)
    drop = (top_k[:, None] > 0) & (rank[None, :] >= top_k[:, None])
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    # Keep the smallest prefix whose mass reaches top_p (the top token always stays).
    drop = ((probs.cumsum(dim=-1) - probs) >= top_p[:, None]) & (top_p < 1.0)[:, None]
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def host_flags(params: list[SamplingParams]) -> tuple[bool, bool, bool, bool]:
    """What a batch's rows (resolved params) ask of sampling, known on the host: (all greedy, some
    sampled row filters (min-p / top-k / top-p), some uses top-k, some uses min-p). BatchSampling
    carries them; a graph variant is keyed by them (engine/cycle.py)."""
    sampled = [p for p in params if not p.greedy]
    return (not sampled, any(p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0 for p in sampled),
            any(p.top_k > 0 for p in sampled), any(p.min_p > 0 for p in sampled))


@dataclass
class BatchSampling:
    """Per-row sampling parameters of a batch, as tensors on the model's device."""
    temperature: torch.Tensor   # [R] float32
    top_k: torch.Tensor         # [R] int64
    top_p: torch.Tensor         # [R] float32
    seed_lo: torch.Tensor       # [R] int64
    seed_hi: torch.Tensor       # [R] int64
    all_greedy: bool
    any_filter: bool            # some row uses min-p, top-k or top-p
    any_top_k: bool = True      # some row may use top-k (False: none does; the draws skip finding the k-th logit)
    min_p: torch.Tensor | None = None   # [R] float32 (None: no sampled row uses min-p: no pass for it)
    # [R] bool: rows that draw from the distribution as built, because they report its logprobs
    # (a processed logprobs mode; draw_target). None: no such row.
    built: torch.Tensor | None = None

    ROWS = ("temperature", "top_k", "top_p", "seed_lo", "seed_hi")      # the [R] tensors every batch has

    @classmethod
    def build(cls, params: list[SamplingParams], device: torch.device,
              processed_logprobs: bool = False) -> "BatchSampling":
        """`processed_logprobs`: the engine reports logprobs of the processed distribution."""
        params = [p.resolved() for p in params]          # unset fields: their defaults
        asked = [p.logprobs is not None for p in params]
        lo, hi = zip(*(split_seed(p.seed or 0) for p in params)) if params else ((), ())
        all_greedy, any_filter, any_top_k, any_min_p = host_flags(params)
        return cls(
            # a temperature past float32's range would be inf, and -inf / inf (a masked token) NaN
            temperature=to_device([min(p.temperature, FLOAT32_MAX) for p in params], torch.float32, device),
            top_k=to_device([p.top_k for p in params], torch.int64, device),
            top_p=to_device([p.top_p for p in params], torch.float32, device),
            seed_lo=to_device(lo, torch.int64, device),
            seed_hi=to_device(hi, torch.int64, device),
            all_greedy=all_greedy, any_filter=any_filter, any_top_k=any_top_k,
            min_p=to_device([float(p.min_p) for p in params], torch.float32, device) if any_min_p else None,
            built=to_device(asked, torch.bool, device) if processed_logprobs and any(asked) else None,
        )

    def repeat_rows(self, n: int) -> "BatchSampling":
        """Each row repeated n times (row-major), for n tokens per sequence."""
        r = lambda t: None if t is None else t.repeat_interleave(n)
        return BatchSampling(r(self.temperature), r(self.top_k), r(self.top_p), r(self.seed_lo),
                             r(self.seed_hi), self.all_greedy, self.any_filter, self.any_top_k, r(self.min_p),
                             r(self.built))

    def temperature_or_1(self) -> torch.Tensor:
        """[R] float32: the temperature logits are divided by (greedy rows: 1)."""
        return torch.where(self.temperature > 0, self.temperature, torch.ones_like(self.temperature))

    def scaled(self, logits: torch.Tensor) -> torch.Tensor:
        """Temperature (greedy rows: 1), then min-p: what top-k and top-p filter."""
        scaled = logits / self.temperature_or_1()[:, None]
        if self.any_filter and self.min_p is not None:
            scaled = apply_min_p(scaled, self.min_p)
        return scaled

    def _filtered(self, logits: torch.Tensor) -> torch.Tensor:
        """Temperature (greedy rows: 1), then min-p, top-k, top-p: vLLM's order."""
        scaled = self.scaled(logits)
        if self.any_filter:
            scaled = apply_top_k_top_p(scaled, self.top_k, self.top_p, self.any_top_k)
        return scaled

    def target_probs(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [R, V] float32 -> the distribution sampling draws from (temperature, min-p,
        top-k, top-p)."""
        return self._filtered(logits).softmax(dim=-1)

    def target_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [R, V] float32 -> what sampling draws from, before the softmax: sampled rows
        after temperature and the filters (removed tokens -inf), greedy rows as they are."""
        if self.all_greedy:
            return logits
        return torch.where((self.temperature > 0)[:, None], self._filtered(logits), logits)

    def target_logprobs(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [R, V] float32 -> log-probabilities of the distribution each row's token came
        from: sampled rows the one they draw from (after temperature and the filters), greedy rows
        log_softmax of the logits (vLLM's processed logprobs; temperature 0 has no distribution).
        Filtered-out tokens are -inf."""
        return self.target_logits(logits).log_softmax(dim=-1)


def sample(logits: torch.Tensor, sp: BatchSampling, positions: torch.Tensor) -> torch.Tensor:
    """logits [R, V] (any float dtype: sampling works in float32) -> tokens [R]: argmax for greedy
    rows, seeded draws for the others.

    `positions` [R] is the sequence position the sampled token will occupy (its RNG counter).
    """
    greedy = logits.argmax(dim=-1)
    if sp.all_greedy:
        return greedy
    return torch.where(sp.temperature > 0, draw_target(logits, sp, positions), greedy)


def target_wide(logits: torch.Tensor, ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """logits [R, V] of vocabulary columns ids [V] -> [R, vocab], -inf at every other column."""
    return logits.new_full((logits.shape[0], vocab), float("-inf")).index_copy_(1, ids, logits)


def draw_target(logits: torch.Tensor, sp: BatchSampling, positions: torch.Tensor,
                ids: torch.Tensor | None = None, vocab: int = 0) -> torch.Tensor:
    """logits [R, V] (any float dtype) -> one token per row drawn from its target distribution (temperature,
    min-p, top-k, top-p), seeded by (seed, position); greedy rows' tokens are meaningless.
    On GPU the filters and the race are one kernel that never builds the filtered distribution.
    `ids` [V] int64, strictly increasing: the logits are those columns of a `vocab`-wide row whose
    other entries are -inf (a draft head's vocabulary in the target's); tokens are vocabulary ids."""
    if ids is not None and (sp.built is not None or not kernels.active(logits)):
        logits, ids = target_wide(logits, ids, vocab), None
    if kernels.active(logits):
        from .kernels.filtered_draw import draw_filtered

        on = sp.any_filter & (sp.temperature > 0)            # greedy rows: no filtering work
        top_k = torch.where(on, sp.top_k, 0)
        top_p = torch.where(on, sp.top_p, 1.0)
        keys = row_keys(sp.seed_lo, sp.seed_hi, positions)
        if sp.min_p is None:            # the kernel scales the logits as it reads them (bf16 as they are)
            tokens = draw_filtered(logits, top_k, top_p, keys, sp.temperature_or_1(), find_kth=sp.any_top_k, ids=ids)
        else:                           # min-p needs the whole scaled row first
            tokens = draw_filtered(sp.scaled(logits.float()), top_k, top_p, keys, find_kth=sp.any_top_k, ids=ids)
        if sp.built is None:
            return tokens
        # rows reporting processed logprobs: a token at the top_p boundary, where the kernels' float32
        # masses may round apart, must be one the distribution they report keeps
        return torch.where(sp.built, draw(sp.target_probs(logits.float()), sp, positions), tokens)
    return draw(sp.target_probs(logits.float()), sp, positions)


def draw(probs: torch.Tensor, sp: BatchSampling, positions: torch.Tensor) -> torch.Tensor:
    """probs [R, V] (need not sum to 1) -> one token per row, seeded by (seed, position).

    Exponential race: argmax p_v / E_v with E_v ~ Exp(1) picks v with probability proportional
    to p_v; entries with p_v = 0 never win.
    """
    keys = row_keys(sp.seed_lo, sp.seed_hi, positions)
    if kernels.active(probs):                   # the same race in one read, no [R, V] hashes (kernels/draw.py)
        from .kernels.draw import draw_race

        return draw_race(probs, keys)
    u = uniforms(keys, probs.shape[-1])
    return (probs / -torch.log(u)).argmax(dim=-1)
