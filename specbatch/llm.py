"""The library entry point: `LLM(...).generate(prompts)`, what `specbatch run` and `run_job` use too.

    from specbatch import LLM
    llm = LLM(recipe="eagle3_topk1")                 # the embedded demo model and its EAGLE3 head
    outs = llm.generate(["def fib(n):", [{"role": "user", "content": "hi"}]],
                        {"max_tokens": 32, "temperature": 0})
    print(outs[0].text, outs[0].spec["accept_length"])
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Union

from .chat_template import content_as_parts
from .data import RowError, RowRequest, parse_row
from .engine_args import engine_args
from .params import DEFAULT_LOGPROBS_MODE, FALLBACK, MODEL_DEFAULT_KEYS, SamplingParams
from .prompts import PromptError, chat_template_of, encode_row, load_chat_template, render_chat
from .recipe import Recipe, RecipeError, load_recipe
from .request_output import CompletionOutput, Logprob, outputs, prompt_logprobs
from .resolve import describe_draft, resolve_model, spec_config
from .row_notes import GreedyByDefault, UnreadFields
from .speculative_config import speculative_base

# A prompt: text, a chat (list of {role, content}), token ids, or a whole input row as a dict
# (the forms and per-row fields of an input file, OpenAI batch lines included).
Prompt = Union[str, Sequence[Mapping[str, Any]], Sequence[int], Mapping[str, Any]]


@dataclass
class Completion:
    """One prompt's result: the same fields as an output row of `specbatch run`."""
    index: int                        # position in the list given to generate() (the input row)
    id: str | int | None
    text: str | None                  # None for a prompt that could not run (see `error`)
    token_ids: list[int] | None       # generated ids, ending with EOS when generation stopped on it
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str | None         # "stop" | "length"
    error: str | None
    spec: dict[str, Any] | None       # verify_steps, draft_tokens, accepted_tokens, accept_length, accept_histogram
    logprobs: list[dict[str, Any]] | None = None   # per token {token_id, token, logprob, top_logprobs}: rows that asked
    choices: list[dict[str, Any]] | None = None    # n > 1: every choice (index, completion, ..., logprobs)
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it (None: EOS, length)
    record: dict[str, Any] = field(default_factory=dict, repr=False)   # every column (records.py), as a file row

    @classmethod
    def from_record(cls, rec: Mapping[str, Any]) -> "Completion":
        return cls(index=rec["row"], id=rec.get("id"), text=rec.get("completion"),
                   token_ids=rec.get("output_token_ids"), prompt_tokens=rec.get("prompt_tokens", 0),
                   completion_tokens=rec.get("completion_tokens", 0), finish_reason=rec.get("finish_reason"),
                   error=rec.get("error"), spec=rec.get("spec"), logprobs=rec.get("logprobs"),
                   choices=rec.get("choices"), stop_reason=rec.get("stop_reason"), record=dict(rec))

    def to_dict(self) -> dict[str, Any]:
        """The fields, prompt_logprobs in the output column's form."""
        return {**asdict(self), "prompt_logprobs": self.record.get("prompt_logprobs")}

    # ---- read as vLLM's RequestOutput (a migrated script's o.outputs[0].text) ----
    @property
    def outputs(self) -> list[CompletionOutput]:
        """Every completion (n of them) as vLLM's CompletionOutput; none for a prompt that failed."""
        return outputs(self.record)

    @property
    def finished(self) -> bool:
        return True                         # generate() returns finished prompts only

    @property
    def prompt_logprobs(self) -> list[dict[int, Logprob] | None] | None:
        """vLLM's RequestOutput.prompt_logprobs: None for the first prompt token, then per token
        {token_id: Logprob} for it and its top alternatives (None: not asked). The output column's
        form (token_id, token, logprob, rank, top_logprobs) is record["prompt_logprobs"]."""
        return prompt_logprobs(self.record)

    @property
    def request_id(self) -> str:
        """As vLLM's: the LLM's count of requests before this one, across generate() calls."""
        return self.__dict__.get("_request_id", str(self.index))

    @property
    def prompt(self) -> str | None:
        """The prompt's text (vLLM's RequestOutput.prompt): as given, a chat as its template rendered
        it; None for token ids (as vLLM's) or a prompt whose fields could not be read."""
        return self._prompt()[0]

    @property
    def prompt_token_ids(self) -> list[int] | None:
        """The prompt's token ids as the model read them; None where they could not be made."""
        return self._prompt()[1]

    def __getstate__(self) -> dict[str, Any]:
        """Pickled (a process pool, Ray) with its prompt made, not with the tokenizer that makes it."""
        self._prompt()
        return {k: v for k, v in self.__dict__.items() if k != "_source"}

    def _prompt(self) -> tuple[str | None, list[int] | None]:
        # Made when first read (a script that never reads them pays nothing); generate() attaches
        # the row and tokenizer as `_source`.
        if "_prompt_cache" not in self.__dict__:
            row, tokenizer, vocab = getattr(self, "_source", (None, None, 0))
            text = ids = None
            if isinstance(row, RowRequest):
                try:
                    text = render_chat(tokenizer, row) if row.messages is not None else row.prompt
                    ids = encode_row(tokenizer, row, vocab, rendered=text if row.messages is not None else None)
                except PromptError:
                    pass
            self.__dict__["_prompt_cache"] = (text, ids)
        return self.__dict__["_prompt_cache"]


