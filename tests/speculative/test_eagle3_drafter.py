"""The EAGLE3 drafter: the catch-up that computes only the used row (and writes every row's K/V),
and the drafter's tree / chain proposals against a beam search and a greedy chain built by hand."""
from __future__ import annotations

import copy

import pytest
import torch

from eagle3_helpers import CPU, H, V, Ref, causal_meta, head, head_dir, target  # noqa: F401
from specbatch.models.attention import AttnMetadata
from specbatch.runtime.kv_cache import KVCache
from specbatch.speculative.factory import SpecConfig, make_drafter
from specbatch.speculative.drafter import PromptRows
from specbatch.sampling import BatchSampling, SamplingParams
from specbatch.speculative import layer_drafter
from specbatch.speculative.layer_drafter import LayerDrafter


# ---- 1. catch-up computes only the used row (seed 003) ---------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("features", [True, False])
@pytest.mark.parametrize("pick", ["one_a_row", "some"])
def test_out_tokens_write_all_rows_and_return_the_used_ones(head, features, dtype, pick):
    """float64 shows the two ways compute the same thing (1e-12); float32 agrees to 1e-6 of the
    output's scale (outputs reach ~20 here, where one float32 ulp is ~2e-6)."""
    if dtype == torch.float64:
        head = copy.deepcopy(head).double()
    g = torch.Generator().manual_seed(3)
    B, T, num_slots, rows_per_slot = 3, 5, 4, 16
    slots = torch.tensor([3, 0, 1])
    prefix = torch.tensor([0, 3, 7])
    # (sequence, new token) pairs whose outputs go on: one per sequence, or any few
    seq, col = (torch.arange(B), torch.tensor([0, T - 1, 2])) if pick == "one_a_row" else (
        torch.tensor([2, 0]), torch.tensor([4, 1]))
    ids = torch.randint(0, V, (B, T), generator=g)
    hidden = torch.randn(B, T, 3 * H if features else H, generator=g, dtype=dtype)

    base = KVCache(head.cfg.layer, num_slots, rows_per_slot, dtype, CPU)
    for k, v in base.layers:
        k.copy_(torch.randn(k.shape, generator=g, dtype=dtype))
        v.copy_(torch.randn(v.shape, generator=g, dtype=dtype))
    full_kv = [t.clone() for t in base.layers[0]]
    sel_kv = [t.clone() for t in base.layers[0]]

    meta = causal_meta(slots, T, prefix)
    full = head(ids, hidden, meta, full_kv, features=features)
    sel = head(ids, hidden, meta, sel_kv, features=features, out_tokens=seq * T + col)
    assert full.shape == (B, T, H) and sel.shape == (len(seq), 1, H)

    # K/V: every row of every sequence written, identically to the full forward, nothing else touched
    for a, b, orig in zip(full_kv, sel_kv, base.layers[0]):
        assert torch.equal(a, b)
        written = torch.zeros(a.shape[:2], dtype=torch.bool)
        for i in range(B):
            written[slots[i], prefix[i]: prefix[i] + T] = True
        changed = (a != orig).flatten(2).any(-1)
        assert torch.equal(changed, written)

    tol = 1e-12 if dtype == torch.float64 else 1e-6 * float(full.abs().max())
    for i, (b, t) in enumerate(zip(seq.tolist(), col.tolist())):
        torch.testing.assert_close(sel[i, 0], full[b, t], atol=tol, rtol=0)

    # a later forward reading the cache sees the same thing whichever way it was written
    T2 = 2
    ids2 = torch.randint(0, V, (B, T2), generator=g)
    hidden2 = torch.randn(B, T2, 3 * H if features else H, generator=g, dtype=dtype)
    meta2 = causal_meta(slots, T2, prefix + T)
    after_full = head(ids2, hidden2, meta2, full_kv, features=features)
    after_sel = head(ids2, hidden2, meta2, sel_kv, features=features)
    assert torch.equal(after_full, after_sel)
    assert torch.equal(full_kv[0], sel_kv[0]) and torch.equal(full_kv[1], sel_kv[1])


def test_causal_write_offset_sees_own_row_like_select_tokens():
    T, off = 3, 2
    meta = AttnMetadata(slots=torch.tensor([0]), positions=torch.tensor([[5, 6, 7]]),
                        prefix_lens=torch.tensor([3]), kv_len=3 + off + T, write_offset=off)
    rows = meta.cache_rows()[0]
    vis = meta.visibility()[0]
    for t in range(T):
        assert vis[t, rows[t]], f"new token {t} does not see its own cache row {int(rows[t])}"
        assert torch.equal(vis[t], meta.select_tokens(torch.tensor([t])).visibility()[0, 0])


