"""The OpenAI Batch output format (what `vllm run-batch` writes), one line per request:

    {"id": "batch_req_...", "custom_id": ..., "response": {"status_code": 200, "request_id": ...,
     "body": <chat.completion | text_completion>}, "error": null, "specbatch": {"row": ..., "spec": ...}}

The body is a `chat.completion` (choices[].message) for chat requests and a `text_completion`
(choices[].text) for completions, with `usage` (completion_tokens over every choice when n > 1).
`choices[].logprobs` is null unless the row asked: chat `{"content": [{"token", "logprob", "bytes",
"top_logprobs": [...]}]}`, completions `{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`
(each top_logprobs dict also holds the sampled token, as OpenAI's legacy API does). A row that
asked for prompt_logprobs gets vLLM's extension: `[null, {"<token id>": {"logprob", "rank",
"decoded_token"}, ...}, ...]` per prompt token, the prompt's own token first, then the top ones
(on the chat body, on each completions choice). A row that could not run is a line with a
400 `response` (body {"error": {...}}, as vLLM's run-batch and OpenAI write a rejected request) and
`error` {"code", "message"}; a row the engine failed on, a 500 `server_error` (the request was not
wrong). Speculation stats and the input row number ride along in the extra top-level field
`specbatch` (ignored by OpenAI clients; a resume reads the row back from it). Ids are derived from
the row, custom_id and the input row's bytes, so a rerun writes the same ids and another batch others.
"""
from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

from .. import records
from ..request_output import prompt_logprobs

ERROR_CODE = "invalid_request"
SERVER_ERROR = "server_error"
OUTPUT_FORMATS = ("native", "openai", "auto")
LINE_KEYS = ("id", "custom_id", "response", "error", "specbatch")     # what a kept column must not replace


def check_output_format(name: str) -> str:
    """--output-format's value, or a ValueError naming it (the file and stdout writers both ask)."""
    if name not in OUTPUT_FORMATS:
        raise ValueError(f"--output-format {name}: expected {', '.join(OUTPUT_FORMATS[:-1])} or {OUTPUT_FORMATS[-1]}")
    return name


def check_keep_columns(keep_columns: Sequence[str], output_format: str, reserved: Sequence[str] = ()) -> None:
    """A ValueError for a kept column that would replace an output column (or one of `reserved`),
    or a key of the OpenAI line it rides beside (the line's own "response" or "custom_id"
    overwritten: unreadable by clients and by a resume). "auto" is checked as "openai" once a row
    shows the output will be OpenAI lines (native rows keep such a column, as before)."""
    for c in keep_columns:
        if c in records.NAMES or c in reserved:
            raise ValueError(f"keep column '{c}' clashes with the output column of the same name")
        if output_format == "openai" and c in LINE_KEYS:
            raise ValueError(f"keep column '{c}' clashes with the OpenAI batch output key of the same name "
                             "(--output-format native keeps it)")


def _hex(*parts: object, n: int = 24) -> str:
    return hashlib.blake2b("\x1f".join(map(str, parts)).encode(), digest_size=16).hexdigest()[:n]