def _row(prompt: Prompt, index: int) -> RowRequest | RowError:
    where = f"prompt {index}"
    if isinstance(prompt, str):
        obj: Any = {"prompt": prompt}
    elif isinstance(prompt, Mapping):
        if "role" in prompt and not any(k in prompt for k in ("prompt", "messages", "prompt_token_ids", "body")):
            raise TypeError(f"{where}: a chat message, not a prompt: pass each chat as a list of "
                            "messages, e.g. generate([[{'role': 'user', 'content': '...'}]])")
        obj = dict(prompt)
    elif isinstance(prompt, Sequence) and prompt and all(isinstance(m, Mapping) for m in prompt):
        obj = {"messages": [dict(m) for m in prompt]}
    elif isinstance(prompt, Sequence) and not isinstance(prompt, (bytes, bytearray)):
        obj = {"prompt_token_ids": list(prompt)}
    else:
        raise TypeError(f"{where}: expected a string, a list of chat messages, a list of token ids or a "
                        f"row dict, got {type(prompt).__name__}")
    return parse_row(obj, row=index, where=where)


def _one_prompt(prompts: Any) -> bool:
    """generate() was given one prompt (text, a row, or token ids), not a list of prompts. A list
    with any prompt in it is a list of prompts (judged by its first item alone, [None, "text", ...]
    was one prompt of token ids: one error Completion for the whole list)."""
    if isinstance(prompts, (str, Mapping)):
        return True
    return (isinstance(prompts, Sequence) and bool(prompts)
            and not any(isinstance(p, (str, Mapping, Sequence)) for p in prompts))


def _get(params: SamplingParams | Mapping[str, Any], key: str) -> Any:
    return getattr(params, key) if isinstance(params, SamplingParams) else params.get(key)


