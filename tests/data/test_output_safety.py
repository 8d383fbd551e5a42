"""The output is never lost or mixed: the lock, part names, finished-output detection, clean-up cut
short, filesystem errors, typed columns, and the input check a resume makes (data/digests.py)."""
from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import textwrap

import pyarrow.parquet as pq
import pytest

from specbatch.data import InputChanged, OutputError, OutputWriter, RowSet, check_input, open_rows
from specbatch.data import writer as writer_mod

FP = {"recipe": "vanilla", "sampling": {"temperature": 0.0}}
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def rec(row, **extra):
    return {"row": row, "id": f"id{row}", "completion": f"c{row}", "prompt_tokens": 1,
            "completion_tokens": 1, "finish_reason": "stop", "error": None, "spec": None, **extra}


# ---------------------------------------------------------------- the lock

HOLD = textwrap.dedent("""
    import sys, time
    from specbatch.data import OutputWriter
    w = OutputWriter(sys.argv[1], fingerprint={"recipe": "vanilla", "sampling": {"temperature": 0.0}})
    print("held", flush=True)
    time.sleep(60)
""")


def test_a_second_writer_is_refused_naming_the_holder(tmp_path):
    out = str(tmp_path / "c.parquet")
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    holder = subprocess.Popen([sys.executable, "-c", HOLD, out], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(OutputError) as ei:
            OutputWriter(out, fingerprint=FP)
        msg = str(ei.value)
        assert "in use by another specbatch run" in msg and f"pid {holder.pid}" in msg and "\n" not in msg
    finally:
        holder.kill()
        holder.wait()
    # the holder died without releasing: its lock is stale and taken over
    w = OutputWriter(out, fingerprint=FP)
    w.add(rec(0))
    assert w.finalize() == 1
    w.close()
    assert not os.path.exists(out + ".lock")


def test_the_lock_is_released_on_close_and_refused_while_held(tmp_path):
    out = str(tmp_path / "c.jsonl")
    w = OutputWriter(out, fingerprint=FP)
    with pytest.raises(OutputError, match=f"pid {os.getpid()}"):
        OutputWriter(out, fingerprint=FP)
    w.close()
    with OutputWriter(out, fingerprint=FP) as w2:
        assert os.path.exists(out + ".lock")
        w2.add(rec(0))
        w2.finalize()
    assert not os.path.exists(out + ".lock")


def test_part_names_never_collide_between_writers(tmp_path):
    out = str(tmp_path / "p.parquet")
    names = set()
    for start in (0, 10):
        with OutputWriter(out, fingerprint=FP, commit_rows=2) as w:
            for i in range(start, start + 4):
                w.add(rec(i))
        names |= set(os.listdir(out + ".parts"))
    parts = sorted(n for n in names if n.startswith("part-"))
    assert len(parts) == 4 and len({n.split("-")[1] for n in parts}) == 2
    with OutputWriter(out, fingerprint=FP) as w:
        assert w.done_rows == {0, 1, 2, 3, 10, 11, 12, 13}


# ---------------------------------------------------------------- finished outputs

@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_a_finished_output_of_either_format_remembers_its_settings(tmp_path, fmt):
    out = str(tmp_path / f"f.{fmt}")
    with OutputWriter(out, fingerprint=FP) as w:
        w.add(rec(0))
        w.finalize()
    other = {**FP, "sampling": {"temperature": 0.7}, "max_tokens": 16}
    with pytest.raises(OutputError) as ei:
        OutputWriter(out, fingerprint=other)
    msg = str(ei.value)
    assert "different job" in msg and "sampling.temperature: 0.0 -> 0.7" in msg
    assert "max_tokens: <unset> -> 16" in msg
    with OutputWriter(out, fingerprint=FP) as w:
        assert w.complete and w.done_rows == {0}
    if fmt == "jsonl":
        # an edited JSONL output no longer checks out as ours: never silently treated as finished
        with open(out, "a") as f:
            f.write('{"row": 1}\n')
        with pytest.raises(OutputError, match="is not the file specbatch wrote there .*edited since"):
            OutputWriter(out, fingerprint=FP)


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_a_kill_during_the_final_clean_up_leaves_a_finished_output(tmp_path, fmt, monkeypatch):
    out = str(tmp_path / f"k.{fmt}")
    w = OutputWriter(out, fingerprint=FP, commit_rows=2)
    for i in range(5):
        w.add(rec(i))
    kept = str(tmp_path / "kept")
    shutil.copytree(out + ".parts", kept)
    w.finalize()
    w.close()
    # the parts dir (same job) is back, as if the kill came before its removal
    shutil.copytree(kept, out + ".parts")
    before = open(out, "rb").read()
    with OutputWriter(out, fingerprint=FP) as w2:
        assert w2.complete and w2.done_rows == set(range(5))
    assert not os.path.exists(out + ".parts") and open(out, "rb").read() == before
    # ... or the renamed parts dir was only half removed
    shutil.copytree(kept, out + ".parts.done")
    with OutputWriter(out, fingerprint=FP) as w3:
        assert w3.complete
    assert not os.path.exists(out + ".parts.done")


def test_a_kill_between_the_jsonl_sidecar_and_the_rename_resumes(tmp_path, monkeypatch):
    out = str(tmp_path / "s.jsonl")
    w = OutputWriter(out, fingerprint=FP, commit_rows=1)
    for i in range(3):
        w.add(rec(i))
    real = os.replace

    def killed(src, dst):
        if dst == out:
            raise KeyboardInterrupt
        return real(src, dst)

    monkeypatch.setattr(writer_mod.os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        w.finalize()
    w.close()
    monkeypatch.setattr(writer_mod.os, "replace", real)
    assert os.path.exists(out + ".manifest.json") and not os.path.exists(out)
    with OutputWriter(out, fingerprint=FP) as w2:
        assert not w2.complete and w2.done_rows == {0, 1, 2}
        assert w2.finalize() == 3
    assert [json.loads(x)["row"] for x in open(out)] == [0, 1, 2]


def test_overwrite_removes_only_what_specbatch_wrote(tmp_path):
    out = str(tmp_path / "o.jsonl")
    with OutputWriter(out, fingerprint=FP) as w:
        w.add(rec(0))
        w.finalize()
    with OutputWriter(out, fingerprint={**FP, "recipe": "x"}, overwrite=True) as w:
        assert not w.complete and not os.path.exists(out) and not os.path.exists(out + ".manifest.json")


# ---------------------------------------------------------------- filesystem errors

def test_an_unwritable_place_is_one_line_naming_path_and_errno(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(OutputError) as ei:
        OutputWriter(str(blocker / "out.parquet"), fingerprint=FP)
    msg = str(ei.value)
    assert str(blocker) in msg and "ENOTDIR" in msg and "\n" not in msg


def test_disk_full_at_a_commit_keeps_what_was_committed(tmp_path, monkeypatch):
    out = str(tmp_path / "d.parquet")
    w = OutputWriter(out, fingerprint=FP, commit_rows=2)
    w.add(rec(0))
    w.add(rec(1))
    real = writer_mod.pq.write_table

    def full(*a, **k):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(writer_mod.pq, "write_table", full)
    w.add(rec(2))
    with pytest.raises(OutputError) as ei:
        w.add(rec(3))
    assert "ENOSPC" in str(ei.value) and ".parts" in str(ei.value) and "\n" not in str(ei.value)
    assert not [n for n in os.listdir(out + ".parts") if n.endswith(".tmp")]
    w.close()
    monkeypatch.setattr(writer_mod.pq, "write_table", real)
    with OutputWriter(out, fingerprint=FP) as w2:
        assert w2.done_rows == {0, 1}


# ---------------------------------------------------------------- types

def test_ids_and_kept_columns_keep_their_types(tmp_path):
    for fmt in ("parquet", "jsonl"):
        out = str(tmp_path / f"t.{fmt}")
        with OutputWriter(out, fingerprint=FP, keep_columns=["meta"], commit_rows=2) as w:
            w.add(rec(0, id=7, meta={"a": 1}))
            w.add(rec(1, id=8, meta={"b": 2}))
            w.add(rec(2, id=9, meta={"a": 3}))
            w.finalize()
        if fmt == "parquet":
            t = pq.read_table(out)
            assert t.schema.field("id").type == "int64" and t.column("id").to_pylist() == [7, 8, 9]
        else:
            rows = [json.loads(x) for x in open(out)]
            assert [r["id"] for r in rows] == [7, 8, 9]
            assert [r["meta"] for r in rows] == [{"a": 1}, {"b": 2}, {"a": 3}]     # no null keys


# ---------------------------------------------------------------- the input check

def _input(path, prompts):
    with open(path, "w") as f:
        for p in prompts:
            f.write(json.dumps({"prompt": p}) + "\n")
    return str(path)


class _Row:
    def __init__(self, row, digest):
        self.row, self.digest = row, digest


def _rows(path):
    return [_Row(r.row, r.digest) for r in open_rows(path)]


def test_check_input_per_row_and_per_block(tmp_path):
    import hashlib

    def d(text):
        return hashlib.blake2b(json.dumps({"prompt": text}).encode(), digest_size=16).digest()

    prompts = [f"p{i}" for i in range(10)]
    items = [_Row(i, d(p)) for i, p in enumerate(prompts)]
    from specbatch.data.digests import Expected, block_digests

    done = RowSet([0, 1, 2, 5])
    exp = Expected(done=done, rows=__import__("numpy").array([0, 1, 2, 5]), digests=[items[i].digest for i in (0, 1, 2, 5)])
    digests, pending = check_input(items, exp, input_name="in", output="out")
    assert set(digests) == {0, 1, 2, 5} and pending
    edited = list(items)
    edited[2] = _Row(2, d("changed"))
    with pytest.raises(InputChanged, match=r"in: row 2 differs"):
        check_input(edited, exp, input_name="in", output="out")
    with pytest.raises(InputChanged, match="row 5"):
        check_input(items[:4], exp, input_name="in", output="out")
    # finished outputs keep block digests
    blocks = block_digests([(r.row, r.digest) for r in items], 4)
    fin = Expected(done=RowSet(range(10)), block=4, blocks=blocks)
    assert check_input(items, fin, input_name="in", output="out")[1] is False
    assert check_input(items + [_Row(10, d("new"))], fin, input_name="in", output="out")[1] is True
    assert check_input(items + [_Row(10, d("new"))], fin, input_name="in", output="out", limit=10)[1] is False
    with pytest.raises(InputChanged, match="rows 4-7 differ"):
        check_input(items[:5] + [_Row(5, d("x"))] + items[6:], fin, input_name="in", output="out")


def test_block_digests_of_arrow_arrays_are_the_pair_by_pair_ones():
    """The final merge hashes its rows' digests a block at a time from Arrow arrays: the manifest's
    block digests must be those block_digests gives pair by pair (gaps, sliced arrays, digests of
    one length, of none and of mixed lengths)."""
    import os
    import random

    import pyarrow as pa

    from specbatch.data.digests import block_digests, block_digests_arrow

    rng = random.Random(0)
    for trial in range(300):
        n = rng.choice([0, 1, 2, 5, 60, 300])
        rows = sorted(rng.sample(range(rng.choice([n, 2 * n + 3, 10 * n + 10])), n))
        kind = rng.choice(["16", "mixed", "empty"])
        digests = [os.urandom(16) if kind == "16" or (kind == "mixed" and rng.random() < 0.5) else b"" for _ in rows]
        block, cut = rng.choice([1, 2, 3, 7, 64]), int(trial % 3 == 0 and n > 2)
        arrays = pa.array(rows, pa.int64()).slice(cut), pa.array(digests, pa.binary()).slice(cut)
        assert block_digests_arrow(*arrays, block) == block_digests(zip(rows[cut:], digests[cut:]), block)
