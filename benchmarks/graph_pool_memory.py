"""Where GPU memory goes: the CUDA graphs' private pools after the engine's capture, and after a
job of 1,536 rows (100-token prompts, 4-300 output tokens: occupancy varies) whose rows carry
processors (logit_bias + min_tokens) or not; Llama-3.1-8B shapes, random weights, vanilla.

    python benchmarks/graph_pool_memory.py MAX_MODEL_LEN procs|plain
"""
import sys, time, torch
from specbatch.bench.sources import BenchOptions, load_source, build_engine
from specbatch.engine import EngineOptions
from specbatch.data import RowRequest
from specbatch.recipe import SamplingDefaults

def gib(x): return f"{x / 2**30:.2f}"
def mem(tag):
    segs = torch.cuda.memory_snapshot()
    priv = sum(s["total_size"] for s in segs if tuple(s.get("segment_pool_id", (0, 0))) != (0, 0))
    priv_used = sum(s["allocated_size"] for s in segs if tuple(s.get("segment_pool_id", (0, 0))) != (0, 0))
    print(f"{tag}: allocated {gib(torch.cuda.memory_allocated())} reserved {gib(torch.cuda.memory_reserved())} "
          f"private pools {gib(priv)} (live {gib(priv_used)}) free {gib(torch.cuda.mem_get_info()[0])}", flush=True)

max_len, procs = int(sys.argv[1]), sys.argv[2] == "procs"
opts = BenchOptions(random_weights="llama-3.1-8b", device="cuda")
src = load_source(opts, torch.device("cuda"))
mem("weights")
eng = build_engine(EngineOptions(device="cuda", max_model_len=max_len), src, None)
print("max_len", max_len, "slots", eng.num_slots, "pages", eng.num_pages, flush=True)
mem("engine")
g = torch.Generator().manual_seed(0)
kw = {"logit_bias": {"128001": 100.0}, "ignore_eos": False} if procs else {}
rows = []
for i in range(1536):
    o = int(torch.randint(4, 300, (1,), generator=g))
    extra = {**kw, "min_tokens": o - 1} if procs else {}
    rows.append(RowRequest(row=i, id=i, prompt_token_ids=torch.randint(0, 128000, (100,), generator=g).tolist(),
                           overrides={"max_tokens": o, **extra}))
t = time.time()
recs = list(eng.generate(rows, SamplingDefaults(ignore_eos=True, temperature=0.0, repetition_penalty=1.0)))
print("errors", sum(r["error"] is not None for r in recs), f"{time.time() - t:.1f}s", eng.failure_counts.facts(), flush=True)
mem("after job")
print("graphs", len(eng.graphs._graphs), flush=True)
