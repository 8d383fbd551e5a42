"""The job manifest: what a finished output or a parts directory records of the job that wrote it
(a job id, every setting that changes row content), and the one-line comparison with this job."""
from __future__ import annotations

import json

from ..params import OPENAI_LINES_BEFORE
from .rows import OutputError

MANIFEST = "manifest.json"               # inside the parts directory
MANIFEST_KEY = b"specbatch.manifest"     # inside a finished Parquet output's footer
MANIFEST_VERSION = 2
_UNSET = object()
# Settings added to the fingerprint later: what a manifest written before them meant (logprobs
# were the processed ones before --logprobs-mode, so `--logprobs-mode processed_logprobs` resumes
# it; OpenAI lines read otherwise before, so such an output is refused, naming how).
_LEGACY = {"settings.logprobs_mode": "processed_logprobs", "settings.openai_lines": OPENAI_LINES_BEFORE}
# Settings added to the fingerprint later that change only some rows: a manifest written before
# one is not refused for lacking it; the job checks the committed rows instead (`deferred`: a
# committed row read the new way cannot resume an output begun the old way). ray_fields: a row's
# sampling_params and tokenized_prompt (Ray Data LLM's) were its data before, now they are read.
DEFERRED = ("settings.ray_fields",)
# Spellings of one setting that run the same rows: no run seed is seed 0 (params.for_row).
_SAME = {"settings.sampling.seed": (None, 0)}
# Values an older manifest wrote where this one writes what they resolved to: a manifest from
# before the fingerprint held the dtype the rows were computed in says what was asked (`auto`),
# which matches a run asking `auto` again, as it did then. What was asked is not compared itself.
_ASKED = {"settings.dtype": ("auto", "settings.dtype_requested")}
_NOT_COMPARED = {"settings.dtype_requested"}


def jsonable(value: object) -> object:
    return json.loads(json.dumps(value, sort_keys=True, default=str))


def _flat(d: object, prefix: str = "") -> dict[str, object]:
    if not isinstance(d, dict):
        return {prefix.rstrip("."): d}
    out: dict[str, object] = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def _show(value: object) -> str:
    return "<unset>" if value is _UNSET else json.dumps(value, default=str)


def mismatch(stored: dict, mine: dict) -> str | None:
    """Every differing setting between a stored manifest and this job's, as 'key: old -> new'."""
    old = _flat({"settings": stored.get("fingerprint", {}), "save_token_ids": stored.get("save_token_ids", _UNSET),
                 "keep_columns": stored.get("keep_columns", _UNSET)})
    new = _flat({"settings": mine["fingerprint"], "save_token_ids": mine["save_token_ids"],
                 "keep_columns": mine["keep_columns"]})
    if "fingerprint" in stored:
        for key, value in _LEGACY.items():
            if key in new:
                old.setdefault(key, value)
    diffs = []
    for key in [*new, *(k for k in old if k not in new)]:
        a, b = old.get(key, _UNSET), new.get(key, _UNSET)
        if key in DEFERRED and a is _UNSET and "fingerprint" in stored:
            continue                                       # checked row by row (deferred)
        if key in _NOT_COMPARED or (key in _ASKED and a == _ASKED[key][0] and new.get(_ASKED[key][1]) == a):
            continue
        if a != b and not (key in _SAME and a in _SAME[key] and b in _SAME[key]):
            diffs.append(f"{key.removeprefix('settings.')}: {_show(a)} -> {_show(b)}")
    return "; ".join(dict.fromkeys(diffs)) or None       # (keep_columns is in both the settings and the top level)


def deferred(stored: dict) -> set[str]:
    """The DEFERRED settings a stored manifest predates (names without `settings.`)."""
    fp = stored.get("fingerprint")
    return {k.removeprefix("settings.") for k in DEFERRED
            if isinstance(fp, dict) and k.removeprefix("settings.") not in fp}


def check(stored: dict, mine: dict, where: str, how: str) -> None:
    """Refuse, in one line naming `where` and every differing setting, another job's output."""
    if stored.get("version") != MANIFEST_VERSION:
        raise OutputError(f"{where} was written by another version of specbatch (manifest version "
                          f"{stored.get('version')}, this one reads {MANIFEST_VERSION}); {how}")
    diff = mismatch(stored, mine)
    if diff is not None:
        raise OutputError(f"{where} was written by a different job ({diff}); {how}")


def read_json(path: str) -> object:
    try:
        with open(path, "rb") as f:
            return json.loads(f.read())
    except (OSError, ValueError):
        return None
