"""Train an EAGLE3 draft head for a frozen target, and save it in the published layout.

The head reads the outputs of three aux layers of the target (the residual stream after layer i,
before any final norm: what the engine's ``CausalLM.forward(capture=...)`` hands the drafter) and
drafts over a reduced vocabulary (the most frequent train ids). This file holds what is EAGLE3's
own: the draft vocabulary, the head's config and init, saving; the frozen target is `frozen.py`,
the shared distillation loop `loop.py`, the unrolled forward and its loss (training-time test)
`ttt.py`.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable

import torch

from ..models.config import DecoderConfig, load_config
from ..models.eagle3 import Eagle3Config, Eagle3Head
from .frozen import FrozenTarget
from .loop import LoopSettings, device_setup, fmt_metrics, load_streams, run_loop, write_train_log

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


# --------------------------------------------------------------------------- training


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
    dev = device_setup(device)
    tokens_dir, out_dir = Path(tokens_dir), Path(out_dir)
    tcfg, _ = load_config(target_dir)
    aux_layers = tuple(int(i) for i in aux_layers)
    settings = LoopSettings(ttt_steps=ttt_steps, step_weight=step_weight, seq_len=seq_len,
                            batch_size=batch_size, steps=steps, lr=lr, warmup=warmup,
                            weight_decay=weight_decay, eval_every=eval_every, seed=seed,
                            eval_windows=eval_windows)
    train, held = load_streams(tokens_dir, seq_len, tcfg.vocab_size)

    target_ids, d2t, t2d = select_draft_vocab(train, tcfg.vocab_size, draft_vocab)
    coverage = float(t2d[train].float().mean())
    Vd = int(target_ids.numel())
    cfg = head_config(tcfg, Vd, aux_layers)
    target = FrozenTarget(target_dir, aux_layers, dev)
    torch.manual_seed(seed)
    head = build_head(cfg, d2t, t2d, target.output_weight.detach().float().cpu()[target_ids])
    head = head.to(dev).train()
    params = trainable_parameters(head)
    n_params = sum(p.numel() for p in params)
    log(f"eagle3: target {target_dir} ({tcfg.num_layers} layers, H {tcfg.hidden_size}), aux "
        f"{list(aux_layers)}, draft vocab {Vd} (covers {coverage:.1%} of train tokens), "
        f"{n_params / 1e6:.2f}M trainable params, {len(train)} train / {len(held)} held-out tokens, "
        f"device {dev}")

    r = run_loop(head, params, target, train, held, target_ids.to(dev), head.state_dict, settings,
                 dev, log)
    n_bytes = save_head(head, cfg, out_dir, r.best_state)
    metrics = write_train_log(out_dir, r, settings, t_start=t_start, params=n_params, n_bytes=n_bytes,
                              extra={"draft_vocab": Vd, "draft_vocab_coverage": coverage,
                                     "aux_layers": list(aux_layers)},
                              dev=dev, train_tokens=len(train), heldout_tokens=len(held))
    log(f"eagle3: saved step {r.best_step} to {out_dir} ({n_bytes / 1e6:.1f} MB), eval "
        f"{fmt_metrics(r.best_eval)}, {metrics['seconds']:.0f}s")
    return metrics
