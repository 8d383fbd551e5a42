"""The OpenAI Batch output format (what `vllm run-batch` writes), one line per request:

    {"id": "batch_req_...", "custom_id": ..., "response": {"status_code": 200, "request_id": ...,
     "body": <chat.completion | text_completion>}, "error": null, "specbatch": {"row": ..., "spec": ...}}

The body is a `chat.completion` (choices[].message) for chat requests and a `text_completion`
(choices[].text) for completions, with `usage`. A row that could not run is a line with
`response` null and `error` {"code", "message"}. Speculation stats and the input row number ride
along in the extra top-level field `specbatch` (ignored by OpenAI clients; a resume reads the row
back from it). Ids are derived from the row and custom_id, so a rerun writes the same ids.
"""
from __future__ import annotations

import hashlib
from typing import Any

ERROR_CODE = "invalid_request"


def _hex(*parts: object, n: int = 24) -> str:
    return hashlib.blake2b("\x1f".join(map(str, parts)).encode(), digest_size=16).hexdigest()[:n]


def to_openai_line(rec: dict[str, Any], model: str) -> dict[str, Any]:
    """A merged output row (native columns plus endpoint / request_model / created) as one line."""
    row, custom_id = rec["row"], (None if rec.get("id") is None else str(rec["id"]))   # a string, as OpenAI's
    line: dict[str, Any] = {"id": f"batch_req_{_hex('batch', row, custom_id)}", "custom_id": custom_id}
    if rec.get("error"):
        line.update(response=None, error={"code": ERROR_CODE, "message": rec["error"]})
    else:
        chat = rec.get("endpoint") == "chat"
        choice: dict[str, Any] = {"index": 0, "finish_reason": rec.get("finish_reason"), "logprobs": None}
        if chat:
            choice["message"] = {"role": "assistant", "content": rec.get("completion")}
        else:
            choice["text"] = rec.get("completion")
        usage = {"prompt_tokens": rec.get("prompt_tokens") or 0, "completion_tokens": rec.get("completion_tokens") or 0}
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        body = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{_hex('body', row, custom_id)}",
                "object": "chat.completion" if chat else "text_completion",
                "created": rec.get("created") or 0, "model": rec.get("request_model") or model,
                "choices": [choice], "usage": usage}
        line.update(response={"status_code": 200, "request_id": f"req-{_hex('req', row, custom_id)}", "body": body},
                    error=None)
    line["specbatch"] = {"row": row, "spec": rec.get("spec"), "batch_line": bool(rec.get("batch_line"))}
    if rec.get("output_token_ids") is not None:
        line["specbatch"]["output_token_ids"] = rec["output_token_ids"]
    return line


def from_openai_line(line: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI line written by to_openai_line back as a native record (a finished output reopened
    to add rows)."""
    extra = line.get("specbatch") or {}
    rec: dict[str, Any] = {"row": extra["row"], "id": line.get("custom_id"), "spec": extra.get("spec"),
                           "output_token_ids": extra.get("output_token_ids")}
    if line.get("error"):
        rec.update(error=line["error"].get("message"), completion=None, prompt_tokens=0, completion_tokens=0)
        return rec
    body = line["response"]["body"]
    choice = body["choices"][0]
    chat = body.get("object") == "chat.completion"
    rec.update(error=None, completion=choice["message"]["content"] if chat else choice.get("text"),
               finish_reason=choice.get("finish_reason"), prompt_tokens=body["usage"]["prompt_tokens"],
               completion_tokens=body["usage"]["completion_tokens"], endpoint="chat" if chat else "completion",
               batch_line=extra.get("batch_line", True),
               request_model=body.get("model"), created=body.get("created"))
    return rec
