"""One bad row never stops a job, and an input that is no JSONL stops it at once: JSON errors,
JSONL column checks at open, files that are not JSONL at all, stdin read once, row digests."""
from __future__ import annotations

import gzip
import hashlib
import io
import json
import zipfile

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from specbatch.data import InputError, RowError, open_rows
from specbatch.data import reader as reader_mod

from bad_rows_helpers import write_lines
from errors import one_line_cli_error


# ---- JSON errors --------------------------------------------------------------------------


def test_malformed_json_message(tmp_path):
    path = write_lines(tmp_path / "j.jsonl", ['{"prompt": "ok"}', '{"prompt": "abc', '{"prompt": 1,}',
                                              '{"prompt": "a\tb"}', '{"prompt": "ok"} x'])
    out = list(open_rows(path))
    assert out[1].error == f"{path}:2: malformed JSON at column 12: Unterminated string"
    assert out[2].error.startswith(f"{path}:3: malformed JSON at column 14: ")
    assert out[3].error == f"{path}:4: malformed JSON at column 14: Invalid control character"
    assert out[4].error == f"{path}:5: malformed JSON at column 18: Extra data"
    assert all(" at" not in r.error.split("malformed JSON at column")[1] for r in out[1:])


def test_an_unterminated_last_line_cut_short_is_not_run(tmp_path, capsys):
    """A last line with no newline whose JSON ends early is a file still being written: said on
    stderr and not run (as an error row it would be committed, and the completed line later refused
    as an edit); complete, a rerun adds it. A last line malformed mid-way is still its row's error."""
    path = tmp_path / "grow.jsonl"
    path.write_bytes(b'{"prompt": "a"}\n{"prompt": "b"}\n{"prompt": "cut sho')
    out = list(open_rows(str(path)))
    assert [r.prompt for r in out] == ["a", "b"]
    assert capsys.readouterr().err == (f"warning: {path}:3: the last line has no newline and is not valid JSON (a "
                                       "file still being written?); it is not run: rerun once it is complete and the "
                                       "row is added\n")
    for cut in (b'{"prompt": "x", "max_tokens": ', b'{"prompt": "x",', b'{"prompt"',
                b'{"prompt": "x", "ignore_eos": tru', b'{"prompt": "x", "temperature": 0.',
                b'{"prompt": "x", "temperature": -'):
        path.write_bytes(b'{"prompt": "a"}\n' + cut)
        assert len(list(open_rows(str(path)))) == 1, cut
    path.write_bytes(b'{"prompt": "a"}\n{"prompt": 1,}\n')            # malformed, and ended: the row's error
    assert "malformed JSON" in list(open_rows(str(path)))[1].error


# ---- JSONL checks at open ---------------------------------------------------------------------


def test_jsonl_columns_are_checked_at_open(tmp_path):
    path = write_lines(tmp_path / "c.jsonl", ['{"text": "a", "uid": 1}', '{"text": "b", "meta": 2}'])
    with pytest.raises(InputError) as ei:
        open_rows(path)
    assert str(ei.value) == (f"{path}: no 'prompt', 'messages', 'prompt_token_ids' (or 'tokenized_prompt') "
                             "or 'body' field in the "
                             "first 2 rows (fields: text, uid, meta)")
    with pytest.raises(InputError, match=r"id column 'id' is not in the first 2 rows \(fields: text, uid, meta\)"):
        open_rows(path, prompt_column="text", id_column="id")
    with pytest.raises(InputError, match="keep column 'lang' is not in the first 2 rows"):
        open_rows(path, prompt_column="text", keep_columns=["meta", "lang"])
    # present in some row of the block: fine (rows without it get null / their own errors)
    src = open_rows(path, prompt_column="text", id_column="uid", keep_columns=["meta"])
    out = list(src)
    assert out[0].id == 1 and out[0].keep == {"meta": None} and isinstance(out[1], RowError)


def test_column_check_reads_only_the_first_block(tmp_path, monkeypatch):
    monkeypatch.setattr(reader_mod, "BLOCK_LINES", 3)
    path = write_lines(tmp_path / "late.jsonl", ['{"prompt": "a"}'] * 3 + ['{"prompt": "b", "late": 1}'])
    with pytest.raises(InputError, match="keep column 'late' is not in the first 3 rows"):
        open_rows(path, keep_columns=["late"])
    monkeypatch.setattr(reader_mod, "BLOCK_LINES", 4)
    assert [r.keep for r in open_rows(path, keep_columns=["late"])][-1] == {"late": 1}


def _zip_bytes() -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("rows.jsonl", '{"prompt": "a"}\n')
    return buf.getvalue()


def _parquet_bytes(tmp_path) -> bytes:
    pq.write_table(pa.Table.from_pylist([{"prompt": "a"}]), tmp_path / "p.parquet")
    return (tmp_path / "p.parquet").read_bytes()


@pytest.mark.parametrize("kind,what", [("png", "a PNG image"), ("gzip", "gzip-compressed data"),
                                       ("zip", "a zip archive"), ("parquet", "a Parquet file")])
def test_not_jsonl_at_all(tmp_path, kind, what):
    data = {
        "png": lambda: b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 40,
        "gzip": lambda: gzip.compress(b'{"prompt": "a"}\n' * 100),
        "zip": _zip_bytes,
        "parquet": lambda: _parquet_bytes(tmp_path),
    }[kind]()
    path = tmp_path / "in.jsonl"
    path.write_bytes(data)
    with pytest.raises(InputError) as ei:
        open_rows(str(path))
    hint = " (compressed JSONL is read when named .jsonl.gz)" if kind == "gzip" else ""
    assert str(ei.value) == f"{path}: looks like {what}, not JSONL{hint}"


