"""Host time per cycle of the job loop's parts, for greedy rows, rows with processors (logit_bias +
min_tokens) and seeded sampled rows: Llama-3.1-8B shapes, random weights, vanilla, 512 slots.

    python benchmarks/host_probe.py [greedy] [procs] [sampled]
    SAMPLER=sort python benchmarks/host_probe.py sampled    # filter by the torch sort, then softmax and draw
    SAMPLER=radix python benchmarks/host_probe.py sampled   # filter by kernels/top_k_top_p.py, then the same
    SAMPLER=prescaled python benchmarks/host_probe.py sampled   # the fused draw on float32 logits / t made first
(default: kernels/filtered_draw.py, the filters and the draw in one kernel)
    MIDJOB_COLLECT=1 python benchmarks/host_probe.py sampled  # collect garbage before mid-job captures too
(the first run of a kind captures its graph variant at every size at its first cycle)
"""
import collections, os, sys, time, torch
from specbatch.bench.sources import BenchOptions, load_source, build_engine
from specbatch.engine import EngineOptions
from specbatch.data import RowRequest
from specbatch.recipe import SamplingDefaults

if os.environ.get("SAMPLER") == "prescaled":
    import specbatch.kernels.filtered_draw as fd
    fused = fd.draw_filtered
    fd.draw_filtered = lambda x, k, p, keys, t=None, find_kth=True, ids=None: fused(
        x.float() / (1.0 if t is None else t[:, None]), k, p, keys, find_kth=find_kth, ids=ids)
elif os.environ.get("SAMPLER", "fused") != "fused":
    import specbatch.kernels as kernels, specbatch.kernels.top_k_top_p as tkp, specbatch.kernels.filtered_draw as fd
    from specbatch.kernels.draw import draw_race
    from specbatch.sampling import apply_top_k_top_p

    def sort_filter(x, k, p, find_kth=True):
        with kernels.torch_only():
            return apply_top_k_top_p(x, k, p)
    if os.environ["SAMPLER"] == "sort":
        tkp.top_k_top_p = sort_filter
    def raced(x, k, p, keys, t=None, find_kth=True, ids=None):
        tok = draw_race(apply_top_k_top_p(x.float() / (1.0 if t is None else t[:, None]), k, p, find_kth)
                        .softmax(dim=-1), keys)
        return tok if ids is None else ids[tok]          # a compact draft row: its columns' vocabulary ids
    fd.draw_filtered = raced

if os.environ.get("MIDJOB_COLLECT") == "1":
    import specbatch.engine.graphs as graphs
    always = graphs._no_collection
    graphs._no_collection = lambda collect=True: always(True)

src = load_source(BenchOptions(random_weights="llama-3.1-8b", device="cuda"), torch.device("cuda"))
eng = build_engine(EngineOptions(device="cuda", max_model_len=2048, profile=True), src, None)
spent = collections.Counter()

def timed(obj, name, key):
    f = getattr(obj, name)
    def wrap(*a, **k):
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            spent[key] += time.perf_counter() - t
    setattr(obj, name, wrap)

for obj, name in ((eng.cycle, "_fill"), (eng.cycle, "launch"), (eng.cycle, "finish"), (eng, "_grow"), (eng, "_admit"),
                  (eng, "_prefill"), (eng.cycle, "_graph_variant")):
    timed(obj, name, name)

def rows(kind):
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(1024):
        o = int(torch.randint(50, 400, (1,), generator=g))
        f = {"max_tokens": o}
        if kind == "procs":
            f.update(max_tokens=4 * o, min_tokens=o - 1, ignore_eos=False, logit_bias={"128001": 100.0})
        if kind == "sampled":
            f.update(temperature=0.8, top_p=0.95, seed=i)
        out.append(RowRequest(row=i, id=i, prompt_token_ids=torch.randint(0, 128000, (200,), generator=g).tolist(),
                              overrides=f))
    return out

for kind in sys.argv[1:] or ("greedy", "procs", "sampled"):
    for rep in range(2):
        spent.clear(); eng.reset_profile()
        torch.cuda.synchronize(); t = time.perf_counter()
        recs = list(eng.generate(rows(kind), SamplingDefaults(ignore_eos=True, temperature=0.0, repetition_penalty=1.0)))
        wall = time.perf_counter() - t
        n = len(eng.cycle_times)
        gpu = sum(c.draft_ms + c.verify_ms + c.extend_ms for c in eng.cycle_times) / 1e3
        print(f"{kind} rep{rep}: wall {wall:.2f}s prefill {eng.prefill_s:.2f}s cycles {n} gpu {gpu:.2f}s "
              f"tokens {sum(r['completion_tokens'] for r in recs)} errors {sum(r['error'] is not None for r in recs)} | host ms/cycle: "
              + " ".join(f"{k} {1e3 * v / max(n, 1):.2f}" for k, v in sorted(spent.items())), flush=True)