def to_openai_line(rec: dict[str, Any], model: str, digest: bytes | None = None) -> dict[str, Any]:
    """A merged output row (native columns plus endpoint / request_model / created) as one line;
    `digest`: its input row's (data/digests.py), in the ids, so that another batch's request with
    the same custom_id at the same row gets other ids (clients key results by them), a rerun the same."""
    row, custom_id = rec["row"], (None if rec.get("id") is None else str(rec["id"]))   # a string, as OpenAI's
    salt = (digest or b"").hex()
    line: dict[str, Any] = {"id": f"batch_req_{_hex('batch', row, custom_id, salt)}", "custom_id": custom_id}
    if rec.get("error"):        # a 400 response as vLLM's run-batch and OpenAI write it; the message in `error`
        # (the engine failing on the row is no fault of the request: a 500, as OpenAI reports a server error)
        status, kind, code = ((500, SERVER_ERROR, SERVER_ERROR) if records.engine_fault(rec["error"])
                              else (400, "invalid_request_error", ERROR_CODE))
        line.update(response={"status_code": status, "request_id": f"req-{_hex('req', row, custom_id, salt)}",
                              "body": {"error": {"message": rec["error"], "type": kind, "param": None, "code": None}}},
                    error={"code": code, "message": rec["error"]})
    else:
        chat = rec.get("endpoint") == "chat"
        native = rec.get("choices") or [{"index": 0, "completion": rec.get("completion"),
                                         "finish_reason": rec.get("finish_reason"), "logprobs": rec.get("logprobs"),
                                         **records.stop_fields(rec.get("stop_reason"))}]
        prompt_lps = _openai_prompt_logprobs(rec)
        choices = []
        for c in native:
            choice: dict[str, Any] = {"index": c["index"], "finish_reason": c.get("finish_reason"),
                                      # vLLM's extension; choice 0's is the row's (parts written before
                                      # the choices struct held it have it there alone)
                                      "stop_reason": (records.choice_stop_reason(c) if c["index"]
                                                      else rec.get("stop_reason")),
                                      "logprobs": _openai_logprobs(c.get("logprobs"), chat)}
            if chat:
                # (tool_calls: vLLM's ChatMessage always has the list; no tool parser here, so empty)
                choice["message"] = {"role": "assistant", "content": c.get("completion"), "tool_calls": []}
            else:
                choice["text"] = c.get("completion")
                if prompt_lps is not None:
                    choice["prompt_logprobs"] = prompt_lps
            choices.append(choice)
        usage = {"prompt_tokens": rec.get("prompt_tokens") or 0, "completion_tokens": rec.get("completion_tokens") or 0}
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        body = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{_hex('body', row, custom_id, salt)}",
                "object": "chat.completion" if chat else "text_completion",
                "created": rec.get("created") or 0, "model": rec.get("request_model") or model,
                "choices": choices, "usage": usage}
        if chat and prompt_lps is not None:
            body["prompt_logprobs"] = prompt_lps
        line.update(response={"status_code": 200, "request_id": f"req-{_hex('req', row, custom_id, salt)}", "body": body},
                    error=None)
    line["specbatch"] = {"row": row, "spec": rec.get("spec"), "batch_line": bool(rec.get("batch_line"))}
    if rec.get("output_token_ids") is not None:
        line["specbatch"]["output_token_ids"] = rec["output_token_ids"]
    if rec.get("prompt_logprobs") and not rec.get("error"):       # reading the line back needs the top count
        line["specbatch"]["prompt_top"] = next((len(e["top_logprobs"]) for e in rec["prompt_logprobs"] if e), 0)
    return line


def _bytes(token: str) -> list[int]:
    return list(token.encode("utf-8", "replace"))


def _openai_logprobs(entries: list[dict[str, Any]] | None, chat: bool) -> dict[str, Any] | None:
    """The native logprobs column (records.logprob_entries) in the OpenAI shape of the endpoint."""
    if entries is None:
        return None
    if chat:
        return {"content": [{"token": e["token"], "logprob": e["logprob"], "bytes": _bytes(e["token"]),
                             "top_logprobs": [{"token": t["token"], "logprob": t["logprob"], "bytes": _bytes(t["token"])}
                                              for t in e["top_logprobs"]]} for e in entries]}
    offsets, at = [], 0
    tops = []
    for e in entries:
        offsets.append(at)
        at += len(e["token"])
        top: dict[str, float] = {}
        for t in [*e["top_logprobs"], e]:       # tokens decoding alike share a key: the likeliest's value
            top.setdefault(t["token"], t["logprob"])
        tops.append(top)
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": tops, "text_offset": offsets}


