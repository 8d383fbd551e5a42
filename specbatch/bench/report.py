"""Bench results out: bench.json (everything, with the run's environment), bench.md (the table)
and bench.png (tokens/s against batch size; skipped when matplotlib is not installed)."""
from __future__ import annotations

import datetime
import json
import platform
from pathlib import Path
from typing import Any

GiB = 1 << 30


def environment(command: str) -> dict[str, Any]:
    """Date, library versions and the command line, for the JSON's metadata."""
    import torch

    versions: dict[str, str | None] = {"torch": torch.__version__, "python": platform.python_version()}
    for name in ("transformers", "triton"):
        try:
            versions[name] = __import__(name).__version__
        except ImportError:
            versions[name] = None
    return {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "versions": versions, "command": command}


def write_json(result: dict[str, Any], path: Path) -> None:
    path.write_text(json.dumps(result, indent=2) + "\n")


def title(meta: dict[str, Any]) -> str:
    return f"specbatch bench: {meta['model']} on {meta['device']}, {meta['acceptance']}"


def markdown(result: dict[str, Any]) -> str:
    meta = result["meta"]
    graphs = "CUDA graphs" if meta["graphs"] else "eager"
    lines = [
        f"# {title(meta)}", "",
        f"{meta.get('date', '')} · {meta['dtype']} · {graphs} · copy bandwidth "
        f"{meta['copy_bandwidth_bytes_per_s'] / 1e9:.0f} GB/s · {meta['prompts']} prompts of "
        f"~{meta['mean_prompt_tokens']:.0f} tokens ({meta['prompt_source']}) · {meta['max_tokens']} new "
        "tokens, greedy, EOS ignored", "",
    ]
    if meta.get("command"):
        lines += [f"`{meta['command']}`", ""]
    if meta["simulated"]:
        lines += [f"**Accept lengths are simulated ({meta['acceptance']}), not measured: the drafts "
                  "are accepted at these per-position rates, so only step times are real.**", ""]
    head, rows = table(result)
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(cells) + " |" for cells in rows]
    failed = [p for p in result["points"] if p.get("failed")]
    if failed:
        lines += ["", f"**{len(failed)} point(s) failed** (no figures; the sweep went on with the next):", ""]
        lines += [f"- {p['recipe']}, batch {p['batch_size']}: {' '.join(str(p.get('error')).split())}"
                  for p in failed]
    lines += ["", "tok/s: output tokens per second of the decode phase (cycles with every row active; a "
              "speculative run's rows finish unevenly, and its tail of part-full cycles is left out). "
              "End-to-end vs vanilla: output tokens over the whole run, prefill and tails included. "
              "Step ms: median cycle wall time; host = wall - (draft + verify + extend). Floor: the bytes "
              "a cycle must read (weights, embeddings excluded, plus the KV of the committed tokens; "
              "EAGLE3 heads S times) over the measured copy bandwidth; % of floor = floor / step."]
    if str(meta.get("device", "")).startswith("cpu"):
        lines += ["", CPU_FLOOR_NOTE]
    return "\n".join(lines) + "\n"


# (both modes' reports)
CPU_FLOOR_NOTE = ("On a CPU the floor is an estimate, not a bound: the copy bandwidth and matmul rate are measured "
                  "each run and vary with load and threads, and weights that fit the cache read faster than the "
                  "measured copy; compare its fractions within one run only.")


def table(result: dict[str, Any], short: bool = False) -> tuple[list[str], list[list[str]]]:
    """The table's header and one row of cells per (recipe, batch size); `short`: compact
    headers for a terminal."""
    meta = result["meta"]
    if short:
        accept = "accept (simulated)" if meta["simulated"] else "accept"
    else:
        accept = f"accept length ({meta['acceptance']})"
    head = ["recipe", "batch", "tok/s", "vs vanilla" if short else "speedup vs vanilla",
            "e2e vs vanilla" if short else "end-to-end vs vanilla", accept,
            "draft ms", "verify ms", "extend ms", "host ms", "step ms", "floor ms", "% of floor",
            "peak GiB", "capture s"]
    rows = []
    for p in result["points"]:
        peer = p["peer"]
        rate = p.get("tokens_per_s")
        if p.get("failed"):
            rows.append([p["recipe"], str(p["batch_size"]), _failed_cell(p.get("error"), short),
                         *["-"] * (len(head) - 3)])
            continue
        rows.append([
            p["recipe"], str(p["batch_size"]),
            _f(rate, ".1f") if rate is not None else p.get("error", "-"),
            _f(p.get("speedup_vs_vanilla"), ".2f", "x"), _f(p.get("e2e_speedup_vs_vanilla"), ".2f", "x"),
            "-" if peer else _f(p["accept_length"], ".2f"),
            *(["-"] * 6 if peer else [_f(p[k], ".2f") for k in ("draft_ms", "verify_ms", "extend_ms",
                                                               "host_ms", "step_ms", "floor_ms")]),
            "-" if peer else _f(100 * p["floor_fraction"], ".0f", "%"),
            _f(p["peak_memory_bytes"] / GiB if p.get("peak_memory_bytes") is not None else None, ".2f"),
            "-" if peer else _f(p["capture_s"], ".1f"),
        ])
    return head, rows


def _failed_cell(error: str | None, short: bool) -> str:
    """'failed: <error>' on one line: cut for a terminal (`short`), '|' escaped for markdown."""
    text = " ".join(str(error or "error").split())
    if short:
        return "failed: " + (text[:57] + "..." if len(text) > 60 else text)
    return "failed: " + text.replace("|", "\\|")


def _f(v: float | None, fmt: str, suffix: str = "") -> str:
    return "-" if v is None else f"{v:{fmt}}{suffix}"


def write_plot(result: dict[str, Any], path: Path) -> bool:
    """tokens/s against batch size (log2 x), one line per recipe; False without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    recipes = list(dict.fromkeys(p["recipe"] for p in result["points"]))
    for name in recipes:
        pts = [p for p in result["points"] if p["recipe"] == name and p.get("tokens_per_s") is not None]
        ax.plot([p["batch_size"] for p in pts], [p["tokens_per_s"] for p in pts], marker="o", label=name,
                linestyle="--" if pts and pts[0]["peer"] else "-")
    ax.set_xscale("log", base=2)
    sizes = sorted({p["batch_size"] for p in result["points"]})
    ax.set_xticks(sizes, [str(b) for b in sizes])
    ax.minorticks_off()
    ax.set_ylim(bottom=0)
    ax.set_xlabel("batch size")
    ax.set_ylabel("output tokens/s (decode)")
    meta = result["meta"]
    ax.set_title(f"specbatch bench: {meta['model']} on {meta['device']}\n{meta['acceptance']}", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def write_all(result: dict[str, Any], out_dir: str | Path) -> tuple[dict[str, Path], str | None]:
    """Write bench.json, bench.md and bench.png into out_dir; returns the paths written and a
    note when the plot was skipped."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "bench.json", "md": out / "bench.md"}
    write_json(result, paths["json"])
    paths["md"].write_text(markdown(result))
    if write_plot(result, out / "bench.png"):
        return {**paths, "png": out / "bench.png"}, None
    return paths, "matplotlib is not installed: skipped bench.png (pip install matplotlib to get the plot)"
