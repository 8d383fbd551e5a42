"""Corpus (stdlib source) and tokenizer stages of the demo-model pipeline. CPU only, fast."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("transformers")

from specbatch.train.corpus import (  # noqa: E402
    as_backend_tokenizer,
    corpus_files,
    corpus_stats,
    encode_corpus,
    is_excluded,
    iter_corpus,
    load_tokens,
    load_tokens_header,
    split_of,
    stdlib_root,
)
from specbatch.train.heldout import heldout_prefixes  # noqa: E402
from specbatch.train.tokenizer import (  # noqa: E402
    ASSISTANT_TOKEN,
    EOS_TOKEN,
    SPECIAL_TOKENS,
    _training_texts,
    train_tokenizer,
)

CODE_SAMPLES = [
    'def f(x):\n\treturn "héllo wörld 世界 🎉"  # ünïcode\n',
    "class A:\n    def __init__(self):\n        self.x = [1, 2 ,3] ; y = ( a . b )\n\n\n",
    "x = {'a': 1}\r\nprint( x ) \n\t\t# tabs\t and  double  spaces  \n",
    "    leading spaces and no trailing newline",
    "\x0c\n# form feed, NUL-free odd bytes: \u00a0\u2028\u200b ∑ λ → ok\n",
    "",
]


# --------------------------------------------------------------------------- corpus


def _fake_stdlib(root: Path) -> None:
    files = {
        "os.py": "import sys\n",
        "json/__init__.py": "x = 1\n",
        "json/decoder.py": "y = 2\n",
        "test/test_os.py": "bad\n",
        "test/support/__init__.py": "bad\n",
        "unittest/__init__.py": "ok = True\n",
        "unittest/test/test_case.py": "bad\n",
        "idlelib/idle_test/htest.py": "bad\n",
        "idlelib/editor.py": "ok = 1\n",
        "lib2to3/tests/data/fixers/bad.py": "bad\n",
        "lib2to3/fixer_base.py": "ok = 2\n",
        "test_toplevel.py": "bad\n",
        "ctypes/macholib/test_dyld.py": "bad\n",
        "site-packages/pkg/mod.py": "bad\n",
        "tkinter/tests/foo.py": "bad\n",
        "data.txt": "not python\n",
    }
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    (root / "latin1.py").write_bytes(b"# caf\xe9\n")  # not UTF-8
    (root / "big.py").write_bytes(b"#" * 1_000_001 + b"\n")  # > 1 MB


def test_corpus_exclusions_on_fake_tree(tmp_path):
    _fake_stdlib(tmp_path)
    files = corpus_files(root=tmp_path)
    assert files == [
        "idlelib/editor.py",
        "json/__init__.py",
        "json/decoder.py",
        "lib2to3/fixer_base.py",
        "os.py",
        "unittest/__init__.py",
    ]
    texts = dict(iter_corpus(root=tmp_path))
    assert texts["os.py"] == "import sys\n"
    stats = corpus_stats(root=tmp_path)
    assert stats["total"]["files"] == 6
    assert stats["train"]["files"] + stats["heldout"]["files"] == 6
    assert stats["total"]["bytes"] == sum(len(t.encode()) for t in texts.values())


def test_is_excluded_rules():
    assert is_excluded("test/test_os.py")
    assert is_excluded("idlelib/idle_test/test_x.py")
    assert is_excluded("lib2to3/tests/pytree_idempotency.py")
    assert is_excluded("test_foo.py")
    assert is_excluded("site-packages/foo/bar.py")
    assert is_excluded("foo.pyc")
    assert not is_excluded("os.py")
    assert not is_excluded("unittest/case.py")
    assert not is_excluded("contest.py")  # "test" as a substring is fine


def test_real_stdlib_corpus_sorted_and_clean():
    files = corpus_files()
    assert len(files) > 200, "stdlib corpus unexpectedly small"
    assert files == sorted(files)
    assert len(set(files)) == len(files)
    assert "os.py" in files and "json/__init__.py" in files
    for rel in files:
        parts = rel.split("/")
        assert rel.endswith(".py")
        assert not ({"test", "tests", "idle_test", "site-packages"} & set(parts)), rel
        assert not parts[-1].startswith("test_"), rel
    # the stdlib's own test suite, where it is installed, is really left out
    if (stdlib_root() / "test" / "test_os.py").exists():
        assert "test/test_os.py" not in files


def test_split_deterministic_and_about_five_percent():
    files = corpus_files()
    held = corpus_files("heldout")
    train = corpus_files("train")
    assert sorted(held + train) == files
    assert not set(held) & set(train)
    assert 0.02 <= len(held) / len(files) <= 0.10
    assert [split_of(f) for f in files] == [split_of(f) for f in files]
    # the hash gives ~5% on any large set of names, not just this corpus
    names = [f"pkg{i}/mod{i * 7919}.py" for i in range(20000)]
    frac = sum(split_of(n) == "heldout" for n in names) / len(names)
    assert 0.04 < frac < 0.06
    stats = corpus_stats()
    assert stats["heldout"]["files"] == len(held)
    assert stats["train"]["files"] == len(train)
    with pytest.raises(ValueError):
        corpus_files("validation")


def test_iter_corpus_split_filter():
    items = list(iter_corpus("heldout"))
    assert [r for r, _ in items] == corpus_files("heldout")
    rel, text = items[0]
    assert text == (stdlib_root() / rel).read_text(encoding="utf-8")


# --------------------------------------------------------------------------- tokenizer


@pytest.fixture(scope="module")
def small_tok_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok") / "tokenizer"
    train_tokenizer(d, vocab_size=512, max_bytes=200_000)
    return d


def test_training_subsample_is_bounded():
    texts = list(_training_texts("train", max_files=None, max_bytes=50_000, root=None))
    n = sum(len(t.encode()) for t in texts)
    assert 0 < n <= 50_000
    assert all(t.endswith("\n") for t in texts)
    texts = list(_training_texts("train", max_files=3, max_bytes=None, root=None))
    assert len(texts) == 3


def test_tokenizer_files_and_reload(small_tok_dir):
    from transformers import AutoTokenizer

    assert (small_tok_dir / "tokenizer.json").is_file()
    cfg = json.loads((small_tok_dir / "tokenizer_config.json").read_text())
    assert cfg["chat_template"]
    assert cfg["tokenizer_class"] == "PreTrainedTokenizerFast"
    tok = AutoTokenizer.from_pretrained(str(small_tok_dir), local_files_only=True)
    assert len(tok) == 512
    assert tok.eos_token == EOS_TOKEN and tok.pad_token == EOS_TOKEN
    assert tok.eos_token_id == 0 and tok.pad_token_id == 0
    assert tok.bos_token is None and tok.bos_token_id is None
    assert [tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS] == [0, 1, 2, 3]


def test_tokenizer_round_trip_no_special_tokens(small_tok_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(small_tok_dir), local_files_only=True)
    backend = as_backend_tokenizer(small_tok_dir)
    for code in CODE_SAMPLES + [(stdlib_root() / "os.py").read_text(encoding="utf-8")[:5000]]:
        ids = tok(code)["input_ids"]
        assert ids == backend.encode(code, add_special_tokens=False).ids
        assert all(i >= len(SPECIAL_TOKENS) for i in ids), "special token added to plain text"
        assert tok.decode(ids) == code
    # BPE actually merged something: a common word is fewer tokens than bytes
    assert len(tok("import os\nimport sys\n")["input_ids"]) < len("import os\nimport sys\n")
    # special tokens in text are single ids
    assert tok("<|user|>hi<|endoftext|>")["input_ids"][0] == 1
    assert tok("<|user|>hi<|endoftext|>")["input_ids"][-1] == 0


def test_chat_template(small_tok_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(small_tok_dir), local_files_only=True)
    msgs = [
        {"role": "system", "content": "You write Python."},
        {"role": "user", "content": "def add(a, b):"},
    ]
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert text == "<|system|>\nYou write Python.\n<|user|>\ndef add(a, b):\n<|assistant|>\n"
    assert text.endswith(ASSISTANT_TOKEN + "\n")
    no_gen = tok.apply_chat_template(msgs, add_generation_prompt=False, tokenize=False)
    assert not no_gen.endswith(ASSISTANT_TOKEN + "\n")
    ids = tok(text)["input_ids"]
    assert ids[0] == 3 and ids.count(2) == 1 and ids[-2] == 2


def test_tokenizer_training_deterministic(tmp_path, small_tok_dir):
    again = tmp_path / "again"
    train_tokenizer(again, vocab_size=512, max_bytes=200_000)
    first = (small_tok_dir / "tokenizer.json").read_bytes()
    assert (again / "tokenizer.json").read_bytes() == first


# --------------------------------------------------------------------------- prompts / streams


def test_heldout_prefixes(small_tok_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(small_tok_dir), local_files_only=True)
    n, k = 40, 64
    a = heldout_prefixes(tok, n, k, seed=0)
    b = heldout_prefixes(str(small_tok_dir), n, k, seed=0)
    c = heldout_prefixes(tok, n, k, seed=1)
    assert a == b
    assert a != c
    assert len(a) == n and len({p["id"] for p in a}) == n
    held = set(corpus_files("heldout"))
    used_files = set()
    for p in a:
        rel, line = p["id"].rsplit(":", 1)
        assert rel in held and split_of(rel) == "heldout"
        used_files.add(rel)
        text = (stdlib_root() / rel).read_text(encoding="utf-8")
        lines = text.split("\n")
        # the prompt starts at line `line` (1-based) and ends at a line boundary
        rest = "\n".join(lines[int(line) - 1 :])
        assert rest.startswith(p["prompt"])
        assert p["prompt"].endswith("\n") and p["prompt"].strip()
        assert rest[len(p["prompt"]) :].strip(), "nothing left to complete"
        ntok = len(tok(p["prompt"])["input_ids"])
        assert k // 2 <= ntok <= k
    # prompts spread over files before reusing one
    assert len(used_files) >= min(n, len(held)) - 5
    with pytest.raises(ValueError):  # no held-out file is that long
        heldout_prefixes(tok, 1, 10**7, seed=0)


def test_encode_corpus_round_trip(small_tok_dir, tmp_path):
    out = tmp_path / "tokens" / "heldout.bin"
    header = encode_corpus(small_tok_dir, "heldout", out, max_files=4)
    assert header == load_tokens_header(out)
    toks = load_tokens(out)
    assert toks.typecode == "H"
    assert len(toks) == header["count"] and out.stat().st_size == 2 * header["count"]
    assert header["eos_id"] == 0 and header["vocab_size"] == 512 and header["n_docs"] == 4
    assert max(toks) < 512
    # EOS after every document: split back and decode each file exactly
    docs, cur = [], []
    for t in toks:
        if t == header["eos_id"]:
            docs.append(cur)
            cur = []
        else:
            cur.append(t)
    assert cur == []
    backend = as_backend_tokenizer(small_tok_dir)
    expected = list(iter_corpus("heldout"))[:4]
    assert len(docs) == 4
    for ids, (_, text) in zip(docs, expected):
        assert backend.decode(ids, skip_special_tokens=False) == text
    # a truncated file is detected
    out.write_bytes(out.read_bytes()[:-2])
    with pytest.raises(ValueError):
        load_tokens(out)

