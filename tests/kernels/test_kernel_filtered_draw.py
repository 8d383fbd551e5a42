"""The filtered draw (kernels/filtered_draw.py) against its reference, the torch race over the
softmax of the stable-sort top-k / top-p filter: the same token for every row, with ties at either
threshold, -inf entries, rows with one, both or neither filter and top_p small enough to reject
the first winners. CPU runs go through the Triton interpreter at small sizes; `-m gpu` runs real
vocabularies and a CUDA graph, where a differing token must be explained by rounding: an entry
whose exclusive mass is within 1e-5 of top_p, or two race scores within 1e-5 of each other."""
from __future__ import annotations

import pytest
import torch

import specbatch.kernels as kernels
from specbatch.kernels.filtered_draw import draw_filtered
import specbatch.kernels.top_k_top_p as tkp
from specbatch.params import SamplingParams
from specbatch.sampling import BatchSampling, apply_top_k_top_p, draw, draw_target, row_keys, uniforms
from specbatch.speculative.accept import accept

NEG = float("-inf")


def _case(R: int, V: int, seed: int, device, scale: float = 3.0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(R, V, generator=g) * scale).to(torch.bfloat16).float()     # bf16 values: many ties
    if R > 2:
        x[2, : V // 3] = NEG                                                   # min-p masked entries
    if R > 3:
        x[3] = 0.25                                                           # one value: ties everywhere
    ks = ([0, 1, 5, 40, 0, 7, 3, V + 5] + torch.randint(0, 90, (R,), generator=g).tolist())[:R]
    ps = ([0.9, 1.0, 0.5, 0.3, 0.05, 0.999, 1.0, 0.02] + torch.rand(R, generator=g).clamp(min=0.01).tolist())[:R]
    sp = BatchSampling.build([SamplingParams(temperature=1.0, top_k=k, top_p=p, seed=seed * 1000 + i)
                              for i, (k, p) in enumerate(zip(ks, ps))], torch.device(device))
    pos = torch.arange(R, device=device) * 7 + 3
    return x.to(device), sp, pos


def _reference(x, sp, pos):
    with kernels.torch_only():
        return draw(apply_top_k_top_p(x, sp.top_k, sp.top_p).softmax(dim=-1), sp, pos)


def _explained(x, sp, pos, r: int, a: int, b: int, tol: float = 1e-5) -> bool:
    """Whether tokens a and b of row r may differ by rounding alone (float64 reference)."""
    xs, order = x[r].double().sort(descending=True, stable=True)
    k, p = int(sp.top_k[r]), float(sp.top_p[r])
    if 0 < k < xs.numel():
        xs[k:] = NEG
    probs = xs.softmax(dim=0)
    excl = torch.empty_like(probs)
    excl[order] = probs.cumsum(0) - probs
    if any(abs(float(excl[t]) - p) < tol for t in (a, b)):
        return True
    u = uniforms(row_keys(sp.seed_lo, sp.seed_hi, pos)[r: r + 1].cpu(), x.shape[1])[0].double()
    e = (x[r].double() - x[r].max().double()).exp().cpu()
    score = e / -u.log()
    return abs(float(score[a] / score[b]) - 1.0) < tol


@pytest.mark.interpreter
@pytest.mark.parametrize("kcap", [0, tkp.KCAP])          # 0: every top-k by the radix descent
@pytest.mark.parametrize("R, V, seed", [(12, 700, 0), (12, 1024, 1), (9, 257, 2), (2, 33, 3)])
def test_interpreted_filtered_draw_equals_the_reference(R, V, seed, kcap, monkeypatch):
    monkeypatch.setattr(tkp, "KCAP", kcap)
    for scale in (0.3, 3.0):
        x, sp, pos = _case(R, V, seed, "cpu", scale)
        keys = row_keys(sp.seed_lo, sp.seed_hi, pos)
        assert draw_filtered(x, sp.top_k, sp.top_p, keys).tolist() == _reference(x, sp, pos).tolist()


@pytest.mark.interpreter
@pytest.mark.parametrize("R, V, seed", [(12, 700, 0), (12, 1024, 1), (9, 257, 2), (2, 33, 3)])
def test_interpreted_top_k_rows_draw_from_the_candidates_alone(R, V, seed, monkeypatch):
    """A row whose top-k set lies among torch.topk's KCAP candidates reads nothing else: with the
    kernel handed the candidates of the true logits but a row of noise to read, such rows still
    draw the reference's token; rows whose ties at the k-th logit reach past the candidates (or
    with k = KCAP, or no top-k) read the row, and so draw from the noise."""
    import specbatch.kernels.filtered_draw as fd

    for scale in (0.3, 3.0):
        x, sp, pos = _case(R, V, seed, "cpu", scale)
        keys = row_keys(sp.seed_lo, sp.seed_hi, pos)
        true = tkp.top_candidates(x, sp.top_k)
        monkeypatch.setattr(fd, "top_candidates", lambda *_a, **_k: true)
        noise = torch.randn(R, V, generator=torch.Generator().manual_seed(seed + 99)) * 3
        got = draw_filtered(noise, sp.top_k, sp.top_p, keys)
        monkeypatch.undo()
        want = _reference(x, sp, pos)
        vals = true[1]
        k = sp.top_k
        # eligible: 0 < k < V, k <= KCAP, and the smallest candidate below the k-th (or all V taken)
        eligible = [0 < int(k[r]) < V and int(k[r]) <= vals.shape[1] and
                    (vals.shape[1] >= V or float(vals[r, -1]) < float(vals[r, int(k[r]) - 1])) for r in range(R)]
        assert any(eligible) and not all(eligible)
        for r in range(R):
            if eligible[r]:
                assert int(got[r]) == int(want[r]), r


@pytest.mark.interpreter
@pytest.mark.parametrize("kcap", [0, tkp.KCAP])
@pytest.mark.parametrize("R, Vd, V, seed", [(12, 300, 1100, 0), (9, 257, 700, 2), (12, 80, 2500, 4)])
def test_interpreted_compact_rows_draw_as_their_full_layout(R, Vd, V, seed, kcap, monkeypatch):
    """A draft head's logits over its own vocabulary (columns `ids` of the target's, increasing)
    draw the token the target-wide row (-inf elsewhere) draws, without building it, as vocabulary
    ids: through the kernel (interpreted) and through draw_target on either path."""
    monkeypatch.setattr(tkp, "KCAP", kcap)
    real = kernels.active
    g = torch.Generator().manual_seed(seed)
    ids = torch.randperm(V, generator=g)[:Vd].sort().values
    for scale in (0.3, 3.0):
        x, sp, pos = _case(R, Vd, seed, "cpu", scale)
        full = x.new_full((R, V), NEG).index_copy_(1, ids, x)
        keys = row_keys(sp.seed_lo, sp.seed_hi, pos)
        t = torch.rand(R, generator=g) + 0.5
        want = draw_filtered(full, sp.top_k, sp.top_p, keys, t)
        got = draw_filtered(x, sp.top_k, sp.top_p, keys, t, ids=ids)
        assert got.tolist() == want.tolist()
        assert set(got.tolist()) <= set(ids.tolist())
        sp.temperature = t
        ref = draw_target(full, sp, pos)                  # CPU: the torch reference over the full row
        assert draw_target(x, sp, pos, ids=ids, vocab=V).tolist() == ref.tolist()
        monkeypatch.setattr(kernels, "active", lambda _t: True)
        assert draw_target(x, sp, pos, ids=ids, vocab=V).tolist() == draw_target(full, sp, pos).tolist()
        monkeypatch.setattr(kernels, "active", real)


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_interpreted_filtered_draw_scales_as_it_reads(dtype):
    # the kernel reads the logits in their own dtype and divides by the temperature as it goes:
    # the same tokens as on logits.float() / t computed first (what sampling.scaled does)
    x, sp, pos = _case(12, 500, 5, "cpu")
    x = x.to(dtype)
    t = torch.tensor([0.3, 0.7, 1.0, 1.9, 0.05, 3.0, 1.0, 0.5, 1.1, 2.5, 0.9, 0.01])
    keys = row_keys(sp.seed_lo, sp.seed_hi, pos)
    want = draw_filtered(x.float() / t[:, None], sp.top_k, sp.top_p, keys)
    assert draw_filtered(x, sp.top_k, sp.top_p, keys, t).tolist() == want.tolist()


def test_draw_target_uses_the_kernel_only_on_cuda():
    x, sp, pos = _case(6, 300, 4, "cpu")
    assert not kernels.active(x)
    assert draw_target(x, sp, pos).tolist() == _reference(x, sp, pos).tolist()


@pytest.mark.interpreter
def test_batches_without_top_k_skip_the_kth_search(monkeypatch):
    """BatchSampling.any_top_k (a host fact) decides whether the draw asks torch.topk for k-th
    logits; a batch flagged without top-k still filters a top-k row right (by the descent)."""
    import specbatch.kernels.filtered_draw as fd

    finds = []
    real = fd.top_candidates
    monkeypatch.setattr(fd, "top_candidates", lambda x, k, find=True: finds.append(find) or real(x, k, find))
    monkeypatch.setattr(kernels, "active", lambda t: True)
    x, sp, pos = _case(8, 300, 5, "cpu")
    want = _reference(x, sp, pos)
    assert sp.any_top_k and draw_target(x, sp, pos).tolist() == want.tolist() and finds == [True]
    sp.any_top_k = False
    assert draw_target(x, sp, pos).tolist() == want.tolist() and finds == [True, False]
    no_k = BatchSampling.build([SamplingParams(temperature=0.7, top_p=0.8), SamplingParams(top_k=20)],
                               torch.device("cpu"))
    assert not no_k.any_top_k and not no_k.repeat_rows(3).any_top_k         # a greedy row's top_k is moot


def _tree_case(B: int, V: int, seed: int, device: str):
    """Logits [B, 5, V] at the nodes of a tree root -> {1, 2}, 1 -> 3 -> 4, rows of every sampling
    kind (greedy, top-k, top-p, min-p, none), drafts that are each node's argmax for some rows."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(B, 5, V, generator=g) * 3).to(device)
    kinds = [(0.8, 0, 0.9, 0.0), (0.0, 5, 0.5, 0.0), (1.3, 7, 1.0, 0.0), (0.5, 0, 0.3, 0.1), (1.0, 0, 1.0, 0.0),
             (0.0, 0, 1.0, 0.0)]
    params = [SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m, seed=50 + i)
              for i, (t, k, p, m) in ((i, kinds[i % len(kinds)]) for i in range(B))]
    sp = BatchSampling.build(params, torch.device(device))
    parents = torch.tensor([[-1, 0, 0, 1, 3]], device=device).expand(B, 5)
    node_tokens = torch.randint(0, V, (B, 5), generator=g).to(device)
    am = x.argmax(dim=-1)
    lucky = torch.arange(B, device=device) // 6 % 2 == 0          # half the rows: drafts the target likes
    node_tokens[:, 1] = torch.where(lucky, am[:, 0], node_tokens[:, 1])
    node_tokens[:, 3] = torch.where(lucky, am[:, 1], node_tokens[:, 3])
    node_tokens[:, 4] = torch.where(lucky, am[:, 3], node_tokens[:, 4])
    start = (torch.arange(B) * 11 + 4).to(device)
    return x, sp, node_tokens, parents, start, params


@pytest.mark.interpreter
def test_sampled_acceptance_takes_the_fused_draw(monkeypatch):
    # accept's draws on the kernel, which the interpreter runs on CPU tensors once `active` says so:
    # the same tokens, counts and paths as the torch draws, drafts accepted at every depth
    x, sp, node_tokens, parents, start, _ = _tree_case(12, 300, 9, "cpu")
    want = accept(node_tokens, parents, x, sp, start, 3)
    assert set(want.num.tolist()) >= {1, 2, 4}
    monkeypatch.setattr(kernels, "active", lambda t: True)
    got = accept(node_tokens, parents, x, sp, start, 3)
    assert torch.equal(got.tokens, want.tokens) and torch.equal(got.num, want.num)
    assert torch.equal(got.path, want.path)


@pytest.mark.gpu
def test_cuda_sampled_tree_acceptance_equals_the_cpu():
    # the walk's tokens are the nodes' draws: where a CUDA draw differs from the CPU's, only by the
    # float32 rounding at the top_p boundary the draw tests above allow (rare: none expected here)
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    x, sp, node_tokens, parents, start, params = _tree_case(96, 32000, 3, "cpu")
    want = accept(node_tokens, parents, x, sp, start, 3)
    cuda = lambda t: t.cuda()                                                    # noqa: E731
    got = accept(cuda(node_tokens), cuda(parents), cuda(x), BatchSampling.build(params, torch.device("cuda")),
                 cuda(start), 3)
    same = (got.num.cpu() == want.num) & (got.tokens.cpu() == want.tokens).all(dim=1)
    assert int(same.sum()) >= 95 and set(want.num.tolist()) >= {1, 2, 4}


@pytest.mark.gpu
@pytest.mark.parametrize("kcap", [0, tkp.KCAP])
@pytest.mark.parametrize("R, V", [(1, 128256), (64, 128256), (512, 128256), (9, 32000), (300, 151936)])
def test_cuda_filtered_draw_equals_the_reference(R, V, kcap, monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    monkeypatch.setattr(tkp, "KCAP", kcap)
    unexplained, differ = [], 0
    for seed in range(3):
        for scale in (0.5, 3.0, 12.0):
            x, sp, pos = _case(R, V, seed, "cuda", scale)
            got = draw_filtered(x, sp.top_k, sp.top_p, row_keys(sp.seed_lo, sp.seed_hi, pos))
            ref = _reference(x, sp, pos)
            for r in (got != ref).nonzero()[:, 0].tolist():
                differ += 1
                if not _explained(x, sp, pos, r, int(got[r]), int(ref[r])):
                    unexplained.append((seed, scale, r, int(got[r]), int(ref[r])))
    assert not unexplained and differ <= max(1, R // 32), (differ, unexplained)


@pytest.mark.gpu
def test_cuda_filtered_draw_scales_as_it_reads():
    # bf16 logits read in place and divided by the temperature in the kernel (div.rn): the tokens
    # of the same kernel on logits.float() / t computed by torch first, bit for bit
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    x, sp, pos = _case(256, 128256, 4, "cuda")
    x = x.to(torch.bfloat16)
    t = torch.rand(256, generator=torch.Generator().manual_seed(1)).mul(2.0).add(0.05).cuda()
    keys = row_keys(sp.seed_lo, sp.seed_hi, pos)
    want = draw_filtered(x.float() / t[:, None], sp.top_k, sp.top_p, keys)
    assert torch.equal(draw_filtered(x, sp.top_k, sp.top_p, keys, t), want)


@pytest.mark.gpu
def test_cuda_filtered_draw_replays_in_a_graph():
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    x, sp, pos = _case(64, 128256, 7, "cuda")
    keys = row_keys(sp.seed_lo, sp.seed_hi, pos)
    first = draw_filtered(x, sp.top_k, sp.top_p, keys)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        got = draw_filtered(x, sp.top_k, sp.top_p, keys)
    x.copy_(_case(64, 128256, 8, "cuda")[0])
    g.replay()
    assert torch.equal(got, draw_filtered(x, sp.top_k, sp.top_p, keys))
    assert not torch.equal(got, first)


@pytest.mark.interpreter
@pytest.mark.parametrize("V", [10, 64, 100])
def test_interpreted_rows_without_a_finite_max_draw_as_the_full_read(V, monkeypatch):
    """A row of -inf (or whose largest entry is NaN or +inf) has no race winner among the top-k
    candidates: it reads its row, and draws the full read's token (0, as torch's argmax over NaN
    probabilities), not 2**31 - 1; with `ids`, not a read past them."""
    x = torch.full((4, V), NEG)
    x[1, 3], x[2, 5:] = float("nan"), 0.5
    x[3, 2], x[3, 7] = float("inf"), 1.0
    sp = BatchSampling.build([SamplingParams(temperature=1.0, top_k=3, top_p=p, seed=i)
                              for i, p in enumerate([1.0, 0.5, 1.0, 0.9])], torch.device("cpu"))
    keys = row_keys(sp.seed_lo, sp.seed_hi, torch.arange(4))
    ids = torch.arange(V) * 3 + 1
    got = draw_filtered(x, sp.top_k, sp.top_p, keys)
    compact = draw_filtered(x, sp.top_k, sp.top_p, keys, ids=ids)
    monkeypatch.setattr(tkp, "KCAP", 0)
    want = draw_filtered(x, sp.top_k, sp.top_p, keys)
    assert got.tolist() == want.tolist()
    assert compact.tolist() == ids[want].tolist()
