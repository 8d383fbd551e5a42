"""A directory as the input (a dataset's shards, as Ray Data and HF datasets write them): its .jsonl
or .parquet files in path order as one input, rows numbered on from file to file, each row's
messages naming its own file; the files a dataset keeps beside its data left out."""
from __future__ import annotations

import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from specbatch.data import InputError, RowError, RowRequest, open_rows
from specbatch.job import default_output

from reader_helpers import write_jsonl, write_parquet


def _where(r):
    return r.where if isinstance(r, RowRequest) else r.error.split(": ")[0]


def _shards(root):
    (root / "b").mkdir(parents=True)
    (root / "_temporary").mkdir()
    (root / ".cache").mkdir()
    pq.write_table(pa.table({"prompt": ["a0", "a1"], "k": pa.array([1, 2], pa.int32())}), root / "a-00000.parquet")
    pq.write_table(pa.table({"prompt": ["b0", None, "b2"], "k": pa.array([3, 4, 5], pa.int64())}),
                   root / "b" / "part-1.parquet")
    pq.write_table(pa.table({"prompt": ["c0"], "k": pa.array([6], pa.int64())}), root / "c-00002.parquet")
    # beside the data: a writer's markers, a temporary attempt, a cache, another kind of file
    (root / "_SUCCESS").write_bytes(b"")
    pq.write_table(pa.table({"prompt": ["never"]}), root / "_temporary" / "x.parquet")
    pq.write_table(pa.table({"prompt": ["never"]}), root / ".cache" / "y.parquet")
    (root / "README.md").write_text("a dataset card\n")
    return root


def test_a_directory_of_parquet_files_reads_as_one_input_in_path_order(tmp_path):
    root = _shards(tmp_path / "ds")
    src = open_rows(str(root), keep_columns=("k",))
    rows = list(src)
    assert src.total == 6 and len(rows) == 6
    assert [r.row for r in rows] == list(range(6)) and [r.id for r in rows] == list(range(6))
    assert [r.prompt for r in rows if isinstance(r, RowRequest)] == ["a0", "a1", "b0", "b2", "c0"]
    assert [r.keep["k"] for r in rows] == [1, 2, 3, 4, 5, 6]
    # messages name the row's own file and its row there
    assert [_where(r) for r in rows] == [f"{root}/a-00000.parquet row 0", f"{root}/a-00000.parquet row 1",
                                       f"{root}/b/part-1.parquet row 0", f"{root}/b/part-1.parquet row 1",
                                       f"{root}/b/part-1.parquet row 2", f"{root}/c-00002.parquet row 0"]
    bad = rows[3]
    assert isinstance(bad, RowError) and bad.error.startswith(f"{root}/b/part-1.parquet row 1: field 'prompt'")
    # a kept column's type over the files: int32 and int64 -> int64
    assert src.column_types == {"k": pa.int64()}
    # the same rows read from one file have the same digests (a resume checks them by row)
    one = write_parquet(tmp_path / "one.parquet", [{"prompt": r.prompt if isinstance(r, RowRequest) else None,
                                                    "k": r.keep["k"]} for r in rows],
                        schema=pa.schema([("prompt", pa.string()), ("k", pa.int64())]))
    assert [r.digest for r in open_rows(one, keep_columns=("k",))][2:] == [r.digest for r in rows][2:]


def test_a_directory_of_jsonl_files_numbers_rows_on_across_files(tmp_path):
    root = tmp_path / "jl"
    root.mkdir()
    write_jsonl(root / "part-0.jsonl", [{"prompt": "x0"}, {"prompt": "x1"}])
    (root / "part-1.jsonl").write_text('\n{"prompt": "y0"}\n\n{"prompt": 5}\n', encoding="utf-8")
    write_jsonl(root / "part-2.jsonl", [{"prompt": "z0"}])
    src = open_rows(str(root))
    rows = list(src)
    assert src.total == 5 and [r.row for r in rows] == list(range(5))
    assert [_where(r) for r in rows] == [f"{root}/part-0.jsonl:1", f"{root}/part-0.jsonl:2", f"{root}/part-1.jsonl:2",
                                       f"{root}/part-1.jsonl:4", f"{root}/part-2.jsonl:1"]
    assert isinstance(rows[3], RowError) and rows[3].error.startswith(f"{root}/part-1.jsonl:4: field 'prompt'")


