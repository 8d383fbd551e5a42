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