# ---- 2. drafter tree layout ------------------------------------------------------------------

PROMPTS = [[11, 47, 203, 5, 88], [3, 9, 150, 151, 77, 31, 260, 14]]


def _prefilled(target, head_dir, S, k, N, num_slots=3):
    drafter = make_drafter(SpecConfig("eagle3", S, k, N, draft=str(head_dir)), target, num_slots, 48)
    assert isinstance(drafter, LayerDrafter)
    B, T = len(PROMPTS), max(map(len, PROMPTS))
    ids = torch.zeros(B, T, dtype=torch.int64)
    for i, p in enumerate(PROMPTS):
        ids[i, : len(p)] = torch.tensor(p)
    lengths = torch.tensor([len(p) for p in PROMPTS])
    slots = torch.tensor([2, 0])
    cache = KVCache(target.cfg, num_slots, 48, torch.float32, CPU)
    meta = AttnMetadata(slots=slots, positions=torch.arange(T).expand(B, T),
                        prefix_lens=torch.zeros_like(slots), kv_len=T)
    hidden, captured = target(ids, meta, cache.layers, drafter.capture_layers)
    first = target.logits(hidden[torch.arange(B), lengths - 1]).argmax(-1)
    drafter.prefill(PromptRows.whole(slots, ids, lengths), captured, first)
    return drafter, slots, lengths, first, torch.cat(captured, -1)


def _ref_prefill(ref, b, lengths, first, feats):
    n = int(lengths[b])
    toks = torch.tensor(PROMPTS[b][1:] + [int(first[b])])
    return ref.layer(toks, feats[b, :n], True, torch.arange(n))


def _ref_tree(ref, b, lengths, first, feats, S, k, N):
    """Beam-search tree by hand. Returns (the paths of target ids of the best N-1 candidates,
    the K and V each draft step writes: [(S-1)*k, Hkv, d], beam node j of step s at (s-1)*k + j)."""
    n = int(lengths[b])
    h, K, Vv = _ref_prefill(ref, b, lengths, first, feats)
    logp = ref.logits(h[n - 1]).log_softmax(-1)
    lp, di = logp.topk(k)
    # beam entries: (path, score, hidden, k rows, v rows), best first
    beam = [((int(ref.to_target(di[j])),), float(lp[j]), h[n - 1], K, Vv) for j in range(k)]
    cands = [(p, s) for p, s, *_ in beam]
    scratch_k, scratch_v = [], []
    for s in range(1, S):
        children = []
        for path, score, hh, pk, pv in beam:
            out, kk, vv = ref.layer(torch.tensor([path[-1]]), hh[None], False,
                                    torch.tensor([n + s - 1]), pk, pv)
            scratch_k.append(kk[0])
            scratch_v.append(vv[0])
            lp, di = ref.logits(out[0]).log_softmax(-1).topk(k)
            for c in range(k):
                children.append((path + (int(ref.to_target(di[c])),), score + float(lp[c]), out[0],
                                 torch.cat([pk, kk]), torch.cat([pv, vv])))
        cands += [(c[0], c[1]) for c in children]
        beam = sorted(children, key=lambda c: -c[1])[:k]
    best = sorted(cands, key=lambda c: -c[1])[: N - 1]
    return {p for p, _ in best}, torch.stack(scratch_k), torch.stack(scratch_v)


def _paths(prop, b):
    out = set()
    toks, par = prop.tokens[b].tolist(), prop.parents[b].tolist()
    for i in range(1, len(toks)):
        path, j = [], i
        while j > 0:
            path.append(toks[j])
            j = par[j]
        out.add(tuple(reversed(path)))
    return out


