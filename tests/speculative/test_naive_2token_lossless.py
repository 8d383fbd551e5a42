"""naive_2token (S=1, k=1, N=2): verify [last token, one draft] per slot, then the draft catch-up
over both rows. Lossless greedy output with both drafters (EAGLE3 head, MTP layer), the accept
step at N = 2, stops and max_tokens landing on the accepted draft, lossless sampling
(statistical), and on CUDA the whole cycle captured as ONE graph per (size, variant).

Random draft modules are almost never right, which would leave the accepted-draft paths
untested: `bigram` is a target whose layers add nothing (o_proj and down_proj zero, so the next
token depends on the current one only) carrying an MTP layer built to compute exactly the
target's next-token logits: every greedy draft is right, and the draft after an accepted draft
is right only if the catch-up kept the bonus row.
"""
from __future__ import annotations

import json
import math

import pytest
import torch

from oracle import OracleDrafter
from specbatch.data import RowRequest
from specbatch.engine import Engine, EngineOptions
from specbatch.recipe import SamplingDefaults
from specbatch.sampling import BatchSampling, SamplingParams
from specbatch.speculative.accept import accept
from specbatch.speculative.factory import SpecConfig
from specbatch.speculative.tree import chain
from tiny_models import make_eagle3_head, make_mtp_layer

LENS = (1, 23, 9, 40, 5, 17, 3, 30, 12)
MAXES = (20, 7, 16, 1, 20, 11, 20, 2, 14)      # requests finish at different cycles
VOCAB = 320
CPU = torch.device("cpu")


# ------------------------------------------------------------------------------------ fixtures

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target(tiny_model_factory):
    return tiny_model_factory("llama3", num_hidden_layers=4)


@pytest.fixture(scope="module")
def head(target, tmp_path_factory):
    return make_eagle3_head(tmp_path_factory.mktemp("eagle3-n2"), target)


@pytest.fixture(scope="module")
def mtp_target(tiny_model_factory):
    """The same weights as `target`, plus a random DeepSeek-layout MTP layer at model.layers.4."""
    d = tiny_model_factory("llama3", tag="n2-mtp", num_hidden_layers=4)
    make_mtp_layer(d, "deepseek")
    return d


@pytest.fixture(scope="module")
def bigram(tiny_model_factory):
    """A target whose next token depends on the current token only, with an exact MTP layer."""
    from safetensors.torch import load_file, save_file

    d = tiny_model_factory("llama3", tag="n2-bigram", num_hidden_layers=4)
    make_mtp_layer(d, "deepseek")
    path = d / "model.safetensors"
    w = load_file(str(path))
    L, H = 4, json.loads((d / "config.json").read_text())["hidden_size"]
    for i in range(L):                          # every layer adds zero: hidden = embedding
        for name in ("self_attn.o_proj.weight", "mlp.down_proj.weight"):
            w[f"model.layers.{i}.{name}"].zero_()
    # MTP: eh_proj keeps the normed embedding of the token (the one the target just predicted),
    # the layer adds zero, the final norm is the target's: logits = the target's at that token.
    m = f"model.layers.{L}."
    w[m + "eh_proj.weight"] = torch.cat([torch.eye(H), torch.zeros(H, H)], dim=1).contiguous()
    w[m + "enorm.weight"] = torch.ones(H)
    w[m + "self_attn.o_proj.weight"].zero_()
    w[m + "mlp.down_proj.weight"].zero_()
    w[m + "shared_head.norm.weight"] = w["model.norm.weight"].clone()
    save_file(w, str(path), metadata={"format": "pt"})
    return d


def _rows(n=len(LENS), seed=0, overrides=None):
    g = torch.Generator().manual_seed(seed)
    return [RowRequest(row=i, id=str(i),
                       prompt_token_ids=torch.randint(1, VOCAB, (LENS[i % len(LENS)],), generator=g).tolist(),
                       overrides={"max_tokens": MAXES[i % len(MAXES)], **(overrides or {})}) for i in range(n)]


def _plain(rows):
    return [RowRequest(row=r.row, id=r.id, prompt_token_ids=r.prompt_token_ids) for r in rows]


def _engine(model, bs, spec=SpecConfig(), drafter=None, device="cpu", **opts):
    return Engine(model, EngineOptions(batch_size=bs, device=device, dtype="float32", spec=spec, **opts),
                  drafter=drafter)


