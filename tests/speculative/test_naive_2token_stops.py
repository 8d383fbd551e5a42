"""naive_2token with the oracle drafter (one draft, always the target's next token): every draft
accepted, and max_tokens, a stop token id, EOS or a stop string landing on the accepted draft."""
from __future__ import annotations

import math

import pytest

from naive_2token_helpers import (check_stats, greedy_table, n2_rows, oracle, output_ids, plain_rows,  # noqa: F401
                                  run_engine, vanilla)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def free(target_dir):
    """Four prompts, their greedy continuations (EOS ignored) and the oracle's table."""
    rows = plain_rows(n2_rows(n=4))
    table = greedy_table(target_dir, rows)
    return rows, table, output_ids(run_engine(target_dir, rows, 2, max_tokens=30, ignore_eos=True))


def _first_at(ids, parity):
    """The first position j >= 1 of the given parity where ids[j] occurs for the first time."""
    return next(j for j in range(1, len(ids)) if j % 2 == parity and ids.index(ids[j]) == j)


def test_oracle_width_2_accepts_every_draft(target_dir, free, vanilla):
    rows = n2_rows()
    recs = run_engine(target_dir, rows, 3, drafter=oracle(greedy_table(target_dir, rows)))
    assert output_ids(recs) == vanilla
    check_stats(recs)
    for r in recs:
        s, n = r["spec"], r["completion_tokens"]
        assert s["accept_histogram"][0] == 0
        if r["finish_reason"] == "length":
            assert s["verify_steps"] == 1 + math.ceil((n - 1) / 2)


def test_max_tokens_landing_on_the_draft(target_dir, free):
    rows, table, ref = free
    for cut in (1, 2, 3, 4, 7, 10):
        # after the prefill's token every cycle emits [draft, bonus]: an even cut leaves one
        # token for the last cycle, the accepted draft, and its bonus is dropped
        recs = run_engine(target_dir, rows, 2, drafter=oracle(table), max_tokens=cut, ignore_eos=True)
        assert output_ids(recs) == [f[:cut] for f in ref], cut
        assert all(r["finish_reason"] == "length" for r in recs)
        for r in recs:
            assert r["spec"]["verify_steps"] == 1 + math.ceil((cut - 1) / 2)
            assert r["spec"]["accept_histogram"] == [0, math.ceil((cut - 1) / 2)]


@pytest.mark.parametrize("on", ["draft", "bonus"])
def test_stop_token_id_on_the_accepted_run(on, target_dir, free):
    rows, table, ref = free
    ids = ref[0]
    j = _first_at(ids, 1 if on == "draft" else 0)
    recs = run_engine(target_dir, rows[:1], 1, drafter=oracle(table), max_tokens=30, ignore_eos=True,
                      stop_token_ids=(ids[j],))
    assert recs[0]["output_token_ids"] == ids[: j + 1] and recs[0]["finish_reason"] == "stop"
    assert recs[0]["spec"]["verify_steps"] == 1 + math.ceil(j / 2)       # stopped inside that cycle
    assert recs[0]["spec"]["accept_histogram"][0] == 0


def test_eos_as_the_accepted_draft(target_dir, free, tiny_model_factory):
    rows, table, ref = free
    ids = ref[0]
    j = _first_at(ids, 1)                    # an odd position: the draft of cycle (j + 1) / 2
    eos_target = tiny_model_factory("llama3", tag="n2-eos", num_hidden_layers=4)
    (eos_target / "generation_config.json").write_text('{"eos_token_id": [%d]}' % ids[j])
    recs = run_engine(eos_target, rows[:1], 1, drafter=oracle(table), max_tokens=30)
    assert recs[0]["output_token_ids"] == ids[: j + 1] and recs[0]["finish_reason"] == "stop"
    assert recs[0]["spec"]["verify_steps"] == 1 + (j + 1) // 2
    # ignore_eos: the same engine runs on past it, the bonus included
    recs = run_engine(eos_target, rows[:1], 1, drafter=oracle(table), max_tokens=j + 2, ignore_eos=True)
    assert recs[0]["output_token_ids"] == ids[: j + 2] and recs[0]["finish_reason"] == "length"


def test_stop_string_completed_by_the_draft(target_dir, free):
    rows, table, ref = free
    from specbatch.prompts import load_tokenizer

    tok = load_tokenizer(target_dir)
    found = None
    for r, ids in zip(rows, ref):
        for j in range(1, len(ids), 2):
            s = tok.decode([ids[j]], skip_special_tokens=True).strip()
            before = tok.decode(ids[:j], skip_special_tokens=True)
            if s and "\ufffd" not in s and s not in before and s in tok.decode(ids[: j + 1], skip_special_tokens=True):
                found = (r, ids, j, s)
                break
        if found:
            break
    if found is None:
        pytest.skip("no usable stop string in these continuations")
    r, ids, j, s = found
    recs = run_engine(target_dir, [r], 1, drafter=oracle(table), max_tokens=30, ignore_eos=True, stop=(s,))
    assert recs[0]["output_token_ids"] == ids[: j + 1] and recs[0]["finish_reason"] == "stop"
    text = tok.decode(ids[: j + 1], skip_special_tokens=True)
    assert recs[0]["completion"] == text[: text.find(s)]
