"""SamplingParams: ONE set of sampling fields for a recipe's defaults, CLI flags, a row's own
fields and a running request (torch-free: recipes and rows use it without torch)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any, Mapping

GREEDY_BELOW = 1e-5       # temperatures below this are greedy (vLLM's _SAMPLING_EPS)
_SEED_MIX = (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9)


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 0.0          # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0                    # 0 = disabled
    seed: int | None = None           # None: derived from the run seed and the row (for_row)
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def to_dict(self) -> dict[str, Any]:
        """Plain values (lists, not tuples), as a recipe's `sampling` mapping spells them."""
        d = asdict(self)
        d["stop"], d["stop_token_ids"] = list(self.stop), list(self.stop_token_ids)
        return d

    def for_row(self, overrides: Mapping[str, Any], row: int) -> "SamplingParams":
        """These defaults with a row's own (validated) fields applied, resolved to run: a seed
        for every row (from the run seed, which these defaults carry, and the row number: reruns
        and resumes draw the same tokens) and tiny temperatures made greedy. Every temperature
        (row, recipe, CLI) passes here: dividing logits by 1e-40 overflows."""
        p = replace(self, **{k: (tuple(v) if k in ("stop", "stop_token_ids") else v)
                             for k, v in overrides.items()})
        seed = p.seed
        if overrides.get("seed") is None:
            seed = (((self.seed or 0) * _SEED_MIX[0]) ^ (row * _SEED_MIX[1])) % (1 << 64)
        temperature = float(p.temperature)
        return replace(p, seed=int(seed), temperature=0.0 if temperature < GREEDY_BELOW else temperature,
                       top_p=float(p.top_p), top_k=min(int(p.top_k), 2**31 - 1))   # >= vocab: no filter