def test_directories_that_cannot_be_one_input_are_refused_naming_why(tmp_path):
    empty = tmp_path / "empty"
    (empty / "_temporary").mkdir(parents=True)
    pq.write_table(pa.table({"prompt": ["x"]}), empty / "_temporary" / "a.parquet")
    with pytest.raises(InputError, match=r"empty: a directory with no \.jsonl \(or \.jsonl\.gz, .*\) or \.parquet file in it"):
        open_rows(str(empty))
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    write_jsonl(mixed / "a.jsonl", [{"prompt": "x"}])
    write_parquet(mixed / "b.parquet", [{"prompt": "y"}])
    with pytest.raises(InputError, match=r"holds both \.jsonl and \.parquet files .*a\.jsonl.*b\.parquet"):
        open_rows(str(mixed))
    # each file is checked as a lone input would be, by its own name
    cols = tmp_path / "cols"
    cols.mkdir()
    write_parquet(cols / "a.parquet", [{"prompt": "x", "k": 1}])
    write_parquet(cols / "b.parquet", [{"prompt": "y"}])
    with pytest.raises(InputError, match=r"cols/b\.parquet: keep column 'k' is not in the Parquet schema"):
        open_rows(str(cols), keep_columns=("k",))
    clash = tmp_path / "clash"
    clash.mkdir()
    write_parquet(clash / "a.parquet", [{"prompt": "x", "k": 1}])
    write_parquet(clash / "b.parquet", [{"prompt": "y", "k": [1, 2]}])
    with pytest.raises(InputError, match=r"clash/b\.parquet: keep column 'k' is list<.*: int64> here and int64 "
                                         r"in .*clash/a\.parquet"):
        open_rows(str(clash), keep_columns=("k",))


def test_a_directory_inputs_default_output_is_beside_it(tmp_path, monkeypatch):
    (tmp_path / "ds.v2").mkdir()
    assert default_output(str(tmp_path / "ds.v2")) == str(tmp_path / "ds.v2.completions.parquet")
    assert default_output(str(tmp_path / "ds.v2") + "/") == str(tmp_path / "ds.v2.completions.parquet")
    monkeypatch.chdir(tmp_path / "ds.v2")
    assert default_output(".") == os.path.join("..", "ds.v2.completions.parquet")
    assert default_output("data.jsonl") == "data.completions.parquet"


def test_a_directory_holds_no_file_open_but_the_one_read_and_a_grown_file_waits(tmp_path):
    """Thousands of shards under a 1,024 descriptor limit: opening the input keeps none open. A file
    that grew after it was counted gives its extra rows at a rerun, not the next file's numbers."""
    many = tmp_path / "many"
    many.mkdir()
    for i in range(64):
        write_parquet(many / f"part-{i:05d}.parquet", [{"prompt": f"p{i}"}])
    fds = len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else None
    src = open_rows(str(many))
    rows = iter(src)
    first = next(rows)
    if fds is not None:
        assert len(os.listdir("/proc/self/fd")) <= fds + 2
    assert first.prompt == "p0" and [r.prompt for r in rows] == [f"p{i}" for i in range(1, 64)]

    grow = tmp_path / "grow"
    grow.mkdir()
    write_jsonl(grow / "a.jsonl", [{"prompt": "a0"}])
    write_jsonl(grow / "b.jsonl", [{"prompt": "b0"}])
    src = open_rows(str(grow))
    with open(grow / "a.jsonl", "a") as f:
        f.write('{"prompt": "a1"}\n')
    assert [(r.row, r.prompt) for r in src] == [(0, "a0"), (1, "b0")]