def _run(model, rows, bs, spec=SpecConfig(), drafter=None, device="cpu", engine=None, **defaults):
    eng = engine or _engine(model, bs, spec, drafter, device)
    recs = sorted(eng.generate(rows, SamplingDefaults(**{"max_tokens": 20, **defaults})), key=lambda r: r["row"])
    assert all(r["error"] is None for r in recs)
    return recs


def _ids(recs):
    return [r["output_token_ids"] for r in recs]


def _n2(drafter, head=None):
    """The naive_2token spec for `drafter` (eagle3: the head dir; nextn_mtp: inside the target)."""
    return SpecConfig("naive_2token", 1, 1, 2, str(head) if drafter == "eagle3" else None, drafter)


def _check_stats(recs):
    for r in recs:
        s = r["spec"]
        assert s["draft_tokens"] == s["verify_steps"] - 1
        assert len(s["accept_histogram"]) == 2
        assert sum(s["accept_histogram"]) == s["verify_steps"] - 1
        assert s["accepted_tokens"] == s["accept_histogram"][1]
        # every cycle emits one or two tokens; the last one may be cut by a stop or max_tokens
        assert s["verify_steps"] <= r["completion_tokens"] <= 2 * s["verify_steps"] - 1


def _table(model, rows, max_tokens=40):
    """Each prompt's greedy continuation (EOS ignored), for the oracle drafter."""
    recs = _run(model, _plain(rows), 4, max_tokens=max_tokens, ignore_eos=True)
    return {tuple(r.prompt_token_ids): rec["output_token_ids"] for r, rec in zip(rows, recs)}


@pytest.fixture(scope="module")
def vanilla(target):
    return _ids(_run(target, _rows(), 4))


# ------------------------------------------------------------------------------------ greedy, both drafters

@pytest.mark.parametrize("drafter", ["eagle3", "nextn_mtp"])
def test_greedy_is_lossless(drafter, target, mtp_target, head, vanilla):
    model = target if drafter == "eagle3" else mtp_target
    spec = _n2(drafter, head)
    if drafter == "nextn_mtp":
        # the MTP layer in the checkpoint changes nothing about the target itself
        assert _ids(_run(mtp_target, _rows(), 4)) == vanilla
    for bs in (1, 3, 8):
        eng = _engine(model, bs, spec)
        assert eng.drafter.num_draft_tokens == 2 and eng.drafter.max_depth == 1
        assert eng.fused and eng.graphs is None                 # the recipe's choice; CPU: eager
        recs = _run(model, _rows(), bs, engine=eng)
        assert _ids(recs) == vanilla, f"{drafter} batch {bs}"
        _check_stats(recs)
    assert not _engine(model, 2, spec, fused=False).fused
    assert not _engine(target, 2, SpecConfig("eagle3", 1, 1, 2, str(head))).fused


def test_exact_mtp_draft_is_always_accepted(bigram):
    """The MTP layer predicts exactly what the target will: every cycle accepts its draft, so the
    catch-up kept the right row (the bonus after an acceptance, the correction after none)."""
    rows = _rows()
    ref = _ids(_run(bigram, rows, 4))
    for bs in (1, 3, 8):
        recs = _run(bigram, rows, bs, _n2("nextn_mtp"))
        assert _ids(recs) == ref, f"batch {bs}"
        _check_stats(recs)
        for r in recs:
            s = r["spec"]
            assert s["accept_histogram"][0] == 0, (bs, r["row"], s)
            if r["finish_reason"] == "length":
                assert s["verify_steps"] == 1 + math.ceil((r["completion_tokens"] - 1) / 2)
        assert sum(r["spec"]["accepted_tokens"] for r in recs) > 40


