"""The demo-model pipeline: corpus -> tokenizer -> target -> EAGLE3 head -> NextN/MTP layer ->
bundle, fixed seeds.

Each stage reads the previous stage's output from `work_dir` and writes its own there, so stages
can run on different machines (the tokenizer and token streams on a CPU box, the training on a
GPU) and be repeated alone. `--smoke` runs every stage at toy size on the CPU in seconds. Both
draft stages distil the frozen target the same way (`loop.py`); the bundle holds the target and
both drafts under the recipes' algorithm names (`eagle3`, `nextn_mtp`).
"""
from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any, Callable

STAGES = ("tokenizer", "target", "eagle3", "mtp", "bundle")
BUNDLE_LIMIT = 24 * 2**20
DEMO_DIR = Path(__file__).resolve().parent.parent / "assets" / "demo"
EXAMPLES = Path(__file__).resolve().parent.parent.parent / "examples" / "prompts.jsonl"
_TARGET_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                 "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json", "train_log.json")
_HEAD_FILES = ("config.json", "model.safetensors", "train_log.json")
# work_dir/<stage> -> dest/<bundle name> (the job resolves DEMO_DIR / recipe.algorithm)
_BUNDLED = (("target", "target", _TARGET_FILES), ("eagle3", "eagle3", _HEAD_FILES),
            ("mtp", "nextn_mtp", _HEAD_FILES))

# Full-size settings, from sweeps on an H100 (best held-out loss; ~70 s and ~150 s there).
TARGET_RUN = dict(batch_size=32, steps=2400, lr=1.5e-3, weight_decay=1.0, warmup=100, eval_every=100)
EAGLE3_RUN = dict(draft_vocab=2048, aux_layers=(1, 3, 5), ttt_steps=6, lr=3e-3, steps=3000, batch_size=32,
                  seq_len=512, warmup=100)
# EAGLE3_RUN's optimiser settings (not swept for the MTP layer yet); 5 unrolled steps cover the
# recipes' num_steps.
MTP_RUN = dict(ttt_steps=5, lr=3e-3, steps=3000, batch_size=32, seq_len=512, warmup=100)

# Toy sizes for --smoke: every stage runs on the CPU in a few seconds.
SMOKE_SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=256, rope_theta=10000.0,
                   rms_norm_eps=1e-5, tie_word_embeddings=True)


