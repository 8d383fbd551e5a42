"""Train an EAGLE3 draft head for a frozen target, and save it in the published layout.

Data: random `seq_len` windows of the train token stream (``tokens_dir/train.bin``); eval on fixed
windows of ``tokens_dir/heldout.bin``. The target runs frozen (bf16 on GPU, float32 on CPU) and
gives, per window, the outputs of the three aux layers (the residual stream after layer i, before
any final norm: what the engine's ``CausalLM.forward(capture=...)`` hands the drafter) and its
logits.

The unrolled forward and its loss (training-time test) live in `ttt.py`.
"""
from __future__ import annotations

import copy
import json
import time
from pathlib import Path
from typing import Callable

import torch

from ..models.config import DecoderConfig, load_config
from ..models.eagle3 import Eagle3Config, Eagle3Head
from .corpus import token_tensor
from .schedule import warmup_cosine
from .ttt import distill_targets, ttt_forward, ttt_loss

__all__ = [
    "FrozenTarget",
    "build_head",
    "head_config",
    "save_head",
    "select_draft_vocab",
    "train_eagle3",
]


# --------------------------------------------------------------------------- draft vocabulary


def select_draft_vocab(tokens: torch.Tensor, vocab_size: int, draft_vocab: int
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The `draft_vocab` most frequent ids of `tokens` (ties: lower id first), sorted by id.

    Returns (target_ids [Vd] int64, d2t [Vd] int64 with target_ids[i] = i + d2t[i],
    t2d [vocab_size] bool).
    """
    draft_vocab = min(int(draft_vocab), vocab_size)
    counts = torch.bincount(tokens.reshape(-1).to(torch.int64).cpu(), minlength=vocab_size)
    if counts.numel() > vocab_size:
        raise ValueError(f"token ids up to {counts.numel() - 1} exceed the target vocabulary ({vocab_size})")
    order = torch.sort(-counts, stable=True).indices          # count desc, id asc among ties
    target_ids = order[:draft_vocab].sort().values
    d2t = target_ids - torch.arange(draft_vocab)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[target_ids] = True
    return target_ids, d2t, t2d


# --------------------------------------------------------------------------- the head


def head_config(target: DecoderConfig, draft_vocab: int, aux_layers) -> dict:
    """config.json of a one-layer head shaped like the target (published EAGLE3 keys)."""
    cfg = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": target.hidden_size,
        "intermediate_size": target.intermediate_size,
        "num_attention_heads": target.num_heads,
        "num_key_value_heads": target.num_kv_heads,
        "head_dim": target.head_dim,
        "num_hidden_layers": 1,
        "vocab_size": target.vocab_size,
        "draft_vocab_size": int(draft_vocab),
        "rms_norm_eps": target.rms_norm_eps,
        "rope_theta": target.rope_theta,
        "max_position_embeddings": target.max_position_embeddings,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "hidden_act": "silu",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [int(i) for i in aux_layers],
                         "use_aux_hidden_state": True},
    }
    if target.rope_scaling is not None:
        cfg["rope_scaling"] = dict(target.rope_scaling)
    return cfg


def build_head(cfg: dict, d2t: torch.Tensor, t2d: torch.Tensor,
               lm_head_init: torch.Tensor | None = None) -> Eagle3Head:
    """A float32 Eagle3Head (no embed_tokens: it shares the target's) on the CPU, default Linear
    init, norms 1, lm_head from `lm_head_init` (the target's output rows of the draft vocab)."""
    e3 = Eagle3Config.from_dict(cfg, "eagle3 head")
    head = Eagle3Head(e3, cfg["vocab_size"], fc_bias=False, own_embedding=False)
    head.d2t.copy_(d2t)
    head.t2d.copy_(t2d)
    if lm_head_init is not None:
        with torch.no_grad():
            head.lm_head.weight.copy_(lm_head_init.float())
    return head


def trainable_parameters(head: Eagle3Head) -> list[torch.nn.Parameter]:
    return [p for n, p in head.named_parameters() if not n.startswith("embed_tokens")]


# --------------------------------------------------------------------------- the frozen target


class FrozenTarget:
    """A transformers CausalLM, frozen. `__call__(ids [B, T])` -> (aux [B, T, 3H]: outputs of the
    aux layers, i.e. the residual stream after each (captured by forward hooks on the decoder
    layers, so the last layer is pre-final-norm too), logits [B, T, V])."""

    def __init__(self, target_dir: str | Path, aux_layers, device: torch.device,
                 dtype: torch.dtype | None = None):
        from transformers import AutoModelForCausalLM

        self.device = torch.device(device)
        self.dtype = dtype or (torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=self.dtype)
        self.model = model.to(self.device).eval().requires_grad_(False)
        self.aux_layers = tuple(int(i) for i in aux_layers)
        layers = self.model.get_decoder().layers
        bad = [i for i in self.aux_layers if not 0 <= i < len(layers)]
        if len(self.aux_layers) != 3 or bad:
            raise ValueError(f"aux_layers {list(self.aux_layers)}: expected three ids in 0..{len(layers) - 1}")
        self._captured: dict[int, torch.Tensor] = {}
        for i in sorted(set(self.aux_layers)):
            layers[i].register_forward_hook(self._hook(i))

    def _hook(self, i: int):
        def hook(_module, _inputs, output):
            self._captured[i] = output[0] if isinstance(output, (tuple, list)) else output
        return hook

    @property
    def embed_weight(self) -> torch.Tensor:
        return self.model.get_input_embeddings().weight

    @property
    def output_weight(self) -> torch.Tensor:
        return self.model.get_output_embeddings().weight

    @torch.no_grad()
    def __call__(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self._captured.clear()
        out = self.model(input_ids=ids, use_cache=False)
        aux = torch.cat([self._captured[i] for i in self.aux_layers], dim=-1)
        self._captured.clear()
        return aux, out.logits


# --------------------------------------------------------------------------- saving


def save_head(head: Eagle3Head, cfg: dict, out_dir: str | Path,
              state: dict[str, torch.Tensor] | None = None) -> int:
    """model.safetensors (bf16 weights, d2t int64, t2d bool) + config.json; returns file bytes."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = state if state is not None else head.state_dict()
    tensors = {}
    for name, t in state.items():
        if name.startswith("embed_tokens") or name == "inv_freq":
            continue
        if name == "d2t":
            t = t.to(torch.int64)
        elif name == "t2d":
            t = t.to(torch.bool)
        else:
            t = t.to(torch.bfloat16)
        tensors[name] = t.detach().cpu().contiguous()
    path = out / "model.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return path.stat().st_size


# --------------------------------------------------------------------------- the training loop


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


def train_eagle3(target_dir, tokens_dir, out_dir, *, draft_vocab: int = 2048,
                 aux_layers=(1, 3, 5), ttt_steps: int = 3, step_weight: float = 0.8,
                 seq_len: int = 512, batch_size: int = 32, steps: int = 2000, lr: float = 1e-3,
                 warmup: int = 100, weight_decay: float = 0.0, eval_every: int = 250, seed: int = 0,
                 device: str = "cuda", log: Callable[[str], None] = print,
                 eval_windows: int = 128) -> dict:
    """Train a one-layer EAGLE3 head for the frozen target at `target_dir` on
    ``tokens_dir/train.bin`` and save the best (lowest weighted eval loss on
    ``tokens_dir/heldout.bin`` windows) to `out_dir` in the published layout.

    `ttt_steps` is the number of unrolled steps (step 0 = the target-feature step): train with
    ttt_steps >= the recipe's num_steps S. Returns the metrics also written to train_log.json.
    """
    t_start = time.perf_counter()
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    tokens_dir, out_dir = Path(tokens_dir), Path(out_dir)
    tcfg, _ = load_config(target_dir)
    aux_layers = tuple(int(i) for i in aux_layers)
    if ttt_steps < 1:
        raise ValueError("ttt_steps must be >= 1")

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
    if int(train.max()) >= tcfg.vocab_size or int(held.max()) >= tcfg.vocab_size:
        raise ValueError(f"token ids exceed the target vocabulary ({tcfg.vocab_size})")

    target_ids, d2t, t2d = select_draft_vocab(train, tcfg.vocab_size, draft_vocab)
    coverage = float(t2d[train].float().mean())
    Vd = int(target_ids.numel())
    cfg = head_config(tcfg, Vd, aux_layers)
    target = FrozenTarget(target_dir, aux_layers, dev)
    torch.manual_seed(seed)
    head = build_head(cfg, d2t, t2d, target.output_weight.detach().float().cpu()[target_ids])
    head = head.to(dev).train()
    embed = target.embed_weight.detach()
    draft_ids = target_ids.to(dev)
    params = trainable_parameters(head)
    n_params = sum(p.numel() for p in params)
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=weight_decay,
                            **({"fused": True} if cuda else {}))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: warmup_cosine(s, steps, warmup))
    log(f"eagle3: target {target_dir} ({tcfg.num_layers} layers, H {tcfg.hidden_size}), aux "
        f"{list(aux_layers)}, draft vocab {Vd} (covers {coverage:.1%} of train tokens), "
        f"{n_params / 1e6:.2f}M trainable params, {len(train)} train / {len(held)} held-out tokens, "
        f"device {dev}")

    train_dev = train.to(dev)
    offsets = torch.arange(seq_len, device=dev)
    gen = torch.Generator().manual_seed(seed)
    n_eval = max(1, min(eval_windows, len(held) // seq_len))
    eval_starts = torch.linspace(0, len(held) - seq_len, n_eval).long()
    held_windows = held[eval_starts[:, None] + torch.arange(seq_len)].to(dev)

    def autocast():
        return torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda)

    def batch_loss(ids: torch.Tensor):
        aux, logits = target(ids)
        probs, top = distill_targets(logits[:, 1:], draft_ids)
        del logits
        with autocast():
            hs = ttt_forward(head, embed, ids[:, 1:], aux[:, :-1], ttt_steps)
            return ttt_loss(head, hs, probs, top, step_weight)

    @torch.no_grad()
    def evaluate() -> dict:
        head.eval()
        sums = None
        for i in range(0, n_eval, batch_size):
            _, stats = batch_loss(held_windows[i:i + batch_size])
            sums = _add(sums, stats)
        head.train()
        return _summarise(sums, step_weight)

    def fmt(m: dict) -> str:
        return (f"loss {m['loss']:.4f} agree " + "/".join(f"{a:.3f}" for a in m["agree"]))

    history, train_log = [], []
    best = None
    ev = evaluate()
    history.append({"step": 0, **ev})
    log(f"eval step 0: {fmt(ev)}")
    best = {"step": 0, "eval": ev, "state": copy.deepcopy(head.state_dict())}
    window_sums, t_window, t_train = None, time.perf_counter(), time.perf_counter()
    for step in range(1, steps + 1):
        starts = torch.randint(0, len(train) - seq_len + 1, (batch_size,), generator=gen).to(dev)
        ids = train_dev[starts[:, None] + offsets]
        loss, stats = batch_loss(ids)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = float(torch.nn.utils.clip_grad_norm_(params, 1.0))
        opt.step()
        sched.step()
        window_sums = _add(window_sums, stats)
        report = step % max(1, min(eval_every, 50)) == 0 or step == steps
        if report:
            m = _summarise(window_sums, step_weight)
            dt = time.perf_counter() - t_window
            train_log.append({"step": step, "lr": sched.get_last_lr()[0], "grad_norm": gnorm, **m})
            log(f"step {step}/{steps}: train {fmt(m)} lr {sched.get_last_lr()[0]:.2e} "
                f"gnorm {gnorm:.2f} ({dt:.1f}s)")
            window_sums, t_window = None, time.perf_counter()
        if step % eval_every == 0 or step == steps:
            ev = evaluate()
            history.append({"step": step, **ev})
            better = ev["loss"] < best["eval"]["loss"]
            log(f"eval step {step}: {fmt(ev)}{' (best)' if better else ''}")
            if better:
                best = {"step": step, "eval": ev, "state": copy.deepcopy(head.state_dict())}
    if cuda:
        torch.cuda.synchronize()
    train_seconds = time.perf_counter() - t_train

    n_bytes = save_head(head, cfg, out_dir, best["state"])
    metrics = {
        "steps": steps,
        "seconds": round(time.perf_counter() - t_start, 2),
        "train_seconds": round(train_seconds, 2),
        "best_step": best["step"],
        "best_eval_loss": best["eval"]["loss"],
        "eval_ce": best["eval"]["ce"],
        "eval_agree": best["eval"]["agree"],
        "eval_agree_in_vocab": best["eval"]["agree_in_vocab"],
        "eval_in_vocab": best["eval"]["in_vocab"],
        "params": n_params,
        "bytes": n_bytes,
        "draft_vocab": Vd,
        "draft_vocab_coverage": coverage,
        "aux_layers": list(aux_layers),
        "config": {"ttt_steps": ttt_steps, "step_weight": step_weight, "seq_len": seq_len,
                   "batch_size": batch_size, "lr": lr, "warmup": warmup,
                   "weight_decay": weight_decay, "eval_every": eval_every, "seed": seed,
                   "eval_windows": n_eval, "device": str(dev)},
        "train_tokens": len(train),
        "heldout_tokens": len(held),
    }
    (out_dir / "train_log.json").write_text(json.dumps(
        {**metrics, "eval_history": history, "train_history": train_log}, indent=1) + "\n")
    log(f"eagle3: saved step {best['step']} to {out_dir} ({n_bytes / 1e6:.1f} MB), eval "
        f"{fmt(best['eval'])}, {metrics['seconds']:.0f}s")
    return metrics