@pytest.mark.parametrize("name", ["naive_2token", "naive_2token_mtp"])
def test_recipe_through_the_job(name, target, mtp_target, head, tmp_path):
    from specbatch.job import JobOptions, run_job
    from specbatch.recipe import load_recipe

    model = target if name == "naive_2token" else mtp_target
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"prompt_token_ids": r.prompt_token_ids, "max_tokens": 12}) + "\n"
                           for r in _rows(n=5)))
    outs = {}
    for rname in ("vanilla", name):
        draft = None if rname == "vanilla" else (str(head) if name == "naive_2token" else None)
        recipe = load_recipe(rname).with_overrides(model=str(model), batch_size=3, draft=draft)
        out = tmp_path / f"{rname}.jsonl"
        summary = run_job(str(src), recipe, JobOptions(output=str(out), device="cpu", save_token_ids=True))
        outs[rname] = [json.loads(line) for line in open(out)]
        assert summary["errors"] == 0 and summary["requests"] == 5
    assert recipe.algorithm == "naive_2token" and recipe.num_draft_tokens == 2
    assert recipe.drafter == ("eagle3" if name == "naive_2token" else "nextn_mtp")
    assert summary["draft"] == (str(head) if name == "naive_2token" else "the MTP layer inside the target checkpoint")
    assert summary["recipe"] == name and summary["graphs"] is False
    assert len(summary["acceptance_per_position"]) == 1 and len(summary["accept_histogram"]) == 2
    assert summary["draft_tokens"] == summary["verify_steps"] - summary["requests"] > 0
    assert 1.0 <= summary["mean_accept_length"] <= 2.0
    key = lambda recs: [(r["completion"], r["output_token_ids"]) for r in recs]
    assert key(outs[name]) == key(outs["vanilla"])


def test_profile_eager_reports_three_stages(target, head):
    """Without graphs (CPU) the fused recipe still runs and times the three stages apart."""
    eng = _engine(target, 4, _n2("eagle3", head), profile=True)
    recs = _run(target, _rows(6), 4, engine=eng)
    cycles = max(r["spec"]["verify_steps"] for r in recs) - 1
    assert len(eng.cycle_times) >= cycles > 0
    assert all(t.draft_ms > 0 and t.verify_ms > 0 and t.extend_ms > 0 for t in eng.cycle_times)
    assert sum(t.tokens for t in eng.cycle_times) == sum(r["completion_tokens"] for r in recs) - len(recs)


# ------------------------------------------------------------------------------------ accept at N = 2

def _sp(params):
    return BatchSampling.build(params, CPU)