@pytest.mark.parametrize("S,k,N", [(3, 2, 6), (3, 2, 9), (4, 2, 8), (4, 2, 15)])
def test_tree_proposal_layout_and_content(target, head_dir, S, k, N):
    drafter, slots, lengths, first, feats = _prefilled(target, head_dir, S, k, N)
    ref = Ref(head_dir, target.model.embed_tokens.weight)

    # first level = top-k of the head at the last prompt row, mapped through d2t
    for b in range(2):
        h, _, _ = _ref_prefill(ref, b, lengths, first, feats)
        want = ref.to_target(ref.logits(h[-1]).topk(k).indices)
        assert drafter.first_tokens[slots[b]].tolist() == want.tolist()
        torch.testing.assert_close(drafter.hidden[slots[b]], h[-1], atol=1e-5, rtol=1e-5)

    prop = drafter.propose(slots, first, lengths)
    B = 2
    assert prop.tokens.shape == prop.parents.shape == prop.depths.shape == (B, N)
    assert prop.tree_mask is not None and prop.tree_mask.shape == (B, N, N)
    assert torch.equal(prop.tokens[:, 0], first)
    for b in range(B):
        par, dep = prop.parents[b].tolist(), prop.depths[b].tolist()
        assert par[0] == -1 and dep[0] == 0
        for i in range(1, N):
            assert 0 <= par[i] < i
            assert dep[i] == dep[par[i]] + 1 <= S
        # ancestor mask, built by walking the parents
        mask = torch.zeros(N, N, dtype=torch.bool)
        for i in range(N):
            j = i
            while j >= 0:
                mask[i, j] = True
                j = par[j]
        assert torch.equal(prop.tree_mask[b], mask)
        # depth-1 nodes are first-level candidates; the best one is always node 1
        level1 = drafter.first_tokens[slots[b]].tolist()
        assert prop.tokens[b, 1].item() == level1[0]
        assert all(prop.tokens[b, i].item() in level1 for i in range(N) if dep[i] == 1)
        # the whole tree equals the hand-built beam search, and so do the draft K/V of every
        # beam node (positions, parents' hidden states and ancestor rows all enter these)
        paths, ref_k, ref_v = _ref_tree(ref, b, lengths, first, feats, S, k, N)
        assert _paths(prop, b) == paths
        assert len(paths) == N - 1
        n = int(lengths[b])
        kc, vc = drafter.cache.layers[0]
        torch.testing.assert_close(kc[slots[b], n: n + (S - 1) * k], ref_k, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(vc[slots[b], n: n + (S - 1) * k], ref_v, atol=1e-5, rtol=1e-5)
        if N - 1 > k + k * k:            # more nodes than two levels hold: the tree goes deeper
            assert max(dep) >= 3
        if N - 1 == k + (S - 1) * k * k:  # every candidate kept: the full beam tree
            assert max(dep) == S and sorted(dep).count(S) == k * k


@pytest.mark.parametrize("width,nodes", [(1, 2), (2, 2), (3, 3), (4, 4), (5, 5), (9, 5)])
def test_a_chain_verified_to_a_width_drafts_only_that_far(target, head_dir, width, nodes):
    """A cycle verifying `width` nodes of a chain gets at least min(width, N) nodes, the first
    ones of the full proposal, from width - 1 drafts (the first is made by extend)."""
    S = 4
    drafter, slots, lengths, first, _ = _prefilled(target, head_dir, S, 1, S + 1)
    full = drafter.propose(slots, first, lengths)
    calls = []
    real = drafter.head.forward
    drafter.head.forward = lambda *a, **kw: calls.append(1) or real(*a, **kw)
    part = drafter.propose(slots, first, lengths, width=width)
    assert part.tokens.shape == (2, nodes) and part.tree_mask is None
    assert len(calls) == nodes - 2                               # head steps after the first draft
    assert torch.equal(part.tokens, full.tokens[:, :nodes])
    assert torch.equal(part.parents, full.parents[:, :nodes]) and torch.equal(part.depths, full.depths[:, :nodes])


@pytest.mark.parametrize("width", [1, 2, 3, 6])
def test_a_tree_drafts_every_step_unless_verified_to_two_nodes(target, head_dir, width):
    """Widths above 2 need the whole tree (its best candidates, anywhere); a prefix of two nodes
    is the root and the best first-level candidate, which extend drafted: no head step runs."""
    drafter, slots, lengths, first, _ = _prefilled(target, head_dir, 3, 2, 6)
    full = drafter.propose(slots, first, lengths)
    calls = []
    real = drafter.head.forward
    drafter.head.forward = lambda *a, **kw: calls.append(1) or real(*a, **kw)
    part = drafter.propose(slots, first, lengths, width=width)
    if width > 2:
        assert torch.equal(part.tokens, full.tokens) and torch.equal(part.tree_mask, full.tree_mask)
        assert len(calls) == 2                                    # S - 1 beam steps
        return
    assert not calls
    want = full.prefix(width)
    assert torch.equal(part.prefix(width).tokens, want.tokens) and part.prefix(width).tree_mask is None
    assert torch.equal(part.prefix(width).parents, want.parents)
    assert torch.equal(part.prefix(width).depths, want.depths)


@pytest.mark.parametrize("S,k,N", [(3, 4, 8), (5, 4, 8), (3, 2, 6), (3, 4, 3)])
def test_a_sampled_trees_winners_chain_survives_a_draft_sure_of_another_token(target, head_dir, S, k, N, monkeypatch):
    """A sampled row whose draft puts log p 0.0 on A while the race picks B: A must not tie with
    the winner (topk may rank a tie first), so the beam's node 0 stays the winners' chain, the
    tree holds root -> B -> B ... as deep as N - 1 allows, and width 2 is the full tree's prefix."""
    drafter, slots, lengths, first, _ = _prefilled(target, head_dir, S, k, N)
    drafter.sample_as(slots, BatchSampling.build([SamplingParams(temperature=1.0, seed=1)] * 2, CPU))
    Vd = drafter.head.lm_head.weight.shape[0]

    def logits(h):                                  # every node: A = 5 certain (log p 0.0), B = 7 second
        x = torch.zeros(*h.shape[:-1], Vd)
        x[..., 5], x[..., 7] = 100.0, 1.0
        return x
    monkeypatch.setattr(drafter.head, "logits", logits)
    b_tok = int(drafter.head.to_target(torch.tensor(7)))
    monkeypatch.setattr(layer_drafter, "draw_target", lambda x, sp, pos, **_: torch.full((x.shape[0],), b_tok))
    drafter._keep(slots, drafter.hidden[slots].clone(), lengths + 2)
    full = drafter.propose(slots, first, lengths)
    for b in range(2):
        node = 0
        for _ in range(min(S, N - 1)):
            kids = [i for i in range(full.width) if full.parents[b, i] == node and full.tokens[b, i] == b_tok]
            assert kids, (full.tokens[b].tolist(), full.parents[b].tolist())
            node = kids[0]
    assert torch.equal(drafter.propose(slots, first, lengths, width=2).tokens, full.prefix(2).tokens)


@pytest.mark.interpreter
@pytest.mark.parametrize("k", [1, 3])
def test_the_race_reads_the_heads_own_vocabulary(target, head_dir, k, monkeypatch):
    """Draft ids in target-id order: on the kernel path the race draws over the head's own
    logits, keyed by target id, the tokens the target-wide row (-inf around them) gives."""
    import specbatch.kernels as kernels

    drafter, slots, _, _, _ = _prefilled(target, head_dir, 3, k, 4)
    assert drafter.target_ids is not None and drafter.increasing_ids
    drafter.sample_as(slots, BatchSampling.build([SamplingParams(temperature=0.9, top_p=0.8, seed=3),
                                                  SamplingParams(temperature=1.2, top_k=5, seed=4)], CPU))
    Vd = drafter.head.lm_head.weight.shape[0]
    g = torch.Generator().manual_seed(5)
    pos = torch.tensor([11, 23])
    monkeypatch.setattr(kernels, "active", lambda t: True)          # the Triton path, interpreted
    for _ in range(4):
        logits = torch.randn(2, Vd, generator=g) * 3
        logp, top = logits.log_softmax(-1).topk(k, dim=-1)
        top = drafter.head.to_target(top)
        got = drafter._drafts(slots, logits, top, logp, pos)
        drafter.increasing_ids = False                              # the target-wide row
        want = drafter._drafts(slots, logits, top, logp, pos)
        drafter.increasing_ids = True
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        pos = pos + 1


def test_chain_proposal_equals_greedy_by_hand(target, head_dir):
    S = 3
    drafter, slots, lengths, first, feats = _prefilled(target, head_dir, S, 1, S + 1)
    prop = drafter.propose(slots, first, lengths)
    assert prop.tree_mask is None
    assert prop.tokens.shape == (2, S + 1)
    assert prop.parents.tolist() == [[-1, 0, 1, 2]] * 2
    assert prop.depths.tolist() == [[0, 1, 2, 3]] * 2
    assert torch.equal(prop.tokens[:, 0], first)

    head = drafter.head
    for b in range(2):
        n = int(lengths[b])
        cache = KVCache(head.cfg.layer, 1, 32, torch.float32, CPU)
        one = torch.tensor([0])
        toks = torch.tensor([PROMPTS[b][1:] + [int(first[b])]])
        h = head(toks, feats[b: b + 1, :n], causal_meta(one, n), cache.layers[0], features=True)[:, -1:]
        chain = [int(first[b])]
        for s in range(S):
            draft = head.to_target(head.logits(h[0, 0]).argmax())
            chain.append(int(draft))
            if s == S - 1:
                break
            h = head(draft.view(1, 1), h, causal_meta(one, 1, torch.tensor([n + s])), cache.layers[0],
                     features=False)
        assert prop.tokens[b].tolist() == chain, b
        # the draft cache: prompt rows from the prefill, then one scratch row per draft step
        for mine, theirs in zip(cache.layers[0], drafter.cache.layers[0]):
            torch.testing.assert_close(theirs[slots[b], : n + S - 1], mine[0, : n + S - 1],
                                       atol=1e-5, rtol=1e-5)