def _native_logprobs(lp: dict[str, Any] | None, chat: bool) -> list[dict[str, Any]] | None:
    """An OpenAI logprobs object back as the native column (token ids are not in it: null)."""
    if lp is None:
        return None
    if chat:
        return [{"token_id": None, "token": c["token"], "logprob": c["logprob"],
                 "top_logprobs": [{"token_id": None, "token": t["token"], "logprob": t["logprob"]}
                                  for t in c.get("top_logprobs") or []]} for c in lp.get("content") or []]
    return [{"token_id": None, "token": tok, "logprob": lp_, "top_logprobs": [
                {"token_id": None, "token": t, "logprob": v} for t, v in (top or {}).items()]}
            for tok, lp_, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"])]


def _openai_prompt_logprobs(record: Mapping[str, Any]) -> list[dict[str, Any] | None] | None:
    """The native prompt_logprobs column as vLLM's server writes it: per token {str(id): {logprob,
    rank, decoded_token}}, the prompt's token first (its rank may be past the top ones), then the top ones."""
    entries = prompt_logprobs(record)
    return None if entries is None else [
        None if d is None else {str(t): {"logprob": v.logprob, "rank": v.rank, "decoded_token": v.decoded_token}
                                for t, v in d.items()} for d in entries]


def _native_prompt_logprobs(lps: list[dict[str, Any] | None] | None, k: int) -> list[dict[str, Any] | None] | None:
    """vLLM's prompt_logprobs (as _openai_prompt_logprobs writes them: the prompt's token first)
    back as the native column; k: the top ones per token (a prompt token among them is listed once)."""
    if lps is None:
        return None
    out: list[dict[str, Any] | None] = []
    for d in lps:
        if d is None:
            out.append(None)
            continue
        (tok, first), *rest = d.items()
        top = [{"token_id": int(t), "token": v["decoded_token"], "logprob": v["logprob"]} for t, v in rest]
        me = {"token_id": int(tok), "token": first["decoded_token"], "logprob": first["logprob"]}
        if len(top) < k:
            top.insert(first["rank"] - 1, me)            # the prompt's token was one of the top ones
        out.append({**me, "rank": first["rank"], "top_logprobs": top})
    return out


def from_openai_line(line: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI line written by to_openai_line back as a native record (a finished output reopened
    to add rows)."""
    extra = line.get("specbatch") or {}
    rec: dict[str, Any] = {"row": extra["row"], "id": line.get("custom_id"), "spec": extra.get("spec"),
                           "output_token_ids": extra.get("output_token_ids")}
    if line.get("error"):
        rec.update(error=line["error"].get("message"), completion=None, prompt_tokens=0, completion_tokens=0,
                   batch_line=extra.get("batch_line", True))
        return rec
    body = line["response"]["body"]
    chat = body.get("object") == "chat.completion"
    choices = [{"index": c["index"], "completion": c["message"]["content"] if chat else c.get("text"),
                "completion_tokens": None, "finish_reason": c.get("finish_reason"),
                **records.stop_fields(c.get("stop_reason")),
                "logprobs": _native_logprobs(c.get("logprobs"), chat), "output_token_ids": None}
               for c in body["choices"]]
    choice = choices[0]
    prompt_lps = body.get("prompt_logprobs") if chat else body["choices"][0].get("prompt_logprobs")
    rec.update(error=None, completion=choice["completion"], logprobs=choice["logprobs"],
               prompt_logprobs=_native_prompt_logprobs(prompt_lps, extra.get("prompt_top", 0)),
               choices=choices if len(choices) > 1 else None,
               finish_reason=choice.get("finish_reason"), stop_reason=body["choices"][0].get("stop_reason"),
               prompt_tokens=body["usage"]["prompt_tokens"],
               completion_tokens=body["usage"]["completion_tokens"], endpoint="chat" if chat else "completion",
               batch_line=extra.get("batch_line", True),
               request_model=body.get("model"), created=body.get("created"))
    return rec