def _logits(argmaxes, V=12, seed=0):
    """[N, V] random logits whose argmax at node i is argmaxes[i]."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(len(argmaxes), V, generator=g)
    for i, t in enumerate(argmaxes):
        x[i, t] = x[i].max() + 1.0
    return x


def _t(rows):
    return torch.tensor(rows, dtype=torch.int64)


def test_accept_n2_greedy():
    nodes = _t([[9, 4], [9, 4], [3, 3]])
    parents, depths = chain(3, 2, CPU)
    assert parents.tolist() == [[-1, 0]] * 3 and depths.tolist() == [[0, 1]] * 3
    logits = torch.stack([_logits([4, 6], seed=1),      # draft 4 right: [4, bonus 6]
                          _logits([2, 6], seed=2),      # wrong: the target's 2 alone
                          _logits([3, 0], seed=3)])     # draft equal to the root, right: [3, 0]
    acc = accept(nodes, parents, logits, _sp([SamplingParams()] * 3), _t([5, 0, 17]), max_depth=1)
    assert acc.tokens.shape == (3, 2) and acc.path.shape == (3, 2)
    assert acc.num.tolist() == [2, 1, 2]
    assert acc.tokens[0].tolist() == [4, 6] and acc.path[0].tolist() == [0, 1]
    assert acc.tokens[1, 0].item() == 2 and acc.path[1, 0].item() == 0
    assert acc.tokens[2].tolist() == [3, 0]


def test_accept_n2_greedy_and_sampled_rows_in_one_batch():
    V, B = 12, 6
    nodes = _t([[9, 4], [9, 4], [1, 7], [1, 7], [1, 7], [5, 2]])
    parents, _ = chain(B, 2, CPU)
    sure = torch.full((V,), -40.0)
    sure[7] = 5.0                                          # p(7) ~ 1: the draft 7 is accepted
    never = torch.randn(V, generator=torch.Generator().manual_seed(4))
    never[7] = float("-inf")                               # p(7) = 0: the draft 7 is rejected
    bonus = torch.randn(V, generator=torch.Generator().manual_seed(5))
    logits = torch.stack([
        _logits([4, 6], seed=1), _logits([2, 6], seed=2),  # greedy: accepted / rejected
        torch.stack([sure, bonus]), torch.stack([never, bonus]),
        torch.stack([sure, bonus]),                         # greedy row on a sampled row's logits
        _logits([2, 8], seed=6),                            # sampled, draft 2 is the argmax
    ])
    params = [SamplingParams(), SamplingParams(), SamplingParams(temperature=1.0, seed=3),
              SamplingParams(temperature=0.7, top_k=5, seed=4), SamplingParams(),
              SamplingParams(temperature=1.0, top_p=0.9, seed=9)]
    start = _t([3, 8, 11, 2, 40, 6])
    acc = accept(nodes, parents, logits, _sp(params), start, 1)
    assert acc.num[:5].tolist() == [2, 1, 2, 1, 2]
    assert acc.tokens[0].tolist() == [4, 6] and acc.tokens[1, 0].item() == 2
    assert acc.tokens[2, 0].item() == 7 and acc.tokens[4].tolist() == [7, int(bonus.argmax())]
    assert acc.tokens[3, 0].item() != 7
    # each row alone gives the same: greedy rows are unchanged by the sampling code path
    for b in range(B):
        one = accept(nodes[b:b + 1], parents[b:b + 1], logits[b:b + 1], _sp([params[b]]), start[b:b + 1], 1)
        n = int(one.num[0])
        assert int(acc.num[b]) == n and torch.equal(acc.tokens[b, :n], one.tokens[0, :n]), b
    # the sampled bonus after an accepted draft is drawn from the draft node's distribution
    B2 = 4000
    lg = torch.stack([sure, bonus])[None].expand(B2, 2, V)
    many = accept(_t([[1, 7]]).expand(B2, 2), chain(B2, 2, CPU)[0], lg,
                  _sp([SamplingParams(temperature=1.0, seed=i) for i in range(B2)]), _t([11] * B2), 1)
    assert (many.num == 2).all() and (many.tokens[:, 0] == 7).all()
    _assert_law(many.tokens[:, 1], bonus.double().softmax(-1), "bonus")


def test_accept_n2_sampled_draft_law():
    """One draft of probability 0.4: accepted 40 % of the time, the first token follows p, the
    rejected rows follow p without the draft, the bonus follows the draft node's p."""
    V, B, draft = 6, 20_000, 2
    p0 = torch.tensor([0.1, 0.2, 0.4, 0.05, 0.15, 0.1], dtype=torch.float64)
    p1 = torch.tensor([0.3, 0.1, 0.1, 0.2, 0.25, 0.05], dtype=torch.float64)
    lg = torch.stack([p0, p1]).log().float()[None].expand(B, 2, V)
    sp = _sp([SamplingParams(temperature=1.0, seed=i) for i in range(B)])
    acc = accept(_t([[0, draft]]).expand(B, 2), chain(B, 2, CPU)[0], lg, sp, _t([7] * B), 1)
    ok = acc.num == 2
    rate = float(ok.double().mean())
    assert abs(rate - 0.4) < 4.5 * math.sqrt(0.24 / B), rate
    assert (acc.tokens[ok, 0] == draft).all() and not (acc.tokens[~ok, 0] == draft).any()
    _assert_law(acc.tokens[:, 0], p0, "first token")
    resid = p0.clone()
    resid[draft] = 0
    _assert_law(acc.tokens[~ok, 0], resid / resid.sum(), "residual")
    _assert_law(acc.tokens[ok, 1], p1, "bonus")


def _chi2_threshold(dof: int, z: float = 3.09) -> float:
    """Chi-square quantile at p = 0.001 (Wilson-Hilferty)."""
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def _chi2(counts: torch.Tensor, expected: torch.Tensor) -> tuple[float, int]:
    """Chi-square statistic over bins of expected count >= 5, the rest merged into one bin;
    tokens of zero probability must not appear at all."""
    counts, expected = counts.double().flatten(), expected.double().flatten()
    assert counts[expected <= 0].sum() == 0, "a token of zero probability was emitted"
    big = expected >= 5
    stat = float((((counts - expected) ** 2 / expected)[big]).sum())
    other_e, other_c = float(expected[~big].sum()), float(counts[~big].sum())
    stat += (other_c - other_e) ** 2 / max(other_e, 1e-9)
    return stat, max(int(big.sum()), 1)


def _assert_law(samples, p, what):
    n = samples.numel()
    stat, dof = _chi2(torch.bincount(samples, minlength=p.shape[0]), n * p)
    assert stat < _chi2_threshold(dof), (what, stat, dof)


# ------------------------------------------------------------------------------------ stops on the draft

@pytest.fixture(scope="module")
def free(target):
    """Four prompts, their greedy continuations (EOS ignored) and the oracle's table."""
    rows = _plain(_rows(n=4))
    table = _table(target, rows)
    return rows, table, _ids(_run(target, rows, 2, max_tokens=30, ignore_eos=True))


