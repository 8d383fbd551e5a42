"""Shared by the output-writer tests (tests/data/test_data_writer_*.py): a job fingerprint, the
standard columns, a record per row, the committed part files, and a finished output read back."""
from __future__ import annotations

import json
import os
import re

import pyarrow as pa
import pyarrow.parquet as pq


FP = {"input": "in.jsonl", "recipe": "vanilla", "model": "m", "sampling": {"temperature": 0.0}}
STANDARD = ["row", "id", "completion", "prompt_tokens", "completion_tokens", "finish_reason", "stop_reason",
            "error", "spec"]


def rec(row, **extra):
    r = {
        "row": row,
        "id": f"id{row}",
        "completion": f"text {row} ü",
        "prompt_tokens": 3,
        "completion_tokens": row + 1,
        "finish_reason": "stop" if row % 2 else "length",
        "error": None,
        "spec": {"verify_steps": 2, "draft_tokens": 6, "accepted_tokens": 4, "accept_length": 2.5,
                 "accept_histogram": [0, 1, 1]},
    }
    r.update(extra)
    return r


def parts(path):
    """Part names without their writer token, in commit order."""
    d = str(path) + ".parts"
    names = [re.sub(r"^part-[0-9a-f]{8}-", "part-", n) for n in os.listdir(d) if n.startswith("part-")]
    return sorted(names)


def part_file(path, index):
    d = str(path) + ".parts"
    return os.path.join(d, next(n for n in os.listdir(d) if n.endswith(f"-{index:06d}.parquet")))


def read_final(path):
    if str(path).endswith(".parquet"):
        return pq.read_table(path)
    return pa.Table.from_pylist([json.loads(line) for line in open(path, encoding="utf-8")])
