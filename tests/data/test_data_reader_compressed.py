"""Compressed JSONL (.jsonl.gz, .zst, .bz2, .lz4, as datasets are shipped): read as a stream
through pyarrow's codecs, the same rows and digests as the plain file (a resume may switch forms);
a file cut short or corrupt is one line naming it; compressed bytes under a plain .jsonl name say
which name reads them."""
from __future__ import annotations

import gzip
import json

import pyarrow as pa
import pytest

from specbatch.data import InputError, open_rows
from specbatch.job import default_output

ROWS = [{"prompt": f"p{i}", "max_tokens": i + 1} for i in range(50)]
DATA = ("\ufeff" + "".join(json.dumps(r) + "\n\n" for r in ROWS)).encode() + b'{"prompt": "last, no newline"}'


def _write(path, codec):
    if codec is None:
        path.write_bytes(DATA)
    else:
        with pa.output_stream(str(path), compression=codec) as f:
            f.write(DATA)
    return str(path)


@pytest.mark.parametrize("suffix, codec", [(".jsonl.gz", "gzip"), (".jsonl.zst", "zstd"), (".jsonl.bz2", "bz2"),
                                           (".JSONL.LZ4", "lz4")])
def test_compressed_jsonl_reads_as_the_plain_file(tmp_path, suffix, codec):
    plain = open_rows(_write(tmp_path / "plain.jsonl", None))
    packed = open_rows(_write(tmp_path / f"data{suffix}", codec))
    want, got = list(plain), list(packed)
    assert packed.total == plain.total == 51 and len(got) == 51
    assert [(r.row, r.prompt, r.overrides, r.digest) for r in got] == \
        [(r.row, r.prompt, r.overrides, r.digest) for r in want]
    assert got[1].where == f"{tmp_path}/data{suffix}:3"
    assert default_output(str(tmp_path / f"data{suffix}")) == str(tmp_path / "data.completions.parquet")


@pytest.mark.parametrize("block_lines, block_bytes", [(1, 1 << 22), (7, 1 << 22), (1000, 1 << 22), (1000, 30)])
def test_opening_a_compressed_file_decompresses_it_once(tmp_path, monkeypatch, block_lines, block_bytes):
    """The first block's check and the row count read one stream: the file is opened (and
    decompressed) once to open it, whatever the first block holds, the total the same."""
    from specbatch.data import reader as reader_mod

    monkeypatch.setattr(reader_mod, "BLOCK_LINES", block_lines)
    monkeypatch.setattr(reader_mod, "BLOCK_BYTES", block_bytes)      # 30: the block ends inside a line
    opened, real = [], reader_mod._open_binary
    monkeypatch.setattr(reader_mod, "_open_binary", lambda p: opened.append(p) or real(p))
    for name, codec in (("d.jsonl.gz", "gzip"), ("d.jsonl", None)):
        opened.clear()
        assert open_rows(_write(tmp_path / name, codec)).total == 51 and len(opened) == 1


def test_a_compressed_file_cut_short_or_misnamed_is_one_line(tmp_path):
    whole = gzip.compress(DATA * 200)
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(whole[: len(whole) * 2 // 3])
    with pytest.raises(InputError, match=r"cut\.jsonl\.gz: cannot read JSONL: .*[Tt]runcated"):
        open_rows(str(cut))
    misnamed = tmp_path / "data.jsonl"
    misnamed.write_bytes(gzip.compress(DATA))
    with pytest.raises(InputError, match=r"data\.jsonl: looks like gzip-compressed data, not JSONL \(compressed "
                                         r"JSONL is read when named \.jsonl\.gz\)"):
        open_rows(str(misnamed))


def test_a_directory_of_compressed_shards(tmp_path):
    d = tmp_path / "ds"
    d.mkdir()
    _write(d / "part-0.jsonl.gz", "gzip")
    _write(d / "part-1.jsonl.zst", "zstd")
    src = open_rows(str(d))
    rows = list(src)
    assert src.total == 102 and [r.row for r in rows] == list(range(102))
    assert rows[51].where == f"{d}/part-1.jsonl.zst:1"
    (d / "part-2.parquet").write_bytes(b"")
    with pytest.raises(InputError, match="holds both .jsonl and .parquet files"):
        open_rows(str(d))


def test_one_file_in_two_forms_in_a_directory_and_a_misnamed_compressed_file(tmp_path):
    d = tmp_path / "ds"
    d.mkdir()
    _write(d / "part-0.jsonl", None)
    _write(d / "part-0.jsonl.gz", "gzip")
    with pytest.raises(InputError, match=r"holds .*part-0\.jsonl and .*part-0\.jsonl\.gz, one file in two forms"):
        open_rows(str(d))
    plain = tmp_path / "plain.jsonl.gz"
    plain.write_bytes(DATA)
    with pytest.raises(InputError, match=r"plain\.jsonl\.gz: cannot read JSONL: .*\(its name says gzip-compressed "
                                         r"JSONL\)"):
        open_rows(str(plain))
    lz4 = tmp_path / "lz4.jsonl"
    with pa.output_stream(str(lz4), compression="lz4") as f:
        f.write(DATA)
    with pytest.raises(InputError, match=r"looks like lz4-compressed data, not JSONL \(compressed JSONL is read when "
                                         r"named \.jsonl\.lz4\)"):
        open_rows(str(lz4))