def _oracle(table):
    return OracleDrafter(table, 2, VOCAB)        # one draft, always the target's next token


def _first_at(ids, parity):
    """The first position j >= 1 of the given parity where ids[j] occurs for the first time."""
    return next(j for j in range(1, len(ids)) if j % 2 == parity and ids.index(ids[j]) == j)


def test_oracle_width_2_accepts_every_draft(target, free, vanilla):
    rows = _rows()
    recs = _run(target, rows, 3, drafter=_oracle(_table(target, rows)))
    assert _ids(recs) == vanilla
    _check_stats(recs)
    for r in recs:
        s, n = r["spec"], r["completion_tokens"]
        assert s["accept_histogram"][0] == 0
        if r["finish_reason"] == "length":
            assert s["verify_steps"] == 1 + math.ceil((n - 1) / 2)


def test_max_tokens_landing_on_the_draft(target, free):
    rows, table, ref = free
    for cut in (1, 2, 3, 4, 7, 10):
        # after the prefill's token every cycle emits [draft, bonus]: an even cut leaves one
        # token for the last cycle, the accepted draft, and its bonus is dropped
        recs = _run(target, rows, 2, drafter=_oracle(table), max_tokens=cut, ignore_eos=True)
        assert _ids(recs) == [f[:cut] for f in ref], cut
        assert all(r["finish_reason"] == "length" for r in recs)
        for r in recs:
            assert r["spec"]["verify_steps"] == 1 + math.ceil((cut - 1) / 2)
            assert r["spec"]["accept_histogram"] == [0, math.ceil((cut - 1) / 2)]


@pytest.mark.parametrize("on", ["draft", "bonus"])
def test_stop_token_id_on_the_accepted_run(on, target, free):
    rows, table, ref = free
    ids = ref[0]
    j = _first_at(ids, 1 if on == "draft" else 0)
    recs = _run(target, rows[:1], 1, drafter=_oracle(table), max_tokens=30, ignore_eos=True,
                stop_token_ids=(ids[j],))
    assert recs[0]["output_token_ids"] == ids[: j + 1] and recs[0]["finish_reason"] == "stop"
    assert recs[0]["spec"]["verify_steps"] == 1 + math.ceil(j / 2)       # stopped inside that cycle
    assert recs[0]["spec"]["accept_histogram"][0] == 0


def test_eos_as_the_accepted_draft(target, free, tiny_model_factory):
    rows, table, ref = free
    ids = ref[0]
    j = _first_at(ids, 1)                    # an odd position: the draft of cycle (j + 1) / 2
    eos_target = tiny_model_factory("llama3", tag="n2-eos", num_hidden_layers=4)
    (eos_target / "generation_config.json").write_text('{"eos_token_id": [%d]}' % ids[j])
    recs = _run(eos_target, rows[:1], 1, drafter=_oracle(table), max_tokens=30)
    assert recs[0]["output_token_ids"] == ids[: j + 1] and recs[0]["finish_reason"] == "stop"
    assert recs[0]["spec"]["verify_steps"] == 1 + (j + 1) // 2
    # ignore_eos: the same engine runs on past it, the bonus included
    recs = _run(eos_target, rows[:1], 1, drafter=_oracle(table), max_tokens=j + 2, ignore_eos=True)
    assert recs[0]["output_token_ids"] == ids[: j + 2] and recs[0]["finish_reason"] == "length"


def test_stop_string_completed_by_the_draft(target, free):
    rows, table, ref = free
    from specbatch.prompts import load_tokenizer

    tok = load_tokenizer(target)
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
    recs = _run(target, [r], 1, drafter=_oracle(table), max_tokens=30, ignore_eos=True, stop=(s,))
    assert recs[0]["output_token_ids"] == ids[: j + 1] and recs[0]["finish_reason"] == "stop"
    text = tok.decode(ids[: j + 1], skip_special_tokens=True)
    assert recs[0]["completion"] == text[: text.find(s)]


# ------------------------------------------------------------------------------------ sampling (statistical)

