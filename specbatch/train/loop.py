"""The distillation loop both draft modules (EAGLE3 head, NextN/MTP layer) train with.

Data: random `seq_len` windows of the train token stream (``tokens_dir/train.bin``); eval on fixed
windows of ``tokens_dir/heldout.bin`` (or the train tail when there is none). Per window the frozen
target gives the drafter's feature and its logits; the module is unrolled over the window with
training-time test (`ttt.py`) and scored against the target's distributions. AdamW, warmup +
cosine, grad-norm clip 1; the checkpoint with the lowest weighted held-out loss is kept.
"""
from __future__ import annotations

import copy
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch

from .. import kernels
from .corpus import token_tensor
from .frozen import FrozenTarget
from .schedule import warmup_cosine
from .ttt import DraftModule, distill_targets, ttt_forward, ttt_loss

__all__ = ["LoopSettings", "LoopResult", "device_setup", "fmt_metrics", "load_streams", "run_loop",
           "write_train_log"]


@dataclass(frozen=True)
class LoopSettings:
    ttt_steps: int
    step_weight: float
    seq_len: int
    batch_size: int
    steps: int
    lr: float
    warmup: int
    weight_decay: float
    eval_every: int
    seed: int
    eval_windows: int

    def __post_init__(self) -> None:
        if self.ttt_steps < 1:
            raise ValueError("ttt_steps must be >= 1")


@dataclass
class LoopResult:
    best_step: int
    best_eval: dict                     # _summarise() of the best held-out evaluation
    best_state: dict[str, torch.Tensor]
    history: list[dict]                 # every evaluation
    train_history: list[dict]           # windowed train metrics
    train_seconds: float
    eval_windows: int                   # held-out windows actually used


def device_setup(device: str) -> torch.device:
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    return dev