def test_text_that_is_not_jsonl(tmp_path):
    path = write_lines(tmp_path / "t.jsonl", ["id,prompt", "1,hello", "2,world"])
    with pytest.raises(InputError) as ei:
        open_rows(path)
    assert str(ei.value) == f"{path}: does not look like JSONL: not one of its first 3 non-blank lines is a JSON object"
    path = write_lines(tmp_path / "one.jsonl", ["[1, 2]"])
    with pytest.raises(InputError, match="not one of its first line is a JSON object"):
        open_rows(path)
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"\n  \n")
    assert list(open_rows(str(empty))) == []


def test_cli_exit_2_for_a_file_that_is_not_jsonl(tiny_model, tmp_path):
    from typer.testing import CliRunner

    from specbatch.cli import EXIT_USAGE, app

    path = tmp_path / "in.jsonl"
    path.write_bytes(gzip.compress(b'{"prompt": "a"}\n'))
    result = CliRunner().invoke(app, ["run", str(path), "--model", str(tiny_model), "--device", "cpu",
                                      "-o", str(tmp_path / "o.parquet")])
    line = one_line_cli_error(result, EXIT_USAGE)
    assert "looks like gzip-compressed data, not JSONL" in line


def _fake_stdin(monkeypatch, data: bytes) -> io.BytesIO:
    stream = io.BytesIO(data)

    class FakeStdin:
        buffer = stream

    monkeypatch.setattr("sys.stdin", FakeStdin())
    return stream


def test_stdin_is_checked_then_read_once(monkeypatch):
    monkeypatch.setattr(reader_mod, "BLOCK_LINES", 2)
    monkeypatch.setattr(reader_mod, "BLOCK_BYTES", 1 << 20)
    lines = [json.dumps({"prompt": f"p{i}", "k": i}) for i in range(6)]
    _fake_stdin(monkeypatch, ("\n".join(lines) + "\n").encode())
    out = list(open_rows("-", keep_columns=["k"]))
    assert [r.prompt for r in out] == [f"p{i}" for i in range(6)]
    assert [r.where for r in out] == [f"<stdin>:{i + 1}" for i in range(6)]
    _fake_stdin(monkeypatch, gzip.compress(b'{"prompt": "a"}\n'))
    with pytest.raises(InputError, match=r"^<stdin>: looks like gzip-compressed data, not JSONL$"):
        list(open_rows("-"))
    _fake_stdin(monkeypatch, b'{"prompt": "a"}\n')
    with pytest.raises(InputError, match="^<stdin>: keep column 'x' is not in the first 1 row "):
        list(open_rows("-", keep_columns=["x"]))


def test_stdin_line_cut_by_the_block_budget(monkeypatch):
    monkeypatch.setattr(reader_mod, "BLOCK_BYTES", 40)
    big = json.dumps({"prompt": "x" * 200, "k": 1})
    data = f'{{"prompt": "a"}}\n{big}\n{{"prompt": "c"}}\n'.encode()
    _fake_stdin(monkeypatch, data)
    out = list(open_rows("-", keep_columns=["k"]))
    assert [r.prompt for r in out] == ["a", "x" * 200, "c"] and out[1].keep == {"k": 1}
    # a first line longer than the block is not judged by its cut prefix
    _fake_stdin(monkeypatch, (big + "\n").encode())
    (r,) = list(open_rows("-"))
    assert r.prompt == "x" * 200


def test_long_first_line_in_a_file(tmp_path, monkeypatch):
    monkeypatch.setattr(reader_mod, "BLOCK_BYTES", 64)
    path = write_lines(tmp_path / "long.jsonl", [json.dumps({"prompt": "y" * 500}), '{"prompt": "z"}'])
    assert [r.prompt for r in open_rows(path)] == ["y" * 500, "z"]


# ---- row digests -----------------------------------------------------------------------------


def test_jsonl_digests(tmp_path):
    lines = [b'{"prompt": "a"}', b'{"prompt": "b"}', b'{"prompt": "a"}', b'  {"prompt": "a"}\t',
             b'{"prompt": "caf\xe9"}', b'{"prompt": "x', b"[1]", b'{"prompt": ""}', b'{"prompt": "a", "id": 1}']
    path = tmp_path / "d.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    out = list(open_rows(str(path)))
    assert len(out) == len(lines)
    assert all(isinstance(r.digest, bytes) and len(r.digest) == 16 for r in out)
    assert out[0].digest == out[2].digest == out[3].digest == hashlib.blake2b(lines[0], digest_size=16).digest()
    assert len({r.digest for r in out}) == len(lines) - 2
    assert isinstance(out[4], RowError) and isinstance(out[5], RowError) and isinstance(out[6], RowError)


def test_parquet_digests(tmp_path):
    rows = [{"prompt": "a", "t": 1.0}, {"prompt": "b", "t": 1.0}, {"prompt": "a", "t": 1.0},
            {"prompt": "a", "t": 0.5}, {"prompt": "", "t": None}]
    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(rows).rename_columns(["prompt", "temperature"]), path)
    out = list(open_rows(str(path)))
    assert all(len(r.digest) == 16 for r in out) and isinstance(out[4], RowError)
    assert out[0].digest == out[2].digest
    assert len({r.digest for r in out}) == 4
    expected = json.dumps({"prompt": "a", "temperature": 1.0}, sort_keys=True, ensure_ascii=False)
    assert out[0].digest == hashlib.blake2b(expected.encode(), digest_size=16).digest()


def test_stdin_digests(monkeypatch):
    _fake_stdin(monkeypatch, b'{"prompt": "a"}\n{bad\n{"prompt": "a"}\n')
    out = list(open_rows("-"))
    assert out[0].digest == out[2].digest != out[1].digest and len(out[1].digest) == 16