def _exact(model, prompt, T, g1):
    """Exact target probabilities from transformers: p1 [V] of the first token, p2 [V, V] of the
    second given the first, p3 [V, V] of the third given (g1, second)."""
    import transformers as tf

    m = tf.AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).eval()
    V = m.config.vocab_size
    with torch.no_grad():
        p1 = (m(torch.tensor([prompt])).logits[0, -1] / T).softmax(-1)
        p2 = (m(torch.tensor([prompt + [t] for t in range(V)])).logits[:, -1] / T).softmax(-1)
        p3 = (m(torch.tensor([prompt + [g1, t] for t in range(V)])).logits[:, -1] / T).softmax(-1)
    return p1.double(), p2.double(), p3.double()


@pytest.mark.parametrize("mode", ["eagle3", "nextn_mtp", "oracle", "exact_mtp"])
def test_sampling_is_lossless_statistically(mode, target, mtp_target, head, bigram):
    """Many seeds of one prompt: the first two tokens follow the target's joint distribution,
    and the next two after the most likely first token too (the bonus tokens among them)."""
    T, n = 0.6, 3000
    model = {"eagle3": target, "nextn_mtp": mtp_target, "oracle": target, "exact_mtp": bigram}[mode]
    prompt = _rows(n=3)[2].prompt_token_ids       # p(greedy 2 tokens) ~ 0.6 at T = 0.6: drafts accepted
    rows = [RowRequest(row=i, id=str(i), prompt_token_ids=prompt, overrides={"seed": i}) for i in range(n)]
    if mode == "oracle":
        table = _table(target, rows[:1], 8)
        kw = dict(drafter=_oracle(table))
        g1, g2 = table[tuple(prompt)][:2]
    else:
        kw = dict(spec=_n2("eagle3" if mode == "eagle3" else "nextn_mtp", head))
    recs = _run(model, rows, 64, temperature=T, max_tokens=3, ignore_eos=True, **kw)
    _check_stats(recs)
    toks = torch.tensor(_ids(recs))                                       # [n, 3]
    first_accepted = torch.tensor([r["spec"]["verify_steps"] == 2 for r in recs])
    if mode != "oracle":
        g1 = int(torch.bincount(toks[:, 0], minlength=VOCAB).argmax())
    p1, p2, p3 = _exact(model, prompt, T, g1)
    accepted = sum(r["spec"]["accepted_tokens"] for r in recs)
    if mode == "oracle":
        # after the greedy first token the draft is the greedy second one: accepted iff emitted
        on = toks[:, 0] == g1
        assert torch.equal(first_accepted[on], toks[on, 1] == g2)
        assert accepted > n // 10
    elif mode == "exact_mtp":
        # the draft after any first token t is the target's argmax there: accepted iff emitted
        best = p2.argmax(-1)                 # a bigram: the argmax after t is best[t] wherever t is
        assert torch.equal(first_accepted, toks[:, 1] == best[toks[:, 0]])
        # after a rejection the catch-up kept the correction's row: the next draft is right too
        again = ~first_accepted
        second = torch.tensor([r["spec"]["accepted_tokens"] for r in recs])[again]
        assert torch.equal(second == 1, toks[again, 2] == best[toks[again, 1]])
        assert accepted > n // 10 and int(second.sum()) > 100
    counts = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
    counts.index_put_((toks[:, 0], toks[:, 1]), torch.ones(n, dtype=torch.float64), accumulate=True)
    stat, dof = _chi2(counts, p1[:, None] * p2 * n)
    assert stat < _chi2_threshold(dof), ("first two", stat, dof)
    on = toks[:, 0] == g1
    m = int(on.sum())
    assert m > 200
    counts = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
    counts.index_put_((toks[on, 1], toks[on, 2]), torch.ones(m, dtype=torch.float64), accumulate=True)
    stat, dof = _chi2(counts, p2[g1][:, None] * p3 * m)
    assert stat < _chi2_threshold(dof), ("second and third after the top first token", stat, dof)


# ------------------------------------------------------------------------------------ GPU: one graph

def _gpu_rows(n=11, **overrides):
    lens = (5, 31, 12, 64, 3, 20, 47, 9, 15, 2, 38)
    g = torch.Generator().manual_seed(7)
    return [RowRequest(row=i, id=str(i), prompt_token_ids=torch.randint(1, VOCAB, (lens[i],), generator=g).tolist(),
                       overrides={"max_tokens": 12 + 5 * (i % 4), **overrides}) for i in range(n)]