def load_streams(tokens_dir: Path, seq_len: int, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, held-out) int64 token streams; without heldout.bin the train tail is held out."""
    train = token_tensor(tokens_dir / "train.bin")
    held_path = tokens_dir / "heldout.bin"
    if held_path.is_file():
        held = token_tensor(held_path)
    else:                                    # no held-out stream: keep the train tail for eval
        cut = len(train) - max(len(train) // 20, seq_len)
        train, held = train[:cut], train[cut:]
    if len(train) < seq_len or len(held) < seq_len:
        raise ValueError(f"token streams ({len(train)} train, {len(held)} held-out) are shorter "
                         f"than seq_len {seq_len}")
    if int(train.max()) >= vocab_size or int(held.max()) >= vocab_size:
        raise ValueError(f"token ids exceed the target vocabulary ({vocab_size})")
    return train, held


def _summarise(sums: dict, step_weight: float) -> dict:
    sums = {k: [float(x) for x in v] for k, v in sums.items()}
    steps = len(sums["ce"])
    w = [step_weight ** j for j in range(steps)]
    ce = [sums["ce"][j] / max(1, sums["rows"][j]) for j in range(steps)]
    return {
        "loss": sum(wj * c for wj, c in zip(w, ce)) / sum(w),
        "ce": ce,
        "agree": [sums["agree"][j] / max(1, sums["rows"][j]) for j in range(steps)],
        "agree_in_vocab": [sums["agree_in_vocab"][j] / max(1, sums["in_vocab"][j]) for j in range(steps)],
        "in_vocab": sums["in_vocab"][0] / max(1, sums["rows"][0]),
    }


def _add(acc: dict | None, stats: dict) -> dict:
    if acc is None:
        return {k: list(v) for k, v in stats.items()}
    for k, v in stats.items():
        acc[k] = [a + b for a, b in zip(acc[k], v)]
    return acc


def fmt_metrics(m: dict) -> str:
    return (f"loss {m['loss']:.4f} agree " + "/".join(f"{a:.3f}" for a in m["agree"]))


def run_loop(module: DraftModule, params: list[torch.nn.Parameter], target: FrozenTarget,
             train: torch.Tensor, held: torch.Tensor, draft_ids: torch.Tensor | None,
             state: Callable[[], dict[str, torch.Tensor]], s: LoopSettings, dev: torch.device,
             log: Callable[[str], None]) -> LoopResult:
    """Train `params` of `module` (on `dev`, in train mode) against `target`; `draft_ids`: the
    target ids of the draft vocabulary (None: the full one); `state()`: what a checkpoint keeps.

    Runs with the Triton kernels off: on CUDA, RMSNorm would dispatch to a kernel without a
    backward, cutting the gradient at every norm (the MTP layer ends in one)."""
    with kernels.torch_only():
        return _run_loop(module, params, target, train, held, draft_ids, state, s, dev, log)


def _run_loop(module, params, target, train, held, draft_ids, state, s: LoopSettings,
              dev: torch.device, log) -> LoopResult:
    cuda = dev.type == "cuda"
    embed = target.embed_weight.detach()
    opt = torch.optim.AdamW(params, lr=s.lr, betas=(0.9, 0.95), weight_decay=s.weight_decay,
                            **({"fused": True} if cuda else {}))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: warmup_cosine(i, s.steps, s.warmup))

    train_dev = train.to(dev)
    offsets = torch.arange(s.seq_len, device=dev)
    gen = torch.Generator().manual_seed(s.seed)
    n_eval = max(1, min(s.eval_windows, len(held) // s.seq_len))
    eval_starts = torch.linspace(0, len(held) - s.seq_len, n_eval).long()
    held_windows = held[eval_starts[:, None] + torch.arange(s.seq_len)].to(dev)

    def batch_loss(ids: torch.Tensor):
        feats, logits = target(ids)
        # row p: token p+1, feature p, scored against the target at p+1 (see ttt.py)
        probs, top = distill_targets(logits[:, 1:], draft_ids)
        del logits
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):
            hs = ttt_forward(module, embed, ids[:, 1:], feats[:, :-1], s.ttt_steps)
            return ttt_loss(module, hs, probs, top, s.step_weight)

    @torch.no_grad()
    def evaluate() -> dict:
        module.eval()
        sums = None
        for i in range(0, n_eval, s.batch_size):
            _, stats = batch_loss(held_windows[i:i + s.batch_size])
            sums = _add(sums, stats)
        module.train()
        return _summarise(sums, s.step_weight)

    history, train_log = [], []
    ev = evaluate()
    history.append({"step": 0, **ev})
    log(f"eval step 0: {fmt_metrics(ev)}")
    best = {"step": 0, "eval": ev, "state": copy.deepcopy(state())}
    window_sums, t_window, t_train = None, time.perf_counter(), time.perf_counter()
    for step in range(1, s.steps + 1):
        starts = torch.randint(0, len(train) - s.seq_len + 1, (s.batch_size,), generator=gen).to(dev)
        ids = train_dev[starts[:, None] + offsets]
        loss, stats = batch_loss(ids)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = float(torch.nn.utils.clip_grad_norm_(params, 1.0))
        opt.step()
        sched.step()
        window_sums = _add(window_sums, stats)
        if step % max(1, min(s.eval_every, 50)) == 0 or step == s.steps:
            m = _summarise(window_sums, s.step_weight)
            dt = time.perf_counter() - t_window
            train_log.append({"step": step, "lr": sched.get_last_lr()[0], "grad_norm": gnorm, **m})
            log(f"step {step}/{s.steps}: train {fmt_metrics(m)} lr {sched.get_last_lr()[0]:.2e} "
                f"gnorm {gnorm:.2f} ({dt:.1f}s)")
            window_sums, t_window = None, time.perf_counter()
        if step % s.eval_every == 0 or step == s.steps:
            ev = evaluate()
            history.append({"step": step, **ev})
            better = ev["loss"] < best["eval"]["loss"]
            log(f"eval step {step}: {fmt_metrics(ev)}{' (best)' if better else ''}")
            if better:
                best = {"step": step, "eval": ev, "state": copy.deepcopy(state())}
    if cuda:
        torch.cuda.synchronize()
    return LoopResult(best_step=best["step"], best_eval=best["eval"], best_state=best["state"],
                      history=history, train_history=train_log,
                      train_seconds=time.perf_counter() - t_train, eval_windows=n_eval)


def write_train_log(out_dir: Path, r: LoopResult, s: LoopSettings, *, t_start: float, params: int,
                    n_bytes: int, extra: dict, dev: torch.device, train_tokens: int,
                    heldout_tokens: int) -> dict:
    """The stage's metrics (returned) and out_dir/train_log.json (metrics + both histories).
    `extra`: the module's own keys (draft vocabulary, aux layers, init, ...)."""
    ev = r.best_eval
    config = {k: v for k, v in asdict(s).items() if k not in ("steps", "eval_windows")}
    metrics = {
        "steps": s.steps,
        "seconds": round(time.perf_counter() - t_start, 2),
        "train_seconds": round(r.train_seconds, 2),
        "best_step": r.best_step,
        "best_eval_loss": ev["loss"],
        "eval_ce": ev["ce"],
        "eval_agree": ev["agree"],
        "eval_agree_in_vocab": ev["agree_in_vocab"],
        "eval_in_vocab": ev["in_vocab"],
        "params": params,
        "bytes": n_bytes,
        **extra,
        "config": {**config, "eval_windows": r.eval_windows, "device": str(dev)},
        "train_tokens": train_tokens,
        "heldout_tokens": heldout_tokens,
    }
    (out_dir / "train_log.json").write_text(json.dumps(
        {**metrics, "eval_history": r.history, "train_history": r.train_history}, indent=1) + "\n")
    return metrics
