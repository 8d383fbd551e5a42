"""The engine: owns the target, the KV cache and the drafter, and runs the speculative cycle.

    rows -> requests -> scheduler slots -> prefill -> cycle* -> records
    cycle: propose -> verify -> accept -> commit -> extend
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch

from .data import RowError, RowRequest
from .models.attention import AttnMetadata
from .models.config import generation_eos_ids
from .models.loader import load_target
from .prompts import PromptError, encode_row, load_tokenizer
from .recipe import SamplingDefaults
from .request import Request, StopChecker
from .runtime.kv_cache import KVCache, compact_path, plan_max_len
from .sampling import BatchSampling, SamplingParams, sample
from .scheduler import SlotScheduler
from .spec.accept import accept
from .spec.drafter import Drafter
from .spec.factory import SpecConfig, make_drafter
from .stats import error_record, spec_stats

Slotted = list[tuple[int, Request]]


@dataclass
class EngineOptions:
    batch_size: int = 64
    max_model_len: int | None = None
    dtype: str = "auto"
    device: str | None = None            # None: cuda when available, else cpu
    bucket_window: int = 0               # > 0: admit similar prompt lengths together
    prefill_tokens: int = 8192           # padded tokens per prefill forward
    spec: SpecConfig = SpecConfig()      # the drafter (vanilla: none)


def resolve_device(name: str | None) -> torch.device:
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available (use --device cpu)")
    return dev


class Engine:
    def __init__(self, model_dir: str | Path, opts: EngineOptions | None = None,
                 drafter: Drafter | None = None):
        """`drafter` replaces the one `opts.spec` describes (tests plug in their own)."""
        self.opts = opts = opts or EngineOptions()
        self.device = resolve_device(opts.device)
        self.model, _ = load_target(model_dir, opts.dtype, self.device)
        self.cfg = self.model.cfg
        self.dtype = self.model.lm_head.weight.dtype
        self.tokenizer = load_tokenizer(model_dir)
        eos = generation_eos_ids(model_dir) or self.cfg.eos_token_ids
        if not eos and self.tokenizer.eos_token_id is not None:
            eos = (self.tokenizer.eos_token_id,)
        self.eos_ids = set(eos)
        self.num_slots = opts.batch_size
        width = drafter.num_draft_tokens if drafter else opts.spec.width
        self.max_len = plan_max_len(self.cfg, self.num_slots, self.dtype, self.device,
                                    opts.max_model_len, headroom=width)
        # Verify writes up to N-1 rows past the committed length: that headroom is allocated too.
        self.cache = KVCache(self.cfg, self.num_slots, self.max_len + width, self.dtype, self.device)
        self.drafter = drafter or make_drafter(opts.spec, self.model, self.num_slots, self.max_len)
        self.stops = StopChecker(self.tokenizer, self.eos_ids)
        self.seq_lens = [0] * (self.num_slots + 1)     # committed cache rows per slot
        self.last_token = [0] * (self.num_slots + 1)   # emitted, not yet in the cache
        self.tokens_emitted = 0
        self.target_forwards = 0                        # batched target forward calls

    # ---- rows -> requests -------------------------------------------------------------------

    def make_request(self, item: RowRequest | RowError, defaults: SamplingDefaults) -> Request | dict:
        """A Request ready to schedule, or an error record for a row that cannot run."""
        if isinstance(item, RowError):
            return error_record(item.row, item.id, item.error, item.keep)
        try:
            ids = encode_row(self.tokenizer, item, self.cfg.vocab_size)
        except PromptError as e:
            return error_record(item.row, item.id, str(e), item.keep)
        where = item.where or f"row {item.row}"
        if len(ids) >= self.max_len:
            return error_record(item.row, item.id,
                                f"{where}: prompt has {len(ids)} tokens but the context per slot is "
                                f"{self.max_len} (set --max-model-len or lower --batch-size)",
                                item.keep, prompt_tokens=len(ids))
        params = _params(defaults, item.overrides, item.row)
        return Request(row=item.row, id=item.id, prompt_ids=ids, params=params,
                       max_new=min(params.max_tokens, self.max_len - len(ids)), keep=item.keep)

    def record(self, req: Request) -> dict[str, Any]:
        return {
            "row": req.row, "id": req.id, "completion": self.stops.completion_text(req),
            "prompt_tokens": len(req.prompt_ids), "completion_tokens": len(req.output_ids),
            "finish_reason": req.finish_reason, "error": None, "spec": spec_stats(req),
            "output_token_ids": list(req.output_ids), **req.keep,
        }

    # ---- the job loop -----------------------------------------------------------------------

    @torch.inference_mode()
    def generate(self, items: Iterable[RowRequest | RowError],
                 defaults: SamplingDefaults = SamplingDefaults()) -> Iterator[dict[str, Any]]:
        """Yield one record per input row, in completion order, streaming the input."""
        sched: SlotScheduler[Request] = SlotScheduler(self.num_slots, bucket_window=self.opts.bucket_window)
        source = iter(items)
        lookahead = max(2 * self.num_slots, self.opts.bucket_window)
        exhausted = False
        while True:
            while not exhausted and sched.queued() < lookahead:
                item = next(source, None)
                if item is None:
                    exhausted = True
                    break
                req = self.make_request(item, defaults)
                if isinstance(req, dict):
                    yield req
                else:
                    sched.add(req)
            admitted = sched.admit()
            if admitted:
                yield from self._release(sched, self._prefill(admitted))
            active = sched.active()
            if not active:
                if exhausted and sched.queued() == 0:
                    return
                continue
            yield from self._release(sched, self.cycle(active))

    def _release(self, sched: SlotScheduler, finished: Slotted) -> Iterator[dict[str, Any]]:
        for slot, req in finished:
            sched.release(slot)
            yield self.record(req)

    # ---- prefill ------------------------------------------------------------------------------

    def _prefill(self, admitted: Slotted) -> Slotted:
        finished: Slotted = []
        for group in _prefill_groups(admitted, self.opts.prefill_tokens):
            lens = [len(r.prompt_ids) for _, r in group]
            B, T = len(group), max(lens)
            ids = torch.zeros(B, T, dtype=torch.int64)
            for i, (_, r) in enumerate(group):
                ids[i, : lens[i]] = torch.tensor(r.prompt_ids)
            ids = ids.to(self.device)
            slots = self._tensor([s for s, _ in group])
            lengths = self._tensor(lens)
            meta = AttnMetadata(slots=slots, positions=torch.arange(T, device=self.device).expand(B, T),
                                prefix_lens=torch.zeros_like(slots), kv_len=T)
            hidden, captured = self.model(ids, meta, self.cache.layers, self.drafter.capture_layers)
            self.target_forwards += 1
            last = hidden[torch.arange(B, device=self.device), lengths - 1]          # [B, H]
            sp = BatchSampling.build([r.params for _, r in group], self.device)
            first = sample(self.model.logits(last), sp, lengths)
            self.drafter.prefill(slots, ids, lengths, captured, first)
            for (slot, req), tok, n in zip(group, first.tolist(), lens):
                self.seq_lens[slot], self.last_token[slot] = n, tok
                req.histogram = [0] * (self.drafter.max_depth + 1)
                req.verify_steps = 1                 # the prefill: a forward that verified no drafts
                self.tokens_emitted += self.stops.append(req, [tok])
                if req.finished:
                    finished.append((slot, req))
        return finished

    # ---- the speculative cycle ----------------------------------------------------------------

    def cycle(self, active: Slotted) -> Slotted:
        """One propose -> verify -> accept -> commit -> extend step over the active slots."""
        slots = self._tensor([s for s, _ in active])
        lens = self._tensor([self.seq_lens[s] for s, _ in active])
        last = self._tensor([self.last_token[s] for s, _ in active])
        sp = BatchSampling.build([r.params for _, r in active], self.device)

        # propose: a tree of N nodes per slot, the root being the last emitted token
        prop = self.drafter.propose(slots, last, lens)
        N = prop.width

        # verify: one target forward over every node (tree mask, positions = length + depth)
        meta = AttnMetadata(slots=slots, positions=lens[:, None] + prop.depths, prefix_lens=lens,
                            kv_len=int(max(self.seq_lens[s] for s, _ in active)) + N,
                            tree_mask=prop.tree_mask)
        hidden, captured = self.model(prop.tokens, meta, self.cache.layers, self.drafter.capture_layers)
        self.target_forwards += 1
        logits = self.model.logits(hidden)                                       # [B, N, V]

        # accept: walk the tree with the target's distribution at each node
        acc = accept(prop.tokens, prop.parents, logits, sp, lens, self.drafter.max_depth)
        emitted, counts = acc.tokens.tolist(), acc.num.tolist()                  # the host copy of the results

        # commit: root + accepted drafts become cache rows (a tree's path is made contiguous);
        # the last emitted token is the next root
        if prop.tree_mask is not None:
            compact_path(self.cache.data, slots, lens, acc.path, acc.num)
        finished: Slotted = []
        for (slot, req), toks, n in zip(active, emitted, counts):
            self.seq_lens[slot] += n
            self.last_token[slot] = toks[n - 1]
            self.tokens_emitted += self.stops.append(req, toks[:n])
            req.verify_steps += 1
            req.draft_tokens += N - 1
            req.accepted_tokens += n - 1
            req.histogram[n - 1] += 1
            if req.finished:
                finished.append((slot, req))

        # extend: the drafter catches up on the accepted tokens with the target's states
        self.drafter.extend(slots, lens, acc, captured)
        return finished

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.device)


def _params(d: SamplingDefaults, o: dict[str, Any], row: int) -> SamplingParams:
    seed = o.get("seed")
    if seed is None:
        # From the run seed (--seed, default 0) and the row: reruns and resumes draw the same tokens.
        run_seed = d.seed or 0
        seed = ((run_seed * 0x9E3779B97F4A7C15) ^ (row * 0xBF58476D1CE4E5B9)) % (1 << 64)
    return SamplingParams(
        max_tokens=o.get("max_tokens", d.max_tokens),
        temperature=float(o.get("temperature", d.temperature)),
        top_p=float(o.get("top_p", d.top_p)),
        top_k=int(o.get("top_k", d.top_k)),
        seed=int(seed),
        stop=tuple(o.get("stop", d.stop)),
        stop_token_ids=tuple(o.get("stop_token_ids", d.stop_token_ids)),
        ignore_eos=bool(o.get("ignore_eos", d.ignore_eos)),
    )


def _prefill_groups(admitted: Slotted, budget: int) -> list[Slotted]:
    """Split by prompt length so each padded prefill forward stays within `budget` tokens."""
    groups: list[Slotted] = []
    for item in sorted(admitted, key=lambda sr: len(sr[1].prompt_ids)):
        if groups and len(item[1].prompt_ids) * (len(groups[-1]) + 1) <= budget:
            groups[-1].append(item)
        else:
            groups.append([item])
    return groups
