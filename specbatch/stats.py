"""Per-request records and run totals, as plain data."""
from __future__ import annotations

import resource
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from .records import emitted_tokens
from .request import Request


def spec_stats(req: Request) -> dict[str, Any]:
    steps = req.verify_steps
    return {
        "verify_steps": steps,
        "draft_tokens": req.draft_tokens,
        "accepted_tokens": req.accepted_tokens,
        "accept_length": len(req.output_ids) / steps if steps else 0.0,
        "accept_histogram": list(req.histogram),
    }


def combined_spec_stats(reqs: list[Request]) -> dict[str, Any]:
    """The stats of a row's n choices together: what its requests ran (sums; accept_length over
    all their tokens and steps)."""
    steps = sum(r.verify_steps for r in reqs)
    width = max(len(r.histogram) for r in reqs)
    return {
        "verify_steps": steps,
        "draft_tokens": sum(r.draft_tokens for r in reqs),
        "accepted_tokens": sum(r.accepted_tokens for r in reqs),
        "accept_length": sum(len(r.output_ids) for r in reqs) / steps if steps else 0.0,
        "accept_histogram": [sum(r.histogram[i] for r in reqs if i < len(r.histogram)) for i in range(width)],
    }


@dataclass
class RunStats:
    """Totals over the records a run produced (resumed rows are not counted again)."""
    requests: int = 0
    errors: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    verify_steps: int = 0
    generated_tokens: int = 0         # tokens the requests emitted (a greedy row's n choices run once)
    draft_tokens: int = 0
    accepted_tokens: int = 0
    histogram: list[int] = field(default_factory=list)
    finish_reasons: dict[str, int] = field(default_factory=dict)     # over completions (a row's n choices)
    started: float = field(default_factory=time.perf_counter)
    generation_started: float | None = None     # after the model loaded
    load_s: float = 0.0

    def start_generation(self, load_s: float) -> None:
        self.load_s = load_s
        self.generation_started = time.perf_counter()

    def add(self, rec: dict[str, Any]) -> None:
        self.requests += 1
        if rec.get("error"):
            self.errors += 1
            return
        self.prompt_tokens += rec["prompt_tokens"]
        self.completion_tokens += rec["completion_tokens"]
        for c in rec.get("choices") or [rec]:
            reason = c.get("finish_reason") or "unknown"
            self.finish_reasons[reason] = self.finish_reasons.get(reason, 0) + 1
        spec = rec["spec"]
        self.verify_steps += spec["verify_steps"]
        self.generated_tokens += emitted_tokens(spec)
        self.draft_tokens += spec["draft_tokens"]
        self.accepted_tokens += spec["accepted_tokens"]
        hist = spec["accept_histogram"]
        if len(self.histogram) < len(hist):
            self.histogram += [0] * (len(hist) - len(self.histogram))
        for i, n in enumerate(hist):
            self.histogram[i] += n

    @property
    def wall_s(self) -> float:
        return time.perf_counter() - self.started

    @property
    def accept_length(self) -> float:
        return self.generated_tokens / self.verify_steps if self.verify_steps else 0.0

    def acceptance_per_position(self) -> list[float]:
        """Share of decode cycles whose i-th draft was accepted (so the first i+1 were)."""
        cycles = sum(self.histogram)
        if not cycles:
            return []
        return [sum(self.histogram[i + 1:]) / cycles for i in range(len(self.histogram) - 1)]

    def summary(self, mem_device: torch.device | None = None, **extra: Any) -> dict[str, Any]:
        wall = self.wall_s
        gen = time.perf_counter() - self.generation_started if self.generation_started else 0.0
        return {
            "requests": self.requests,
            "errors": self.errors,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            # generation only (model load excluded); the job's own rate is completion_tokens / wall_s
            "output_tokens_per_s": self.completion_tokens / gen if gen > 0 else 0.0,
            "job_output_tokens_per_s": self.completion_tokens / wall if wall > 0 else 0.0,
            "verify_steps": self.verify_steps,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "mean_accept_length": self.accept_length,
            "accept_histogram": self.histogram,
            "finish_reasons": dict(sorted(self.finish_reasons.items())),
            "draft_acceptance_rate": self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0,
            "acceptance_per_position": self.acceptance_per_position(),
            "wall_s": wall,
            "load_s": self.load_s,
            "generate_s": gen,
            "peak_memory_bytes": peak_memory(mem_device),
            **extra,
        }


def peak_memory(device: torch.device | None) -> int:
    """Peak GPU memory allocated on a CUDA device, else the process's peak RSS."""
    if device is not None and device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