def build_demo(work_dir: str | Path, *, stages: tuple[str, ...] = STAGES, smoke: bool = False,
               device: str | None = None, bundle_dir: str | Path | None = None, seed: int = 0,
               log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run `stages` in order; returns (and writes to work_dir/pipeline.json) every stage's metrics."""
    import torch

    work = Path(work_dir)
    work.mkdir(parents=True, exist_ok=True)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    report_path = work / "pipeline.json"
    report: dict[str, Any] = json.loads(report_path.read_text()) if report_path.is_file() else {}
    threads = torch.get_num_threads()
    if smoke:
        # Toy shapes: one thread. Ops this small gain nothing from a second one, and on a busy
        # 2-core box (CI, tests in parallel) OpenMP workers waiting on each other made a training
        # step ~15x slower (27 ms -> 470 ms).
        torch.set_num_threads(1)
    try:
        _run_stages(work, stages, smoke, device, bundle_dir, seed, log, report, report_path)
    finally:
        torch.set_num_threads(threads)
    return report


# What each stage reads from the work directory (made by the stage named), and where it writes.
_NEEDS = {"tokenizer": (), "target": (("tokenizer", "tokenizer"), ("tokens", "tokenizer")),
          "eagle3": (("target", "target"), ("tokens", "tokenizer")),
          "mtp": (("target", "target"), ("tokens", "tokenizer")),
          "bundle": (("target", "target"), ("eagle3", "eagle3"), ("mtp", "mtp"))}


def check_stages(work_dir: str | Path, stages: tuple[str, ...]) -> None:
    """Before anything runs: every stage known, and what each reads either made by an earlier
    stage of this run or already in the work directory (a ValueError naming what is missing)."""
    if not stages:
        raise ValueError(f"--stages: no stage given (stages: {', '.join(STAGES)})")
    work = Path(work_dir)
    if work.exists() and not work.is_dir():
        raise ValueError(f"--work-dir {work}: is a file, not a directory")
    made: set[str] = set()
    for stage in stages:
        if stage not in STAGES:
            raise ValueError(f"--stages: unknown stage {stage!r} (stages: {', '.join(STAGES)})")
        for sub, by in _NEEDS[stage]:
            if by not in made and not (work / sub).exists():
                raise ValueError(f"--stages {stage}: needs {work / sub}, which the {by} stage makes: run it first "
                                 f"(--stages {by},{stage}) or point --work-dir at a directory holding it")
        made.add(stage)


def _run_stages(work: Path, stages: tuple[str, ...], smoke: bool, device: str,
                bundle_dir: str | Path | None, seed: int, log: Callable[[str], None],
                report: dict[str, Any], report_path: Path) -> None:
    for stage in stages:
        if stage not in STAGES:
            raise ValueError(f"unknown stage {stage!r} (stages: {', '.join(STAGES)})")
        t0 = time.perf_counter()
        log(f"== {stage}")
        if stage == "tokenizer":
            metrics = _tokenizer(work, smoke)
        elif stage == "target":
            from .target import DEMO_SHAPE, train_target

            kw = dict(shape=SMOKE_SHAPE, seq_len=64, batch_size=8, steps=40, lr=3e-3, warmup=5,
                      eval_every=20, heldout_tokens=4096) if smoke else dict(TARGET_RUN, shape=DEMO_SHAPE)
            metrics = train_target(work / "tokens", work / "tokenizer", work / "target", seed=seed,
                                   device=device, log=log, **kw)
        elif stage == "eagle3":
            from .eagle3 import train_eagle3

            kw = dict(draft_vocab=128, aux_layers=(0, 1, 3), seq_len=64, batch_size=8, steps=40, lr=3e-3,
                      warmup=5, eval_every=20, eval_windows=32) if smoke else dict(EAGLE3_RUN)
            metrics = train_eagle3(work / "target", work / "tokens", work / "eagle3", seed=seed,
                                   device=device, log=log, **kw)
        elif stage == "mtp":
            from .mtp import train_mtp

            kw = dict(ttt_steps=3, seq_len=64, batch_size=8, steps=40, lr=3e-3, warmup=5,
                      eval_every=20, eval_windows=32) if smoke else dict(MTP_RUN)
            metrics = train_mtp(work / "target", work / "tokens", work / "mtp", seed=seed,
                                device=device, log=log, **kw)
        else:
            dest = Path(bundle_dir) if bundle_dir else (work / "bundle" if smoke else DEMO_DIR)
            metrics = bundle(work, dest, examples=None if smoke else EXAMPLES)
        metrics = {**metrics, "stage_seconds": round(time.perf_counter() - t0, 2)}
        report[stage] = metrics
        report_path.write_text(json.dumps(report, indent=2, default=str) + "\n")


def _tokenizer(work: Path, smoke: bool) -> dict[str, Any]:
    from .corpus import encode_corpus
    from .tokenizer import build_tokenizer_and_corpus, train_tokenizer

    if not smoke:
        return build_tokenizer_and_corpus(work, vocab_size=8192, verbose=True)
    train_tokenizer(work / "tokenizer", vocab_size=512, max_files=40)
    out = {}
    for split, files in (("train", 40), ("heldout", 6)):
        out[split] = encode_corpus(work / "tokenizer", split, work / "tokens" / f"{split}.bin", max_files=files)
    return {"smoke": True, "tokens": {k: v["count"] for k, v in out.items()}}


def bundle(work: Path, dest: Path, examples: Path | None = None) -> dict[str, Any]:
    """Copy the trained target and both drafts into `dest` (the package's assets/demo by default):
    work/target -> target, work/eagle3 -> eagle3, work/mtp -> nextn_mtp; at most BUNDLE_LIMIT."""
    # check every source and the total before touching dest: no half-replaced bundle
    sizes = {}
    for stage, name, files in _BUNDLED:
        src = work / stage
        if not (src / "model.safetensors").is_file():
            raise FileNotFoundError(f"{src}: no trained {stage} (run the {stage} stage first)")
        sizes[name] = sum((src / f).stat().st_size for f in files if (src / f).is_file())
    total = sum(sizes.values())
    if total > BUNDLE_LIMIT:
        raise ValueError(f"bundle is {total / 2**20:.1f} MiB, over the {BUNDLE_LIMIT / 2**20:.0f} MiB limit")
    for stage, name, files in _BUNDLED:
        out = dest / name
        if out.exists():
            shutil.rmtree(out)
        out.mkdir(parents=True)
        for f in files:
            if (work / stage / f).is_file():
                shutil.copy2(work / stage / f, out / f)
    if examples is not None:
        from .target import write_examples

        write_examples(examples, work / "tokenizer")
    return {"dest": str(dest), "bytes": sizes, "total_bytes": total}
