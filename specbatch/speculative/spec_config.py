"""SpecConfig: a recipe's algorithm and parameters, as the engine and the drafter factory take
them (torch-free: its facts come from the algorithm table)."""
from __future__ import annotations

from dataclasses import dataclass

from ..algorithms import Algorithm, AlgorithmError, get_algorithm
from ..models.config import ModelError


@dataclass(frozen=True)
class SpecConfig:
    algorithm: str = "vanilla"
    num_steps: int | None = None         # S
    topk: int | None = None              # k
    num_draft_tokens: int | None = None  # N, the root included
    draft: str | None = None             # draft directory (nextn_mtp: None = inside the target)
    drafter: str | None = None           # the drafter kind (None: the algorithm's default)

    @property
    def entry(self) -> Algorithm:
        """The algorithm's row in the table (a one-line ModelError when it is not registered)."""
        try:
            return get_algorithm(self.algorithm)
        except AlgorithmError as e:
            raise ModelError(str(e)) from None

    @property
    def module(self) -> str | None:
        """The drafter kind that runs (None: the algorithm drafts nothing)."""
        return self.drafter or self.entry.default_drafter

    @property
    def fused(self) -> bool:
        """Verify and draft extend as one CUDA graph (naive_2token: no draft forward to separate)."""
        return self.entry.fused

    @property
    def width(self) -> int:
        """Tokens verified per sequence per cycle."""
        return self.entry.width(self.num_steps, self.topk, self.num_draft_tokens)

    @property
    def scratch_rows(self) -> int:
        """Cache rows past a slot's committed length the drafter writes."""
        return self.entry.scratch_rows(self.drafter, self.num_steps, self.topk, self.num_draft_tokens)