def _with_progress(records: Iterator[dict[str, Any]], total: int,
                   use_tqdm: bool | Callable[..., Any]) -> Iterator[dict[str, Any]]:
    """The records, a progress bar advancing by one for each: rich's on stderr (True), none
    (False), or the given tqdm-like class's (update(1), close())."""
    if use_tqdm is False or not total:
        yield from records
        return
    if use_tqdm is True:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        with Progress(TextColumn("Processed prompts"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=Console(stderr=True)) as bar:
            task = bar.add_task("prompts", total=total)
            for rec in records:
                bar.advance(task)
                yield rec
        return
    if not callable(use_tqdm):
        raise TypeError(f"use_tqdm: expected True, False or a tqdm-like class, got {type(use_tqdm).__name__}")
    bar = use_tqdm(total=total, desc="Processed prompts")
    try:
        for rec in records:
            bar.update(1)
            yield rec
    finally:
        bar.close()


_CALL_MIX = 0x9E3779B97F4A7C15     # odd 64-bit constant: a call's count spread over the run seed's bits


def _seeded(rows: Iterable[RowRequest | RowError], seed: int) -> Iterator[RowRequest | RowError]:
    for r in rows:
        if isinstance(r, RowRequest) and r.overrides.get("seed") is None:
            r.overrides = {**r.overrides, "seed": seed}
        yield r


class SamplingParamsError(RecipeError, ValueError):
    """Sampling params LLM.generate / chat cannot take (a ValueError, as vLLM's SamplingParams
    raises), naming the field and, for a per-prompt list, the prompt."""


def _sampling_error(e: RecipeError, where: str) -> SamplingParamsError:
    if e.key is not None:
        return SamplingParamsError(f"{where}: {e.key.removeprefix('sampling.')}: {e.detail}", e.key, e.detail)
    text = str(e).partition(" (overrides): ")[2] or str(e)      # the recipe file's name is not the user's
    return SamplingParamsError(f"{where}: {text.replace('sampling.', '')}")


def _refuse_unsupported(params: dict) -> None:
    """vLLM sampling fields specbatch does not implement, named as such (not as an unknown key); one
    at its default asks for nothing and is dropped."""
    from .data.fields import UNSUPPORTED_FIELDS, VLLM_ONLY_SAMPLING, BadField, check_unsupported, check_vllm_only

    try:
        check_vllm_only(params, "")
    except BadField as e:                    # "field 'k': ..." as the other sampling_params errors read: "k: ..."
        key, _, rest = str(e).removeprefix("field '").partition("'")
        raise SamplingParamsError(f"sampling_params: {key}{rest}") from None
    try:
        check_unsupported(params, "")
    except BadField as e:
        raise SamplingParamsError(f"sampling_params: {e}".replace("field '", "'", 1)) from None
    for key in [k for k in params if k in UNSUPPORTED_FIELDS or k in VLLM_ONLY_SAMPLING]:
        del params[key]


# vLLM's LLM.generate / chat arguments specbatch has nothing for: their defaults ask for nothing.
_VLLM_ARGUMENTS = {
    "lora_request": "LoRA adapters", "priority": "request priorities", "tokenization_kwargs": "tokenization options",
    "tools": "tool definitions for the template",
    "mm_processor_kwargs": "multimodal inputs",
}


def _refuse_vllm_arguments(call: str, given: Mapping[str, Any], template: str | None = None) -> None:
    """A vLLM argument at its default (None; priority all zeros; chat_template_content_format
    'auto', or the form the model's `template` reads, which 'auto' picks) is dropped; set, a
    ValueError naming it."""
    for key, value in given.items():
        if key == "chat_template_content_format":
            reads = "openai" if template and content_as_parts(template) else "string"
            if value not in ("auto", reads):
                raise ValueError(f"{call}(chat_template_content_format={value!r}): this model's chat template reads "
                                 f"message content as {reads!r} (the form 'auto' picks, as vLLM detects it); "
                                 "specbatch hands the template that form only")
            continue
        if value is None or (key == "priority" and not any(value if isinstance(value, Sequence) else [value])):
            continue
        what = _VLLM_ARGUMENTS.get(key)
        if what is None:
            raise TypeError(f"{call}() got an unexpected keyword argument '{key}'")
        raise ValueError(f"{call}({key}=...): not supported by specbatch yet ({what}); remove it")


class LLM:
    """A loaded target (and draft) ready to generate, reusable across calls.

    `model`: an HF model directory (default: the recipe's; the embedded demo model for builtin
    recipes). `recipe`: a builtin recipe name, a YAML path or a Recipe. `overrides`: recipe keys
    (batch_size, dtype, max_model_len, gpu_memory_utilization, and sampling defaults such as
    max_tokens or temperature).
    `logprobs_mode`: what logprobs hold, in vLLM's modes (raw_logprobs by default, as vLLM's).
    """

    def __init__(self, model: str | Path | None = None, recipe: str | Recipe = "vanilla", *,
                 draft: str | Path | None = None, device: str | None = None, eager: bool = False,
                 bucket: int = 0, enable_prefix_caching: bool = True, logprobs_mode: str = DEFAULT_LOGPROBS_MODE,
                 chat_template: str | Path | None = None, **overrides: Any):
        from .engine import Engine, EngineOptions      # torch is imported here, not at package import

        overrides = engine_args(overrides, eager, model=model)
        eager = overrides.pop("eager", eager)
        if "speculative" in overrides:     # vLLM's speculative_config: the recipe doing what it asks
            recipe, spec = speculative_base(recipe, draft, overrides.pop("speculative"), "LLM(speculative_config=...)")
            draft = spec.pop("draft")
            overrides = {**spec, **overrides}
        base = recipe if isinstance(recipe, Recipe) else load_recipe(str(recipe))
        try:
            self.recipe = base.with_overrides(model=None if model is None else str(model),
                                              draft=None if draft is None else str(draft), **overrides)
        except RecipeError as e:             # the caller's keyword, not the recipe file, is named
            raise RecipeError(str(e).replace(f"{base.source} (overrides)", "LLM(...)", 1), e.key, e.detail) from None
        spec = spec_config(self.recipe)
        # a file or the template's text (vLLM's --chat-template), read before the model loads
        template = None if chat_template is None else load_chat_template(chat_template, "LLM(chat_template=...)")
        self.model_dir = resolve_model(self.recipe.model)
        self.draft = describe_draft(self.recipe, spec.draft)
        r = self.recipe
        self.engine = Engine(self.model_dir, EngineOptions(
            batch_size=r.batch_size, max_model_len=r.max_model_len, dtype=r.dtype, device=device,
            gpu_memory_utilization=r.gpu_memory_utilization,
            bucket_window=bucket, spec=spec, graphs=not eager, prefix_caching=enable_prefix_caching,
            logprobs_mode=logprobs_mode))
        if template is not None:
            self.engine.tokenizer.chat_template = template
        self.calls = 0          # generate() calls so far: each later one draws fresh samples (_records)
        self._requests = 0      # prompts so far: their request ids (vLLM's counter)
        # what generate() says once about its prompts, once for this LLM (an eval loop calls it often)
        self._unread = UnreadFields()
        self._greedy = GreedyByDefault(self.recipe.sampling, self.engine.model_defaults)

    def sampling(self, params: SamplingParams | Mapping[str, Any] | None) -> SamplingParams:
        """The recipe's sampling defaults with `params` applied (validated as recipe keys)."""
        if params is None:
            return self.recipe.sampling
        if isinstance(params, SamplingParams):
            params = params.to_dict()
            if params["max_tokens"] is None:    # the dataclass's default, unset: the recipe's, else the row's
                del params["max_tokens"]
        else:
            params = dict(params)
        if "seed" in params and params["seed"] is None:     # no seed of its own: the run seed stays
            del params["seed"]
        if "n" in params and params["n"] is None:           # null asks for nothing: one completion
            del params["n"]
        _refuse_unsupported(params)
        if "best_of" in params:                  # vLLM's: null or n is n, as a row's field reads it
            best_of = params.pop("best_of")
            if best_of is not None and best_of != (params.get("n") or 1):
                raise SamplingParamsError(f"sampling_params: best_of: not supported by specbatch yet (got {best_of}); "
                                          "remove it or set it to n")
        if "max_tokens" in params and params["max_tokens"] is None:    # as vLLM's: up to the context
            params["max_tokens"] = self.engine.max_len
        try:
            out = self.recipe.with_overrides(sampling=params).sampling
        except RecipeError as e:
            raise _sampling_error(e, "sampling_params") from None
        vocab = self.engine.cfg.vocab_size
        outside = [t for t, _ in out.logit_bias if t >= vocab]
        if outside and params.get("logit_bias"):     # (the recipe's own were checked when it loaded)
            raise SamplingParamsError(f"sampling_params: logit_bias: token id {outside[0]} is outside the model's "
                                      f"vocabulary (size {vocab})", "logit_bias", "outside the vocabulary")
        return out

    def _per_prompt(self, rows: list[RowRequest | RowError],
                    params: Sequence[SamplingParams | Mapping[str, Any]]) -> list[RowRequest]:
        """vLLM's list of SamplingParams, one per prompt: each prompt's own, under its row's fields
        (into the row's overrides). -> the rows whose params are SamplingParams objects."""
        if len(params) != len(rows):
            raise ValueError(f"params: {len(params)} sampling params for {len(rows)} prompts; give one "
                             "per prompt, or one mapping for all")
        given = []
        resolved: dict[int, dict[str, Any]] = {}    # by the params object: one SamplingParams for all, once
        for i, (r, p) in enumerate(zip(rows, params)):
            if not isinstance(r, RowRequest):
                continue
            own = resolved.get(id(p))
            if own is None:
                try:
                    own = self.sampling(p).to_dict()
                except SamplingParamsError as e:
                    raise SamplingParamsError(str(e).replace("sampling_params:", f"sampling_params[{i}]:", 1),
                                              e.key, e.detail) from None
                if _get(p, "seed") is None:     # the run seed stays a run seed (rows derive theirs)
                    del own["seed"]
                if own["max_tokens"] is None:   # unset: the row's form's default, as for one mapping
                    del own["max_tokens"]
                resolved[id(p)] = own
            r.overrides = {**own, **r.overrides}
            if isinstance(p, SamplingParams):
                given.append(r)
        return given

    def _unset_as_given(self, fields: Mapping[str, Any]) -> dict[str, Any]:
        """The values a SamplingParams object (under a row's fields) leaves unset among those a
        model's generation config may set: the LLM's own defaults (recipe, keywords) stay, the
        rest take specbatch's."""
        return {k: FALLBACK[k] for k in MODEL_DEFAULT_KEYS
                if fields.get(k) is None and getattr(self.recipe.sampling, k) is None}

    def stream(self, rows: Iterable[RowRequest | RowError],
               params: SamplingParams | Mapping[str, Any] | None = None,
               alone: Sequence[RowRequest | RowError] = (), vouch: bool = True) -> Iterator[dict[str, Any]]:
        """Output records (dicts, as `specbatch run` writes them) in completion order, streaming `rows`.
        A `seed` in `params` is every request's own seed (as vLLM's SamplingParams(seed=...)), not
        a run seed the rows derive theirs from: identical prompts give identical samples. `alone`:
        rows run one at a time before `rows` (the job's suspects: engine/failures.py); `vouch`: as
        Engine.generate's."""
        return self._records(rows, params, alone, vouch)

    def _records(self, rows: Iterable[RowRequest | RowError], params: SamplingParams | Mapping[str, Any] | None,
                 alone: Sequence[RowRequest | RowError] = (), vouch: bool = True,
                 call: int = 0) -> Iterator[dict[str, Any]]:
        """`call`: generate()'s count. Rows without a seed derive theirs from the run seed and
        their row number; a later call mixes its count into the run seed, so each call draws
        fresh samples (as vLLM's generator moves on between calls) and a script run again draws
        the same ones."""
        defaults = self.sampling(params)
        seed = defaults.seed if params is not None and _get(params, "seed") is not None else None
        if seed is not None:
            rows, alone = _seeded(rows, seed), list(_seeded(alone, seed))
        elif call:
            defaults = replace(defaults, seed=((defaults.seed or 0) ^ (call * _CALL_MIX)) % (1 << 64))
        return self.engine.generate(rows, defaults, alone=alone, vouch=vouch)

    def reset_prefix_cache(self) -> None:
        """Forget the prompt pages earlier calls left in the KV pool (as vLLM's LLM.reset_prefix_cache):
        the next call prefills every prompt in full, e.g. to time it cold."""
        self.engine.reset_prefix_cache()

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Mapping[str, Any] | Sequence[SamplingParams | Mapping[str, Any]]
                 | None = None, use_tqdm: bool | Callable[..., Any] = True, lora_request: Any = None,
                 **vllm: Any) -> list[Completion]:
        """One Completion per prompt, in the order given. A prompt that cannot run (too long,
        bad fields) comes back with `error` set; the others are unaffected. `sampling_params`:
        defaults for every prompt, or (as vLLM's list of SamplingParams) one per prompt, each
        complete; a row dict's own fields win over either. `use_tqdm`: a progress bar on stderr
        (as vLLM's: True, False, or a tqdm-like class called with total= and desc=). vLLM's other
        arguments (lora_request, priority, tokenization_kwargs) are taken at their defaults only."""
        _refuse_vllm_arguments("generate", {"lora_request": lora_request, **vllm})
        if _one_prompt(prompts):
            prompts = [prompts]
        rows = [_row(p, i) for i, p in enumerate(prompts)]
        for r in rows:
            self._unread.check(r)
        params = sampling_params
        if isinstance(params, SamplingParams):      # used as given, prompt by prompt (see below)
            self.sampling(params)                   # (its errors named as one set's, not prompt 0's)
            params = [params] * len(rows)
        given: list[RowRequest] = []                # rows whose params are SamplingParams objects
        if isinstance(params, Sequence) and not isinstance(params, (str, bytes)):
            given = self._per_prompt(rows, params)
            params = None
        self._greedy.use(self.sampling(params), self.engine.model_defaults,
                         seeded=params is not None and _get(params, "seed") is not None)
        for r in rows:
            self._greedy.check(r)
        # A SamplingParams is used as given, as vLLM's LLM.generate uses one: the model's
        # generation_config.json does not fill what it leaves unset (it fills a mapping's, a row's,
        # params=None's, as vLLM's server and its default params do). An OpenAI batch line reads
        # as the API (its unset temperature 1). (After the notes, which ask what set a temperature.)
        plain = [r for r in given if not r.batch_line]
        if self.recipe.sampling.temperature is None and any(r.overrides.get("temperature") is None for r in plain):
            self._greedy.unset_in_object()
        for r in plain:
            r.overrides = {**r.overrides, **self._unset_as_given(r.overrides)}
        self.calls += 1
        records = self._records(rows, params, call=self.calls - 1)
        out = [Completion.from_record(rec) for rec in _with_progress(records, len(rows), use_tqdm)]
        for c in out:
            c._source = (rows[c.index], self.engine.tokenizer, self.engine.cfg.vocab_size)
            c._request_id = str(self._requests + c.index)
        self._requests += len(rows)
        return sorted(out, key=lambda c: c.index)

    def chat(self, messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
             sampling_params: SamplingParams | Mapping[str, Any] | Sequence[SamplingParams | Mapping[str, Any]]
             | None = None, use_tqdm: bool | Callable[..., Any] = True, lora_request: Any = None,
             chat_template: str | None = None, chat_template_content_format: str = "auto",
             add_generation_prompt: bool = True, continue_final_message: bool = False, tools: Any = None,
             chat_template_kwargs: Mapping[str, Any] | None = None, **vllm: Any) -> list[Completion]:
        """vLLM's LLM.chat (its arguments in its order): one conversation (a list of {role, content}
        messages) or a list of them, each rendered by the model's chat template with these options
        (as a row's fields of the same names), then `generate`; `chat_template`: this call's template
        instead of the model's (its text, or a file's path). lora_request, tools and
        mm_processor_kwargs are taken at their defaults only."""
        tokenizer = self.engine.tokenizer
        template = chat_template_of(tokenizer) if chat_template is None else \
            load_chat_template(chat_template, "chat(chat_template=...)")
        _refuse_vllm_arguments("chat", {"lora_request": lora_request,
                                        "chat_template_content_format": chat_template_content_format,
                                        "tools": tools, **vllm}, template)
        if continue_final_message and add_generation_prompt:       # the caller's, as vLLM raises it
            raise ValueError("chat(continue_final_message=True) needs add_generation_prompt=False: the final "
                             "message is continued, not followed by a new turn")
        convs = [messages] if messages and isinstance(messages[0], Mapping) else list(messages)
        options = {"add_generation_prompt": add_generation_prompt, "continue_final_message": continue_final_message,
                   "chat_template_kwargs": None if chat_template_kwargs is None else dict(chat_template_kwargs)}
        rows = []
        for i, conv in enumerate(convs):
            if isinstance(conv, (str, Mapping)) or not all(isinstance(m, Mapping) for m in conv):
                raise TypeError(f"messages[{i}]: expected a conversation (a list of {{role, content}} messages), "
                                f"got {type(conv).__name__}")
            rows.append({"messages": [dict(m) for m in conv], **options})
        if not rows:
            return []
        if chat_template is None:
            return self.generate(rows, sampling_params, use_tqdm)
        own = tokenizer.chat_template
        tokenizer.chat_template = template         # rendered within the call: the rows, and each prompt made
        try:                                       # now, not when first read (Completion.prompt)
            out = self.generate(rows, sampling_params, use_tqdm)
            for c in out:
                c._prompt()
            return out
        finally:
            tokenizer.chat_template = own

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: a new SamplingParams holding what a call with none would run with, for a script
        to change and pass (`sp = llm.get_default_sampling_params(); sp.max_tokens = 64`): this
        LLM's sampling keywords and recipe, over the model's generation_config.json values (its
        max_new_tokens as max_tokens); no seed of its own (the run's stays). What neither sets stays
        unset, and unset it runs as in any SamplingParams: greedy, where vLLM's samples at 1.0."""
        base, model = self.recipe.sampling, self.engine.model_defaults
        fill = {k: model[k] for k in (*MODEL_DEFAULT_KEYS, "max_tokens") if getattr(base, k) is None and k in model}
        return replace(base, seed=None, **fill)

    def get_tokenizer(self) -> Any:
        """The target's tokenizer (transformers'), as vLLM's LLM.get_tokenizer()."""
        return self.engine.tokenizer

    @property
    def device(self) -> str:
        return str(self.engine.device)
