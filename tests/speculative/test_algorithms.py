"""The algorithm table (specbatch/algorithms.py): what it answers for the builtin algorithms, the
docs generated from it, and the extension point: a prompt-lookup drafter registered from this
test with ONE call, run from a recipe dict through parse_recipe and an Engine, lossless against
vanilla and accepting drafts on a repetitive prompt."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specbatch import algorithms
from specbatch.algorithms import (ALGORITHMS, DRAFTERS, DraftShape, DrafterKind, FixedParams, NoParams,
                                  register_algorithm, unregister_algorithm)
from specbatch.data import RowRequest
from specbatch.engine import Engine, EngineOptions
from specbatch.models.config import ModelError
from specbatch.recipe import RecipeError, parse_recipe
from specbatch.resolve import JobError, describe_draft, resolve_draft, spec_config
from specbatch.speculative.accept import Acceptance
from specbatch.speculative.drafter import Drafter, NoDrafter, Proposal
from specbatch.speculative.factory import SpecConfig, make_drafter
from specbatch.speculative.tree import chain

pytestmark = pytest.mark.usefixtures("one_thread")

SCHEMA = Path(algorithms.__file__).parent / "recipes" / "schema.md"


# ---------------------------------------------------------------- the builtin rows


def test_builtin_rows():
    assert list(ALGORITHMS) == ["vanilla", "eagle3", "nextn_mtp", "naive_2token"]
    assert list(DRAFTERS) == ["eagle3", "nextn_mtp"]
    assert ALGORITHMS["vanilla"].drafters == () and isinstance(ALGORITHMS["vanilla"].params, NoParams)
    assert ALGORITHMS["naive_2token"].drafters == ("eagle3", "nextn_mtp")
    assert ALGORITHMS["naive_2token"].params == FixedParams(1, 1, 2)
    assert [a.name for a in ALGORITHMS.values() if a.fused] == ["naive_2token"]
    assert DRAFTERS["nextn_mtp"].in_target == "the MTP layer inside the target checkpoint"
    assert DRAFTERS["eagle3"].in_target is None
    assert {k.demo for k in DRAFTERS.values()} == {"eagle3", "nextn_mtp"}
    with pytest.raises(TypeError):
        ALGORITHMS["x"] = ALGORITHMS["eagle3"]            # a read-only view: register_algorithm adds


def test_spec_config_reads_the_table():
    assert SpecConfig().module is None and SpecConfig().width == 1 and SpecConfig().scratch_rows == 0
    assert not SpecConfig().fused
    n2 = SpecConfig("naive_2token", 1, 1, 2)
    assert (n2.module, n2.fused, n2.width, n2.scratch_rows) == ("eagle3", True, 2, 2)
    assert SpecConfig("naive_2token", 1, 1, 2, drafter="nextn_mtp").module == "nextn_mtp"
    tree = SpecConfig("eagle3", 5, 4, 8)
    assert (tree.module, tree.fused, tree.width, tree.scratch_rows) == ("eagle3", False, 8, 4 * 4 + 5 + 1)
    assert SpecConfig("nextn_mtp", 3, 1, 4).scratch_rows == 2 + 3 + 1


def test_unknown_algorithm_is_one_line(tiny_model):
    with pytest.raises(ModelError, match=r"algorithm 'medusa' is not available in this version \(available: "
                                        r"vanilla, eagle3, nextn_mtp, naive_2token\)"):
        make_drafter(SpecConfig("medusa", 1, 1, 2), None, 1, 8)
    assert isinstance(make_drafter(SpecConfig(), None, 1, 8), NoDrafter)


def test_schema_and_help_come_from_the_table():
    text = SCHEMA.read_text(encoding="utf-8")
    block = text.split("<!-- algorithms:begin -->\n")[1].split("\n<!-- algorithms:end -->")[0]
    assert block == algorithms.markdown_table(), "recipes/schema.md: paste algorithms.markdown_table()"
    assert algorithms.draft_help("run") == ("Draft directory: an EAGLE3 head, or an exported MTP layer "
                                            "(nextn_mtp reads the one inside --model without it).")
    assert algorithms.fused_help().startswith("Also run naive_2token recipes")


def test_register_errors():
    with pytest.raises(ValueError, match="already registered"):
        register_algorithm("eagle3", "again")
    with pytest.raises(KeyError, match="drafter 'nope' is not available"):
        register_algorithm("toy", "a toy", drafters=(DrafterKind("toy", build=PromptLookup.build), "nope"))
    assert "toy" not in ALGORITHMS and "toy" not in DRAFTERS          # nothing half-registered
    with pytest.raises(ValueError, match="builtin"):
        unregister_algorithm("vanilla")


# ---------------------------------------------------------------- the extension point


class PromptLookup(Drafter):
    """Prompt lookup decoding: the longest suffix (up to `ngram` tokens) of prompt + output that
    occurred before predicts that what followed it then follows now, continued periodically to
    `num_steps` drafts. A chain; host-side lists, so no graphs."""

    graphable = False

    def __init__(self, num_steps: int, ngram: int = 3):
        self.num_draft_tokens, self.max_depth, self.ngram = num_steps + 1, num_steps, ngram
        self.seq: dict[int, list[int]] = {}          # slot -> prompt + emitted tokens

    @classmethod
    def build(cls, spec, target, num_slots, max_len, *, head=None, target_dir=None, layout=None):
        return cls(spec.num_steps)

    def prefill(self, rows, captured, first_tokens):
        for b, (s, prompt) in enumerate(zip(rows.slots.tolist(), rows.prompts)):
            self.seq[s] = list(prompt) + [int(first_tokens[b])]

    def _drafts(self, seq: list[int]) -> list[int]:
        L = len(seq)
        for n in range(min(self.ngram, L - 1), 0, -1):
            for start in range(L - n - 1, -1, -1):   # the latest earlier occurrence of the suffix
                if seq[start:start + n] == seq[L - n:]:
                    period, ext = L - n - start, list(seq)
                    for _ in range(self.max_depth):
                        ext.append(ext[len(ext) - period])
                    return ext[L:]
        return [seq[-1]] * self.max_depth

    def propose(self, slots, last_tokens, lens, kv_bound=None):     # no width: drafters may omit it
        drafts = torch.tensor([self._drafts(self.seq[s]) for s in slots.tolist()],
                              dtype=torch.int64, device=slots.device)
        parents, depths = chain(slots.shape[0], self.num_draft_tokens, slots.device)
        return Proposal(torch.cat([last_tokens[:, None], drafts], dim=1), parents, depths, None)

    def extend(self, slots, lens, acc: Acceptance, captured, kv_bound=None):
        for b, s in enumerate(slots.tolist()):
            self.seq[s] += acc.tokens[b, : int(acc.num[b])].tolist()


def test_a_drafter_may_leave_width_out_of_propose():
    from specbatch.speculative.drafter import Drafter, takes_width

    assert not takes_width(PromptLookup(2).propose)                 # runs below, every node drafted
    assert takes_width(Drafter().propose)
    assert takes_width(lambda slots, last, lens, kv_bound=None, **kw: None)


def test_drafts_follow_the_last_occurrence():
    d = PromptLookup(num_steps=4)
    assert d._drafts([1, 2, 3, 9, 1, 2, 3]) == [9, 1, 2, 3]          # the 3-gram "1 2 3" seen before
    assert d._drafts([5, 6, 5, 6]) == [5, 6, 5, 6]                   # overlapping: continued periodically
    assert d._drafts([7, 8]) == [8, 8, 8, 8]                         # nothing seen before


def _rows(prompts):
    return [RowRequest(row=i, id=str(i), prompt_token_ids=p) for i, p in enumerate(prompts)]


def _generate(recipe, model_dir, prompts):
    spec = spec_config(recipe)
    engine = Engine(model_dir, EngineOptions(batch_size=2, device="cpu", dtype=recipe.dtype, spec=spec))
    recs = sorted(engine.generate(_rows(prompts), recipe.sampling), key=lambda r: r["row"])
    assert all(r["error"] is None for r in recs)
    return recs, engine


def test_prompt_lookup_is_one_register_call(tiny_model):
    base = {"model": str(tiny_model), "dtype": "float32",
            "sampling": {"max_tokens": 96, "temperature": 0.0, "ignore_eos": True}}
    g = torch.Generator().manual_seed(3)
    motif = torch.randint(1, 300, (6,), generator=g).tolist()
    prompts = [[5] * 30, motif * 5, torch.randint(1, 300, (17,), generator=g).tolist()]   # 3 rows, 2 slots
    assert "prompt_lookup" not in ALGORITHMS
    register_algorithm("prompt_lookup", "Drafts what followed the last occurrence of the current suffix.",
                       DraftShape(trees=False),
                       drafters=[DrafterKind("prompt_lookup", build=PromptLookup.build)])
    try:
        recipe = parse_recipe({**base, "algorithm": "prompt_lookup", "num_steps": 4, "topk": 1,
                               "num_draft_tokens": 5}, "lookup.yaml")
        assert recipe.drafter == "prompt_lookup"
        assert resolve_draft(recipe) is None and describe_draft(recipe, None) is None
        with pytest.raises(JobError, match="uses no draft model"):
            resolve_draft(recipe.with_overrides(draft="/some/dir"))
        with pytest.raises(RecipeError, match="topk: algorithm prompt_lookup drafts chains only"):
            parse_recipe({**base, "algorithm": "prompt_lookup", "num_steps": 2, "topk": 2,
                          "num_draft_tokens": 3}, "lookup.yaml")

        vanilla, _ = _generate(parse_recipe({**base, "algorithm": "vanilla"}, "vanilla.yaml"), tiny_model, prompts)
        lookup, engine = _generate(recipe, tiny_model, prompts)
        # N = 5 verified, plus depth - 1 = 3 for the cycle a finished request rides in once more
        assert isinstance(engine.drafter, PromptLookup) and engine.headroom == 8
        assert [r["output_token_ids"] for r in lookup] == [r["output_token_ids"] for r in vanilla]   # lossless
        stats = [r["spec"] for r in lookup]
        assert all(s["draft_tokens"] == 4 * (s["verify_steps"] - 1) for s in stats)
        assert stats[0]["accepted_tokens"] > 0                         # the repetitive prompt
        assert any(sum(s["accept_histogram"][2:]) for s in stats)      # runs of several drafts
    finally:
        unregister_algorithm("prompt_lookup")
    assert "prompt_lookup" not in ALGORITHMS and "prompt_lookup" not in DRAFTERS
    with pytest.raises(RecipeError, match="algorithm: expected one of vanilla, eagle3, nextn_mtp, naive_2token"):
        parse_recipe({**base, "algorithm": "prompt_lookup"}, "lookup.yaml")
