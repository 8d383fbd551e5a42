"""What a job notices about its input rows as they stream past, to say once: bodies naming
another model than the one running, keys that look like request fields but are not read as one,
rows whose sampling fields change nothing for want of a temperature, ids that repeat."""
from __future__ import annotations

import os
import sys
from array import array
from typing import Any


class ModelNames:
    """An OpenAI body naming another model than the one running is said once per name (the
    response echoes the request's name, as a served model's alias): a file prepared for another
    model does not pass for that model's answers without a word."""

    SAID_AT_MOST = 3

    def __init__(self, running: str):
        self.running = running
        self.seen: set[str] = set()

    def check(self, row: Any) -> None:
        name = getattr(row, "request_model", None)
        if (name is None or name in self.seen or len(self.seen) > self.SAID_AT_MOST
                or self.running in (name, os.path.basename(os.path.normpath(name)))):   # the directory, or org/name
            return
        self.seen.add(name)
        if len(self.seen) > self.SAID_AT_MOST:
            print("warning: more rows name other models in body.model; not said again", file=sys.stderr)
            return
        print(f"warning: {row.where}: body.model is {name!r}, but the rows run on {self.running!r}; their "
              "responses echo the request's name", file=sys.stderr)


class UnreadFields:
    """A plain row's key that looks like a request field (`max_new_tokens`, `temprature`) is the
    row's own data, so the row runs without it: said once per key, naming the field it likely
    meant, so a typo does not quietly run every row greedy or at the default length."""

    SAID_AT_MOST = 3
    ROLES = ("system", "developer", "user", "assistant", "tool", "function")    # OpenAI's

    def __init__(self, how_to_keep: str = ""):
        """`how_to_keep`: how to mark such a key as data, for the warning (a flag, or nothing)."""
        self.how_to_keep = how_to_keep
        self.seen: set[str] = set()
        self.roles: set[str] = set()

    def check(self, row: Any) -> None:
        for m in getattr(row, "messages", None) or ():
            # vLLM hands a template any role; many drop a turn whose role they do not know (a
            # ShareGPT 'human'), so the prompt loses it without a word
            role = m["role"]
            if role not in self.ROLES and role not in self.roles and len(self.roles) <= self.SAID_AT_MOST:
                self.roles.add(role)
                print(f"warning: {row.place}: a message's role is {role!r}, not one of OpenAI's "
                      f"({', '.join(self.ROLES)}): the chat template decides what it makes of such a turn, "
                      "and many leave it out; rename the role if it means one of them (said once a role)",
                      file=sys.stderr)
        for key, meant in getattr(row, "unread", ()):
            if key in self.seen or len(self.seen) > self.SAID_AT_MOST:
                continue
            self.seen.add(key)
            if len(self.seen) > self.SAID_AT_MOST:
                print("warning: more keys look like request fields and are not read as one; not said again",
                      file=sys.stderr)
                return
            keep = self.how_to_keep.format(key=key)
            print(f"warning: {row.place}: '{key}' is not a request field, so the row runs without it; did you mean "
                  f"'{meant}'?{' ' + keep if keep else ''}", file=sys.stderr)


class GreedyByDefault:
    """A plain row setting top_p, top_k, min_p, n > 1 or a seed of its own with nothing setting a
    temperature runs greedy (specbatch's default), so those fields change nothing and n > 1 repeats
    one completion; vLLM's SamplingParams default to temperature 1.0, so its users' {top_p, n, seed}
    would sample. Said once."""

    SHAPING = ("top_p", "top_k", "min_p", "n", "seed")

    def __init__(self, defaults: Any, model: dict | None):
        """`defaults`: the run's SamplingParams (flags and recipe); `model`: generation_config.json's."""
        self.said = False
        self.use(defaults, model)

    def use(self, defaults: Any, model: dict | None, seeded: bool = False) -> None:
        """Other run defaults (LLM.generate's per call; `seeded`: its params set a seed, every
        prompt's own); what was said stays said."""
        self.defaults, self.model, self.seeded = defaults, model or {}, seeded
        # per row only what a row can change: most rows set none of these, and cost a lookup each
        self.tempered = defaults.temperature is not None or "temperature" in self.model
        self.asked_by_defaults = bool(defaults.unsampled({}, self.model, seeded))

    def check(self, row: Any) -> None:
        if self.said or self.tempered or not isinstance(getattr(row, "overrides", None), dict) or row.batch_line:
            return                                   # (an OpenAI line samples at 1.0 when unset)
        ov = row.overrides
        if not self.asked_by_defaults and not any(k in ov for k in self.SHAPING):
            return
        asked = self.defaults.unsampled(ov, self.model, self.seeded)
        if not asked:
            return
        self.said = True
        names = " and ".join("n > 1" if k == "n" else "a seed" if k == "seed" else k for k in asked)
        repeat = " and its n completions are one, repeated" if "n" in asked else ""
        print(f"warning: {row.place}: {names} {'are' if len(asked) > 1 else 'is'} set but no temperature is (row, "
              f"flags, recipe or the model's generation_config.json), so the row runs greedy{repeat}; vLLM's "
              "SamplingParams would sample at temperature 1.0: set temperature to sample (said once)", file=sys.stderr)


    def unset_in_object(self) -> None:
        """LLM.generate's SamplingParams object with no temperature (nor the LLM's): greedy here,
        where vLLM's SamplingParams() samples at 1.0 (a pass@k loop would get k copies). Said once,
        with the row note above."""
        if self.said:
            return
        self.said = True
        print("warning: sampling_params: a SamplingParams with no temperature runs greedy here (specbatch's default), "
              "where vLLM's samples at temperature 1.0: set temperature (0 for greedy) to say which (said once)",
              file=sys.stderr)


class RepeatedIds:
    """Rows whose id another row has too (a row without one takes its row number, which can meet a
    given id; 1 and "1" count as one, as a Parquet id column of mixed types stores them): results
    joined back by id would go to the wrong rows. 8 bytes a row: a 64-bit hash of each id, in row
    order, compared once at the end. A line whose id could not be read has none, and is left out
    (16 bytes then: the rows' numbers are kept beside their hashes)."""

    def __init__(self) -> None:
        self.hashes = array("q")
        self.rows: array | None = None      # row numbers once one row was left out (else index = row)

    def add(self, row: Any) -> None:
        if row.id is None:
            if self.rows is None:
                self.rows = array("q", range(len(self.hashes)))
            return
        self.hashes.append(hash(str(row.id)))
        if self.rows is not None:
            self.rows.append(row.row)

    def count(self) -> tuple[int, tuple[int, int] | None]:
        """(rows whose id an earlier row has, (the first such row, the first row of that id) or None)."""
        import numpy as np

        h = np.frombuffer(self.hashes, dtype=np.int64)
        order = np.argsort(h, kind="stable")               # equal ids keep row order: each run's first is first
        hs = h[order]
        same = hs[1:] == hs[:-1]
        repeats = int(same.sum())
        if not repeats:
            return 0, None
        later = int(order[1:][same].min())
        first = int(order[np.searchsorted(hs, h[later])])
        if self.rows is not None:
            return repeats, (self.rows[later], self.rows[first])
        return repeats, (later, first)
