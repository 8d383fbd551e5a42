"""include_stop_str_in_output, skip_special_tokens and min_tokens in the stop checks and the text,
as vLLM writes them: the stop string or stop token left out of the text unless asked for, special
tokens skipped unless asked to keep them, nothing stopping a request before min_tokens."""
from __future__ import annotations

from specbatch.request import Request, StopChecker
from specbatch.sampling import SamplingParams


class _CharTokenizer:
    """One token per character; id 0 is a special token the decoder can skip."""

    def decode(self, ids, skip_special_tokens=False):
        return "".join("" if (i == 0 and skip_special_tokens) else ("<eos>" if i == 0 else chr(i)) for i in ids)


def _req(**kw):
    return Request(row=0, id="r", prompt_ids=[1], params=SamplingParams(**kw), max_new=kw.get("max_tokens", 256))


def _run(text: str, **kw):
    chk = StopChecker(_CharTokenizer(), eos_ids={0})
    req = _req(**kw)
    kept = chk.append(req, [0 if c == "#" else ord(c) for c in text])
    return req, kept, chk.completion(req)[0]


def test_stop_string_in_or_out_of_the_text():
    assert _run("abcENDxyz", stop=("END",))[2] == "abc"
    req, kept, text = _run("abcENDxyz", stop=("END",), include_stop_str_in_output=True)
    assert kept == 6 and text == "abcEND" and req.finish_reason == "stop"


def test_stop_token_text_left_out_unless_asked():
    assert _run("abcxyz", stop_token_ids=(ord("x"),))[2] == "abc"
    assert _run("abcxyz", stop_token_ids=(ord("x"),), include_stop_str_in_output=True)[2] == "abcx"
    assert _run("ab#cd")[2] == "ab"                                                  # EOS: special
    assert _run("ab#cd", skip_special_tokens=False)[2] == "ab"                       # the stop token
    assert _run("ab#cd", skip_special_tokens=False, include_stop_str_in_output=True)[2] == "ab<eos>"


def test_special_tokens_kept_when_asked():
    assert _run("ab#cd", ignore_eos=True)[2] == "abcd"
    assert _run("ab#cd", ignore_eos=True, skip_special_tokens=False)[2] == "ab<eos>cd"


def test_nothing_stops_before_min_tokens():
    req, kept, text = _run("abENDcdENDzz", stop=("END",), min_tokens=6)
    assert kept == 10 and text == "abENDcd"                 # the first END fell before min_tokens
    req, kept, text = _run("ab#cd#e", min_tokens=4)          # (the engine masks EOS; the checker waits too)
    assert kept == 6 and text == "abcd"
    req, kept, text = _run("abcENDx", stop=("END",), min_tokens=5, include_stop_str_in_output=True)
    assert kept == 6 and text == "abcEND"


def test_a_stop_string_counts_from_the_token_after_min_tokens():
    """As vLLM's detokenizer: the first min_tokens tokens' text is not searched, so a stop string
    ending in the min_tokens-th token runs on (the kept text is never cut inside the tokens
    min_tokens promises); one ending in the next token stops, even if it began earlier."""
    req, kept, text = _run("abcENDxyEND", stop=("END",), min_tokens=6)
    assert (kept, req.finish_reason, text) == (11, "stop", "abcENDxy")       # the END ending at token 6 ran on
    req, kept, text = _run("abcENDxy", stop=("END",), min_tokens=5)
    assert (kept, req.finish_reason, text) == (6, "stop", "abc")             # ends at token 6 > 5
    req, kept, text = _run("abcENDxy", stop=("ND",), min_tokens=5)
    assert (kept, req.finish_reason, text) == (6, "stop", "abcE")            # begun at token 5, ended at 6


def test_stop_reason_names_what_ended_the_completion():
    """vLLM's stop_reason: the stop string the text was cut at, or the stop_token_ids entry; None
    for EOS (checked first, even when it is also a stop id) and for length."""
    chk = StopChecker(_CharTokenizer(), eos_ids={0})

    def reason(text, **kw):
        req = _req(**kw)
        chk.append(req, [0 if c == "#" else ord(c) for c in text])
        return chk.completion(req)

    assert reason("abENDcd", stop=("XY", "END")) == ("ab", "END")
    assert reason("abXYcd", stop=("END", "XY", "b")) == ("a", "b")          # the first to complete
    # two completing on one token: the first in the list, as vLLM's check_stop_strings picks it
    assert reason("a new day", stop=("a new", "dd a ne", "new")) == ("", "a new")
    assert reason("add a new", stop=("new", "dd a new")) == ("add a ", "new")
    assert reason("abxyz", stop_token_ids=(ord("x"),)) == ("ab", ord("x"))
    assert reason("ab#cd", stop_token_ids=(0,)) == ("ab", None)             # EOS
    assert reason("abcd", max_tokens=3) == ("abc", None)                   # length


class _ByteTokenizer:
    """One token per UTF-8 byte, decoded as byte-level BPE tokenizers do: an incomplete character
    at the end is one U+FFFD until the token completing it arrives."""

    def decode(self, ids, skip_special_tokens=False):
        return bytes(ids).decode("utf-8", errors="replace")


def test_min_tokens_stop_string_ending_in_a_multibyte_character():
    """'é' is two byte tokens: the stop string is completed by the second one. With min_tokens set
    (even 1), the text that token added was measured against the decode without it, whose U+FFFD
    has the same length as 'é': the stop string was never found and generation ran on."""
    chk = StopChecker(_ByteTokenizer(), eos_ids={0})
    for stop, min_tokens, text in (("é", 0, "caf"), ("é", 1, "caf"), ("fé", 4, "ca"), ("é", 4, "caf")):
        req = _req(stop=(stop,), min_tokens=min_tokens)
        kept = chk.append(req, list("café au lait".encode()))
        assert (kept, req.finish_reason, chk.completion(req)) == (5, "stop", (text, stop)), (stop, min_tokens)
