"""An output (or its parts) written before --logprobs-mode existed has no logprobs_mode in its
manifest: its logprobs were the processed ones, so `--logprobs-mode processed_logprobs` resumes it
and the default names the difference."""
import json

from cli_runner import cli, ok


def test_output_written_before_logprobs_mode_can_be_resumed(tiny_model, tmp_path):
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps({"prompt": "def f(x):", "max_tokens": 2}) + "\n")
    out = tmp_path / "o.jsonl"
    args = ("run", inp, "-o", out, "--model", tiny_model, "--device", "cpu", "-q")
    ok(*args)
    side = tmp_path / "o.jsonl.manifest.json"
    m = json.loads(side.read_text())
    del m["fingerprint"]["logprobs_mode"]               # as d5010a9 wrote it
    side.write_text(json.dumps(m))
    r = cli(*args, "--logprobs-mode", "processed_logprobs")    # the mode d5010a9's logprobs were in
    assert r.exit_code == 0, r.output


def test_an_output_begun_before_openai_lines_read_as_the_api_is_refused_naming_it(tiny_model, tmp_path):
    """Batch lines read otherwise before (greedy when unset, unknown body keys ignored): resuming
    such an output would mix its rows with rows read the new way, so the refusal names how."""
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({"custom_id": f"c{i}", "body": {"prompt": "def f(x):", "max_tokens": 2}}) + "\n"
                           for i in range(3)))
    out = tmp_path / "o.jsonl"
    args = ("run", inp, "-o", out, "--model", tiny_model, "--device", "cpu", "-q")
    ok(*args, "--limit", "1")
    side = tmp_path / "o.jsonl.manifest.json"
    m = json.loads(side.read_text())
    del m["fingerprint"]["openai_lines"]                # as 2cd7aab and before wrote it
    side.write_text(json.dumps(m))
    r = cli(*args)
    assert r.exit_code != 0 and "openai_lines: \"unset temperature 0, unknown body keys ignored" in r.output
    m["fingerprint"]["openai_lines"] = json.loads(side.read_text()).get("fingerprint", {}).get("openai_lines") or \
        "as the API: unset temperature 1, unknown body keys and max_tokens past the context refused"
    side.write_text(json.dumps(m))
    ok(*args)                                          # written the new way: resumes


def _stopped(tiny_model, inp, out, after=2):
    """A run stopped (Ctrl-C) after `after` finished rows, its parts left for a resume."""
    import pytest

    from specbatch.job import JobOptions, run_job
    from specbatch.recipe import load_recipe

    seen = []

    def stop(event, info):
        if event == "record":
            seen.append(1)
            if len(seen) == after:
                raise KeyboardInterrupt

    recipe = load_recipe("vanilla").with_overrides(model=str(tiny_model), batch_size=1)
    with pytest.raises(KeyboardInterrupt):
        run_job(str(inp), recipe, JobOptions(output=str(out), device="cpu"), progress=stop)


def _forget_openai_lines(parts_manifest):
    m = json.loads(parts_manifest.read_text())
    del m["fingerprint"]["openai_lines"]                # as 2cd7aab and before wrote it
    parts_manifest.write_text(json.dumps(m))


def test_parts_without_batch_lines_begun_before_openai_lines_resume(tiny_model, tmp_path):
    """The reading of OpenAI lines changed nothing the parts of a plain-row job hold: they resume
    (and the record is added, so later resumes compare it)."""
    inp, out = tmp_path / "in.jsonl", tmp_path / "o.parquet"
    inp.write_text("".join(json.dumps({"prompt": f"def f{i}(x):", "max_tokens": 2}) + "\n" for i in range(6)))
    _stopped(tiny_model, inp, out)
    parts_manifest = tmp_path / "o.parquet.parts" / "manifest.json"
    _forget_openai_lines(parts_manifest)
    before = parts_manifest.read_bytes()
    r = cli("run", inp, "-o", out, "--model", tiny_model, "--device", "cpu", "-q", "--temperature", "0.3")
    assert r.exit_code != 0 and "sampling.temperature" in r.output
    assert parts_manifest.read_bytes() == before                     # a refused resume leaves it as it was
    ok("run", inp, "-o", out, "--model", tiny_model, "--device", "cpu", "-q")


def test_parts_with_batch_lines_begun_before_openai_lines_are_refused(tiny_model, tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "o.parquet"
    inp.write_text("".join(json.dumps({"custom_id": f"c{i}", "body": {"prompt": "def f(x):", "max_tokens": 2}}) + "\n"
                           for i in range(6)))
    _stopped(tiny_model, inp, out)
    _forget_openai_lines(tmp_path / "o.parquet.parts" / "manifest.json")
    r = cli("run", inp, "-o", out, "--model", tiny_model, "--device", "cpu", "-q")
    assert r.exit_code != 0 and "openai_lines: \"unset temperature 0" in r.output


def test_an_output_written_before_logprobs_had_ranks_takes_more_rows(tiny_model, tmp_path):
    """A finished output whose logprobs struct has no rank (written before generated tokens' ranks
    were) reopens to add rows: its rows read with rank null, the new ones with theirs."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({"prompt": p, "max_tokens": 3, "logprobs": 1}) + "\n"
                           for p in ("def f(x):", "import os")))
    out = tmp_path / "o.parquet"
    args = ("run", inp, "-o", out, "--model", tiny_model, "--device", "cpu", "-q")
    ok(*args, "--limit", "1")
    t = pq.read_table(out)
    top = pa.struct([("token_id", pa.int64()), ("token", pa.string()), ("logprob", pa.float64())])
    old = pa.list_(pa.struct([("token_id", pa.int64()), ("token", pa.string()), ("logprob", pa.float64()),
                              ("top_logprobs", pa.list_(top))]))
    rows = [[{k: v for k, v in e.items() if k != "rank"} for e in r] for r in t.column("logprobs").to_pylist()]
    i = t.schema.get_field_index("logprobs")
    pq.write_table(t.set_column(i, pa.field("logprobs", old), pa.array(rows, old))
                   .replace_schema_metadata(t.schema.metadata), out)
    ok(*args)
    ranks = [[e["rank"] for e in r] for r in pq.read_table(out).column("logprobs").to_pylist()]
    assert ranks[0] == [None] * 3 and all(r >= 1 for r in ranks[1])
