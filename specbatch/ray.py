"""specbatch on Ray Data, for clusters: the row contract and config of `ray.data.llm`, run by
specbatch engines (one per actor).

    import ray
    from specbatch.ray import ProcessorConfig, build_processor
    processor = build_processor(ProcessorConfig(model_source="/models/m", recipe="eagle3_topk1",
                                                draft="/models/head", concurrency=4, batch_size=64))
    processor(ray.data.read_parquet("s3://bucket/prompts/")).write_parquet("s3://bucket/out/")

or the stateful class itself:
`ds.map_batches(SpecbatchPredictor, fn_constructor_kwargs={...}, batch_format="pyarrow",
compute=ActorPoolStrategy(size=N, max_tasks_in_flight_per_actor=K, max_concurrent_calls_per_actor=K),
num_gpus=1, batch_size=B)`.

Rows: `messages` (a chat), `prompt` (text) or `tokenized_prompt` (token ids), and an optional
`sampling_params` dict (specbatch's per-row fields: max_tokens, temperature, top_p, top_k, seed,
stop, ...; another key is the row's error). Output: the input columns, then `generated_text`,
`generated_tokens`, `num_input_tokens`, `num_generated_tokens`, `time_taken_llm`, `finish_reason` and the
speculation stats (`spec_verify_steps`, `spec_accepted_tokens`, `spec_accept_length`), then `logprobs` and
`prompt_logprobs` (null unless the row's sampling_params asked; specbatch's column layout). A row
that cannot run raises, or with `should_continue_on_error` carries its message in
`__inference_error__` (the others ""). An engine that breaks (CUDA, out of memory) ends its actor's process: Ray
restarts the actor and retries its batches (at most `max_restarts` times, then the dataset fails;
an exception raised from a batch would fail the dataset at once).

Each actor runs ONE engine in a background thread, fed by every batch it holds: with K batches in
flight per actor (`max_concurrent_batches`; `__call__` is async) their rows share the engine's
slots, so a 32-row batch never becomes a 32-slot engine. A row without its
own seed gets one from its content (every input column) and the run seed, so a retried or resumed
row writes the same bytes: Ray's at-least-once delivery then gives exactly-once results (resume with
`ray.data.checkpoint.CheckpointConfig(id_column=...)`, see README). Rows identical in every column
within a batch take the k-th such row's count into their seeds, so they draw independent samples;
in different batches they draw the same one (a batch cannot see the others): pass@k by repeating a
prompt wants a column that tells the repeats apart (an id, a sample index).
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import os
import queue
import sys
import threading
import time
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import pyarrow as pa

from .data.fields import BadField, check_token_ids, sampling_params_fields
from .engine_args import engine_args
from .records import LOGPROBS_TYPE, PROMPT_LOGPROBS_TYPE
from .row_notes import GreedyByDefault, UnreadFields
from .speculative_config import speculative_base

OUTPUT_COLUMNS = ("generated_text", "generated_tokens", "num_input_tokens", "num_generated_tokens",
                  "time_taken_llm", "finish_reason", "spec_verify_steps", "spec_accepted_tokens",
                  "spec_accept_length", "logprobs", "prompt_logprobs")
ERROR_COLUMN = "__inference_error__"
# Every output column has its type: a batch whose rows all failed holds only nulls, and Arrow's
# null type in one file of a Parquet output makes the whole directory unreadable.
_INT, _FLOAT = pa.int64(), pa.float64()
OUTPUT_TYPES = dict(zip(OUTPUT_COLUMNS, (
    pa.string(), pa.list_(pa.int64()), _INT, _INT, _FLOAT, pa.string(), _INT, _INT, _FLOAT, LOGPROBS_TYPE,
    PROMPT_LOGPROBS_TYPE)))


class EngineFailure(RuntimeError):
    """The engine itself failed (CUDA, capture, out of memory): retry the batch on a fresh actor."""


class RowFailure(ValueError):
    """A row that cannot run, with should_continue_on_error off."""


def _content_key(row: dict[str, Any], run_seed: int | None) -> str:
    # Every input column, not only the prompt and its params: a prompt repeated under several ids
    # (pass@k) must draw independent samples; our own output columns (a re-run over earlier output)
    # leave the seed as it was. The run seed (engine_kwargs' seed) is mixed in as `--seed` is.
    cols = {k: v for k, v in row.items() if k not in OUTPUT_COLUMNS and k != ERROR_COLUMN}
    return json.dumps(cols if not run_seed else [run_seed, cols], sort_keys=True, default=str)


def _content_seed(key: str, occurrence: int = 0) -> int:
    """The seed of a row without its own: a hash of its content (_content_key) and, for the k-th of
    rows identical in every column within one batch, k (pass@k by repeating a row draws k samples;
    a retried batch gives each the same seed again, and identical rows are interchangeable)."""
    if occurrence:
        key = f"{occurrence}:{key}"
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")


def _clock() -> str:
    """Wall-clock time of day to the millisecond, for the actors' lines in the driver's log."""
    now = time.time()
    return f"{time.strftime('%H:%M:%S', time.localtime(now))}.{int(now * 1000) % 1000:03d}"


def _prompt(row: dict[str, Any], apply_chat_template: bool) -> dict[str, Any]:
    """The row's prompt as an input row's field: messages, prompt or tokenized_prompt."""
    if row.get("messages") is not None:
        if not apply_chat_template:
            raise BadField("field 'messages': apply_chat_template is off; give 'prompt' or 'tokenized_prompt'")
        return {"messages": list(row["messages"])}
    if row.get("prompt") is not None:
        return {"prompt": row["prompt"]}
    tokens = row.get("tokenized_prompt")
    if tokens is not None:
        # numpy arrays (other batch formats) as Python ints; validated here to name the column
        tokens = tokens.tolist() if hasattr(tokens, "tolist") else list(tokens)
        return {"prompt_token_ids": check_token_ids(tokens, "tokenized_prompt", non_empty=True)}
    return {}


class SpecbatchPredictor:
    """A stateful callable class for `Dataset.map_batches` (pyarrow batches): one engine per actor."""

    def __init__(self, model_source: str | None = None, recipe: str = "vanilla", draft: str | None = None,
                 engine_kwargs: dict[str, Any] | None = None, apply_chat_template: bool = True,
                 should_continue_on_error: bool = False):
        from .llm import LLM

        t0 = time.perf_counter()
        self.llm = LLM(model=model_source, recipe=recipe, draft=draft, **(engine_kwargs or {}))
        eng = self.llm.engine
        # one line in the driver's log per actor: when it can take rows, and what keeps it full
        print(f"specbatch: engine ready at {_clock()} on "
              f"{eng.device} (loaded in {time.perf_counter() - t0:.1f} s, {eng.num_slots} slots: keep batch_size x "
              f"max_concurrent_batches >= {2 * eng.num_slots} rows in flight to keep them full)", flush=True)
        self.apply_chat_template = apply_chat_template
        self.continue_on_error = should_continue_on_error
        self.greedy = GreedyByDefault(self.llm.recipe.sampling, eng.model_defaults)
        self.unread = UnreadFields()             # (a message role no template may know)
        self.inbox: queue.Queue = queue.Queue()
        self.waiting: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future, dict]] = {}
        self.lock = threading.Lock()
        self.next_row = 0
        self.first_logged = False
        self.failure: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="specbatch-engine", daemon=True)
        self.thread.start()

    # ---- the engine thread: one stream over every batch's rows ------------------------------------

    def _feed(self):
        from .engine import WAIT

        while self.failure is None:
            try:
                yield self.inbox.get_nowait()
            except queue.Empty:
                yield WAIT

    def _run(self) -> None:
        try:
            for rec in self.llm.stream(self._feed()):
                with self.lock:
                    loop, fut, _ = self.waiting.pop(rec["row"])
                done = time.perf_counter()          # the row's own time_taken_llm ends here
                loop.call_soon_threadsafe(lambda f=fut, r=rec, t=done: f.done() or f.set_result((r, t)))
        except BaseException as e:  # noqa: BLE001 - the actor is unusable: let Ray restart it
            self.failure = e
            # An exception raised from __call__ is a user error to Ray Data: it fails the whole
            # dataset (no retry). An actor that dies is restarted and its batches retried.
            print(f"specbatch: engine failed ({type(e).__name__}: {' '.join(str(e).split())}); exiting so "
                  "that Ray restarts this actor and retries its batches", file=sys.stderr, flush=True)
            os._exit(1)

    # ---- a batch ----------------------------------------------------------------------------------

    def _row(self, i: int, row: dict[str, Any], seen: Counter):
        """Row `row` of a batch as the engine's request; `seen`: the batch's content keys so far."""
        from .data import RowError, RowRequest, parse_row

        where = f"row {row['id']}" if row.get("id") is not None else "row"
        try:
            prompt = _prompt(row, self.apply_chat_template)
            if not prompt:
                raise BadField("no 'messages', 'prompt' or 'tokenized_prompt' value (a preprocess returns one)")
            obj = {**sampling_params_fields(row.get("sampling_params")), **prompt}
        except BadField as e:
            return RowError(i, i, f"{where}: {e}")
        req = parse_row(obj, row=i, where=where)
        self.greedy.check(req)                  # (before a seed of its own is derived: not the row's sign)
        self.unread.check(req)
        if isinstance(req, RowRequest) and req.overrides.get("seed") is None:
            key = _content_key(row, self.llm.recipe.sampling.seed)
            req.overrides = {**req.overrides, "seed": _content_seed(key, seen[key])}
            seen[key] += 1
        return req

    async def __call__(self, batch):
        if self.failure is not None:
            raise EngineFailure(str(self.failure))
        rows = batch.to_pylist() if hasattr(batch, "to_pylist") else pa.Table.from_pydict(batch).to_pylist()
        if rows and not self.first_logged:      # how long Ray took to hand this actor its first rows
            self.first_logged = True
            print(f"specbatch: first rows at {_clock()}", flush=True)
        loop = asyncio.get_running_loop()
        t0 = time.perf_counter()
        futures = []
        with self.lock:
            items = []
            seen: Counter = Counter()
            for row in rows:
                i, self.next_row = self.next_row, self.next_row + 1
                fut = loop.create_future()
                self.waiting[i] = (loop, fut, row)
                futures.append(fut)
                items.append(self._row(i, row, seen))
        for item in items:
            self.inbox.put(item)
        done = await asyncio.gather(*futures)
        out: dict[str, list] = {c: [] for c in OUTPUT_COLUMNS}
        errors = []
        for rec, finished in done:
            if rec["error"] and not self.continue_on_error:
                raise RowFailure(rec["error"])
            errors.append(rec["error"] or "")            # "" on success, as ray.data.llm writes it
            took = finished - t0                         # from the batch's arrival to this row's end
            spec = rec.get("spec") or {}
            ids = rec.get("output_token_ids")
            for name, value in zip(OUTPUT_COLUMNS, (
                    rec.get("completion"), ids, rec.get("prompt_tokens"),
                    None if ids is None else len(ids),     # choice 0's, as generated_tokens (n > 1)
                    took, rec.get("finish_reason"), spec.get("verify_steps"), spec.get("accepted_tokens"),
                    spec.get("accept_length"), rec.get("logprobs"), rec.get("prompt_logprobs"))):
                out[name].append(value)
        table = batch if isinstance(batch, pa.Table) else pa.Table.from_pylist(rows)
        # the error column when rows may carry one, or to replace a stale one an input brought along
        # (a re-run over an earlier output), which postprocess would otherwise read as this run's failure
        keep_errors = self.continue_on_error or ERROR_COLUMN in table.column_names
        columns = {**{name: pa.array(values, type=OUTPUT_TYPES[name]) for name, values in out.items()},
                   **({ERROR_COLUMN: pa.array(errors, pa.string())} if keep_errors else {})}
        for name, column in columns.items():
            # an input column of the same name (a re-run dataset's output, say) is replaced, never doubled
            at = table.schema.get_field_index(name)
            table = table.set_column(at, name, column) if at >= 0 else table.append_column(name, column)
        return table


@dataclass
class ProcessorConfig:
    """Mirrors ray.data.llm.vLLMEngineProcessorConfig where the names mean the same thing."""
    model_source: str | None = None          # HF model directory (None: the recipe's; the demo model)
    recipe: str = "vanilla"
    draft: str | None = None
    batch_size: int = 64                     # rows per map_batches batch
    concurrency: int | tuple[int, int] = 1   # actors (engines), or (min, max): an autoscaling pool
    max_concurrent_batches: int = 8          # batches in flight per actor, sharing its slots
    should_continue_on_error: bool = False
    engine_kwargs: dict[str, Any] = field(default_factory=dict)   # LLM(...) options: batch_size, dtype, device, ...
    accelerator_type: str | None = None
    runtime_env: dict[str, Any] | None = None
    apply_chat_template: bool = True
    num_gpus: float | None = None            # per actor (None: 1 unless engine_kwargs device is cpu)
    num_cpus: float = 1                      # per actor
    # hand out batches once every actor has loaded its engine (up to this many seconds, then Ray
    # raises), so that the first actor up does not take every batch of a short dataset; None:
    # Ray's default (batches go to actors as they come up). Set on the dataset's DataContext.
    wait_for_actors_s: float | None = 1800.0
    max_restarts: int = 3                    # per actor, after its engine broke (then the dataset fails)


def _pool_size(concurrency: Any) -> dict[str, int]:
    """`concurrency` as ray.data.llm takes it: N actors, or (min, max) for an autoscaling pool."""
    def whole(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= 1

    if whole(concurrency):
        return {"size": concurrency}
    if isinstance(concurrency, (tuple, list)) and len(concurrency) == 2 and all(map(whole, concurrency)) \
            and concurrency[0] <= concurrency[1]:
        return {"min_size": concurrency[0], "max_size": concurrency[1]}
    raise ValueError(f"ProcessorConfig.concurrency: expected an integer >= 1 or a (min, max) pair with "
                     f"1 <= min <= max, got {concurrency!r}")


def _merged(preprocess: Callable[[dict], dict]) -> Callable[[dict], dict]:
    """As ray.data.llm: preprocess's fields over the input row's, so its columns reach postprocess."""
    def apply(row: dict) -> dict:
        return {**row, **preprocess(row)}
    return apply


def _unless_failed(postprocess: Callable[[dict], dict], keep_error_column: bool) -> Callable[[dict], dict]:
    """As ray.data.llm: a row that failed (its error set) bypasses postprocess, whose code expects a
    completion; the others get an empty error column, so every row has one (should_continue_on_error)."""
    def apply(row: dict) -> dict:
        if row.get(ERROR_COLUMN):
            return row
        result = postprocess(row)
        if keep_error_column:
            result[ERROR_COLUMN] = ""
        return result
    return apply


def _check_engine_kwargs(config: ProcessorConfig) -> None:
    """engine_kwargs as every actor's LLM(...) will read them, refused now rather than in each
    actor as it starts: vLLM's arguments no engine takes, keys no recipe has."""
    import inspect

    from .llm import LLM
    from .recipe import load_recipe

    own = {p.name for p in inspect.signature(LLM.__init__).parameters.values() if p.kind is p.KEYWORD_ONLY}
    given = engine_args(config.engine_kwargs, say=False, model=config.model_source)
    if given.get("chat_template") is not None:
        from .prompts import load_chat_template

        load_chat_template(given["chat_template"], "engine_kwargs['chat_template']")
    recipe = config.recipe
    if "speculative" in given:
        recipe, spec = speculative_base(recipe, config.draft, given.pop("speculative"),
                                        "engine_kwargs['speculative_config']")
        given = {**spec, **given}
    load_recipe(recipe).with_overrides(**{k: v for k, v in given.items() if k not in own})