def _gpu_run(model, spec, bs, graphs=True, rows=None, fused=None, profile=False, **defaults):
    eng = Engine(model, EngineOptions(batch_size=bs, device="cuda", dtype="float32", spec=spec,
                                      graphs=graphs, fused=fused, profile=profile))
    recs = sorted(eng.generate(rows or _gpu_rows(), SamplingDefaults(**defaults)), key=lambda r: r["row"])
    assert all(r["error"] is None for r in recs)
    return _ids(recs), [r["spec"] for r in recs], eng


def _graph_counts(eng):
    return {key: len(cap.graphs) for key, cap in eng.graphs._graphs.items()}


@pytest.mark.gpu
@pytest.mark.parametrize("drafter", ["eagle3", "nextn_mtp"])
@pytest.mark.parametrize("bs", [3, 10])
def test_gpu_fused_graph_equals_eager_greedy(drafter, bs, target, mtp_target, head):
    import specbatch.kernels as kernels

    model, spec = (target if drafter == "eagle3" else mtp_target), _n2(drafter, head)
    with kernels.torch_only():
        ref, ref_stats, eager = _gpu_run(model, spec, bs, graphs=False)
    assert eager.graphs is None
    got, stats, eng = _gpu_run(model, spec, bs)
    assert eng.fused and eng.graphs is not None and eng.capture_seconds > 0
    assert got == ref and stats == ref_stats
    counts = _graph_counts(eng)
    assert counts and set(counts.values()) == {1}, counts                 # ONE graph per (size, variant)
    assert {size for size, _ in counts} == set(eng.graphs.sizes)
    split, split_stats, eng3 = _gpu_run(model, spec, bs, fused=False)
    assert not eng3.fused and set(_graph_counts(eng3).values()) == {3}
    assert split == ref and split_stats == ref_stats


@pytest.mark.gpu
@pytest.mark.parametrize("drafter", ["eagle3", "nextn_mtp"])
def test_gpu_fused_graph_equals_eager_sampling(drafter, target, mtp_target, head):
    import specbatch.kernels as kernels

    model, spec = (target if drafter == "eagle3" else mtp_target), _n2(drafter, head)
    rows = _gpu_rows()
    rows[2].overrides["temperature"] = 0.0                               # a greedy row among sampled ones
    defaults = {"temperature": 0.8, "top_p": 0.9, "seed": 11}
    with kernels.torch_only():
        ref, _, _ = _gpu_run(model, spec, 4, graphs=False, rows=rows, **defaults)
    got, _, eng = _gpu_run(model, spec, 4, rows=rows, **defaults)
    assert got == ref
    counts = _graph_counts(eng)
    assert {v for _, v in counts} == {(True, False), (False, True)}
    assert set(counts.values()) == {1}, counts
    split, _, eng3 = _gpu_run(model, spec, 4, rows=rows, fused=False, **defaults)
    assert split == ref and set(_graph_counts(eng3).values()) == {3}


@pytest.mark.gpu
def test_gpu_exact_mtp_fused_graph_accepts_every_draft(bigram):
    ref, _, _ = _gpu_run(bigram, SpecConfig(), 4)
    got, stats, eng = _gpu_run(bigram, _n2("nextn_mtp"), 4)
    assert got == ref
    cycles = sum(s["verify_steps"] - 1 for s in stats)
    rejected = sum(s["accept_histogram"][0] for s in stats)
    assert cycles > 40 and rejected <= cycles // 20, (rejected, cycles)
    assert eng.fused and set(_graph_counts(eng).values()) == {1}


@pytest.mark.gpu
@pytest.mark.parametrize("drafter", ["eagle3", "nextn_mtp"])
def test_gpu_profile_of_the_fused_cycle(drafter, target, mtp_target, head):
    model, spec = (target if drafter == "eagle3" else mtp_target), _n2(drafter, head)
    _, _, eng = _gpu_run(model, spec, 4, rows=_gpu_rows(6), profile=True)
    assert eng.cycle_times
    for t in eng.cycle_times:
        assert t.draft_ms == 0.0 and t.extend_ms == 0.0                  # the whole cycle is one graph
        assert t.verify_ms > 0 and t.wall_ms >= t.verify_ms
    assert sum(c.tokens for c in eng.cycle_times) > 0
    _, _, eng3 = _gpu_run(model, spec, 4, rows=_gpu_rows(6), profile=True, fused=False)
    t = eng3.cycle_times[0]
    assert t.draft_ms > 0 and t.verify_ms > 0 and t.extend_ms > 0
