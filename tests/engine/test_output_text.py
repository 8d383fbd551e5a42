"""The completion text as vLLM writes it for the same ids: decoded after the prompt's last tokens
(a sentencepiece token's leading space kept), and without the U+FFFD of a character whose bytes
max_tokens cut off (vLLM's detokenizer holds such text back and never writes it)."""
from __future__ import annotations

import json

import pytest

from specbatch.request import Request, StopChecker
from specbatch.sampling import SamplingParams
from tiny_models import CORPUS, make_tokenizer


def _sentencepiece_tokenizer(out_dir):
    """A Llama-2-style tokenizer: '▁' for spaces, byte-fallback tokens <0xNN>, a decoder that strips
    the one leading space of a text, BOS added."""
    from tokenizers import Tokenizer, decoders, models, normalizers, processors, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    byte_tokens = [f"<0x{i:02X}>" for i in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>", *byte_tokens],
                                  show_progress=False)
    tok.train_from_iterator(CORPUS * 4, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(str(out_dir))
    # The byte tokens are ordinary vocabulary (as in Llama's), not special tokens decode skips.
    path = out_dir / "tokenizer.json"
    spec = json.loads(path.read_text())
    spec["added_tokens"] = [t for t in spec["added_tokens"] if not t["content"].startswith("<0x")]
    path.write_text(json.dumps(spec, ensure_ascii=False))
    return AutoTokenizer.from_pretrained(str(out_dir))


@pytest.fixture(scope="module")
def sp_tok(tmp_path_factory):
    return _sentencepiece_tokenizer(tmp_path_factory.mktemp("sp_tok"))


@pytest.fixture(scope="module")
def bpe_tok(tmp_path_factory):
    from transformers import AutoTokenizer

    d = tmp_path_factory.mktemp("bpe_tok")
    make_tokenizer(d)
    return AutoTokenizer.from_pretrained(str(d))


def _completion(tok, prompt_ids, output_ids, **kw):
    chk = StopChecker(tok, eos_ids={tok.eos_token_id})
    req = Request(row=0, id="r", prompt_ids=prompt_ids, params=SamplingParams(**kw), max_new=len(output_ids))
    kept = chk.append(req, output_ids)
    return (*chk.completion(req), kept, req.finish_reason)


def test_sentencepiece_completion_keeps_its_leading_space(sp_tok):
    """'The quick brown' + [▁, fo, x▁, ju, mp, s]: vLLM writes ' fox jumps'; decode(ids) alone
    strips the leading space ('fox jumps'), and a stop string ' fox' at the start was never found."""
    prompt = sp_tok("The quick brown")["input_ids"]
    out = sp_tok("fox jumps", add_special_tokens=False)["input_ids"]
    assert sp_tok.decode(out) == "fox jumps"
    assert _completion(sp_tok, prompt, out)[0] == " fox jumps"
    assert _completion(sp_tok, prompt, out, stop=(" fox",)) == ("", " fox", 3, "stop")
    world = sp_tok("world!", add_special_tokens=False)["input_ids"]
    assert _completion(sp_tok, sp_tok("Hello")["input_ids"], world)[0] == " world!"


@pytest.mark.parametrize("which, generated", [("sp_tok", "fox 日本"), ("bpe_tok", " fox 日本")])
def test_character_cut_by_max_tokens_leaves_no_replacement_char(which, generated, request):
    """max_tokens ends the output between the bytes of '本': vLLM's text ends at ' fox 日' (its
    detokenizer holds back text ending in U+FFFD); decode(ids) gave ' fox 日\ufffd' (byte-level BPE)
    or 'fox \ufffd\ufffd\ufffd\ufffd\ufffd' (byte fallback: the whole byte run)."""
    tok = request.getfixturevalue(which)
    prompt = tok("The quick brown")["input_ids"]
    out = tok(generated, add_special_tokens=False)["input_ids"]
    assert tok.decode(out[:-1]).endswith("\ufffd")      # the last byte of '本' not generated
    text, _, kept, reason = _completion(tok, prompt, out[:-1])
    assert (text, kept, reason) == (" fox 日", len(out) - 1, "length")
    assert _completion(tok, prompt, out)[0] == " fox 日本"