def build_processor(config: ProcessorConfig, preprocess: Callable[[dict], dict] | None = None,
                    postprocess: Callable[[dict], dict] | None = None) -> Callable[[Any], Any]:
    """A `Dataset -> Dataset` function: preprocess rows, generate on `concurrency` actors, postprocess."""
    import ray.data

    _check_engine_kwargs(config)
    kwargs = {k: v for k, v in asdict(config).items() if k in (
        "model_source", "recipe", "draft", "engine_kwargs", "apply_chat_template", "should_continue_on_error")}
    num_gpus = config.num_gpus
    if num_gpus is None:
        num_gpus = 0 if (config.engine_kwargs.get("device") or "cuda").startswith("cpu") else 1
    k = config.max_concurrent_batches
    # Ray Data restarts an actor that died and retries its batches (bounded: an engine that breaks
    # every time would otherwise be restarted forever).
    compute = ray.data.ActorPoolStrategy(**_pool_size(config.concurrency), max_tasks_in_flight_per_actor=k,
                                         max_concurrent_calls_per_actor=k)

    def process(ds: "ray.data.Dataset") -> "ray.data.Dataset":
        if preprocess is not None:
            ds = ds.map(_merged(preprocess))
        with warnings.catch_warnings():
            # max_restarts has no named parameter yet (Ray 2.60 warns about every other route too)
            warnings.filterwarnings("ignore", message=".*ray_remote_args.* is deprecated")
            ds = ds.map_batches(SpecbatchPredictor, fn_constructor_kwargs=kwargs, batch_size=config.batch_size,
                                batch_format="pyarrow", compute=compute, num_gpus=num_gpus, num_cpus=config.num_cpus,
                                accelerator_type=config.accelerator_type, runtime_env=config.runtime_env,
                                max_restarts=config.max_restarts)
        if postprocess is not None:
            ds = ds.map(_unless_failed(postprocess, config.should_continue_on_error))
        if config.wait_for_actors_s is not None:
            ds.context.wait_for_min_actors_s = config.wait_for_actors_s
        return ds

    return process
