"""The input/output costs of a large job on the CPU, phase by phase: opening the input (a compressed
JSONL's decompression), a resume's writer open and input check, the job's pass over the input that
skips committed rows, and the final merge of the parts.

    python benchmarks/io_costs.py build DIR [--rows 1000000] [--done 838000] [--part-rows 1024] [--like OUT]
    python benchmarks/io_costs.py measure DIR [--only jsonl,zst,parquet] [--profile]

`build` writes DIR/in.jsonl, DIR/in.jsonl.zst and DIR/in.parquet (short prompt rows, an id each)
and, for the JSONL and the Parquet input, an output whose parts hold the first `--done` rows as
the writer commits them (records of the demo model's shape with their input rows' digests; rows
shuffled within windows of 4096, as a --workers job's parts hold them). `--like OUT`: take the job
fingerprint and contexts from a finished output OUT (`specbatch run ... --limit 1 -o OUT`), so that
`specbatch run DIR/in.jsonl -o DIR/out-jsonl.parquet` with the same flags resumes the built output.
`measure` times each phase on copies of those outputs (the merge consumes its parts directory).
"""
from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import random
import shutil
import sys
import time

import pyarrow as pa
import pyarrow.parquet as pq

from specbatch.data import OutputWriter, check_input, open_rows
from specbatch.data.files import file_hash
from specbatch.row_notes import RepeatedIds

FP = {"recipe": "vanilla", "model": "bench", "sampling": {"max_tokens": 1}}


def _record(row: int, rid: str) -> dict:
    return {"row": row, "id": rid, "completion": str(row % 10), "prompt_tokens": 8, "completion_tokens": 1,
            "finish_reason": "length", "stop_reason": None, "error": None,
            "spec": {"verify_steps": 1, "draft_tokens": 0, "accepted_tokens": 0, "accept_length": 1.0,
                     "accept_histogram": [0]}}


def _like(path: str | None) -> tuple[dict, list[int]]:
    if path is None:
        return FP, []
    stored = json.loads(pq.read_schema(path).metadata[b"specbatch.manifest"])
    return stored["fingerprint"], stored.get("contexts", [])


def build(d: str, rows: int, done: int, part_rows: int, like: str | None) -> None:
    os.makedirs(d, exist_ok=True)
    t0 = time.perf_counter()
    ids = [f"q{i}" for i in range(rows)]
    with open(os.path.join(d, "in.jsonl"), "w") as f:
        for i, rid in enumerate(ids):
            f.write(json.dumps({"id": rid, "prompt": f"What is {i} plus {i % 97}? Answer in one word."}) + "\n")
    with open(os.path.join(d, "in.jsonl"), "rb") as src, \
            pa.output_stream(os.path.join(d, "in.jsonl.zst"), compression="zstd") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
    pq.write_table(pa.Table.from_pylist([{"id": rid, "prompt": f"What is {i} plus {i % 97}? Answer in one word."}
                                         for i, rid in enumerate(ids)]), os.path.join(d, "in.parquet"))
    print(f"inputs: {time.perf_counter() - t0:.1f} s", flush=True)
    fp, contexts = _like(like)
    order = list(range(done))
    rng = random.Random(0)
    for lo in range(0, done, 4096):
        window = order[lo:lo + 4096]
        rng.shuffle(window)
        order[lo:lo + 4096] = window
    for kind, inp in (("jsonl", "in.jsonl"), ("parquet", "in.parquet")):
        t0 = time.perf_counter()
        digests = {}
        for item in open_rows(os.path.join(d, inp)).digested():
            if item.row >= done:
                break
            digests[item.row] = item.digest
        out = os.path.join(d, f"out-{kind}.parquet")
        for p in (out, out + ".parts"):
            shutil.rmtree(p, ignore_errors=True)
        w = OutputWriter(out, fingerprint=fp, commit_rows=part_rows)
        if contexts:                        # named in the manifest with the first part, as a job does
            w.set_context(contexts[0])
        for r in order:
            w.add(_record(r, ids[r]), digests[r])
        w.commit()
        w.close()
        print(f"{out}.parts: {len(os.listdir(out + '.parts')) - 1} parts, {time.perf_counter() - t0:.1f} s",
              flush=True)


def _timed(name: str, fn, profile: bool):
    t0 = time.perf_counter()
    prof = cProfile.Profile() if profile else None
    if prof:
        prof.enable()
    out = fn()
    if prof:
        prof.disable()
    print(f"  {name:<34} {time.perf_counter() - t0:7.2f} s", flush=True)
    if prof:
        pstats.Stats(prof, stream=sys.stdout).sort_stats("cumulative").print_stats(14)
    return out


def measure(d: str, only: list[str], profile: bool) -> None:
    fp = _like(os.path.join(d, "like.parquet") if os.path.exists(os.path.join(d, "like.parquet")) else None)[0]
    for kind in only:
        inp = {"jsonl": "in.jsonl", "zst": "in.jsonl.zst", "parquet": "in.parquet"}[kind]
        state = os.path.join(d, f"out-{'parquet' if kind == 'parquet' else 'jsonl'}.parquet")
        path = os.path.join(d, inp)
        print(f"{inp} ({os.path.getsize(path) / 1e6:.1f} MB), output {os.path.basename(state)}.parts")
        out = os.path.join(d, "work.parquet")
        for p in (out, out + ".parts", out + ".lock"):
            shutil.rmtree(p, ignore_errors=True) if os.path.isdir(p) else os.path.lexists(p) and os.remove(p)
        shutil.copytree(state + ".parts", out + ".parts")
        source = _timed("open_rows (count)", lambda: open_rows(path), profile)
        w = _timed("OutputWriter open (resume)", lambda: OutputWriter(out, fingerprint=fp), profile)
        done = w.done_rows
        exp = _timed("writer.expected()", w.expected, profile)
        _timed("check_input (digested)", lambda: check_input(source.digested(), exp, input_name=inp, output=out),
               profile)

        def second_pass(limit: int | None = None) -> int:     # what job._generate's todo() does
            ids, left = RepeatedIds(), 0
            for r in source.skipping(done) if hasattr(source, "skipping") else source:
                if limit is not None and r.row >= limit:
                    break
                ids.add(r)
                left += r.row not in done
            return left
        _timed("job pass, committed rows only", lambda: second_pass(done.max() + 1), profile)
        left = _timed("job pass over the input", second_pass, profile)
        rows = _timed("finalize (merge)", w.finalize, profile)
        w.close()
        print(f"  rows {source.total}, committed {len(done)}, left {left}, merged {rows}, "
              f"output {os.path.getsize(out) / 1e6:.1f} MB, blake2b {file_hash(out)[1]}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("dir")
    b.add_argument("--rows", type=int, default=1_000_000)
    b.add_argument("--done", type=int, default=838_000)
    b.add_argument("--part-rows", type=int, default=1024)
    b.add_argument("--like")
    m = sub.add_parser("measure")
    m.add_argument("dir")
    m.add_argument("--only", default="jsonl,zst,parquet")
    m.add_argument("--profile", action="store_true")
    a = ap.parse_args()
    if a.cmd == "build":
        if a.like:
            shutil.copy(a.like, os.path.join(a.dir, "like.parquet")) if os.path.isdir(a.dir) else None
        build(a.dir, a.rows, a.done, a.part_rows, a.like)
        if a.like and not os.path.exists(os.path.join(a.dir, "like.parquet")):
            shutil.copy(a.like, os.path.join(a.dir, "like.parquet"))
    else:
        measure(a.dir, a.only.split(","), a.profile)


if __name__ == "__main__":
    main()
