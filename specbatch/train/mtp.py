"""Train a NextN/MTP draft layer for a frozen target, and save it as an exported DeepSeek-layout
checkpoint (what ``specbatch.models.mtp.load_mtp(target, None, out_dir, ...)`` reads).

The layer (`MTPLayer`: enorm, hnorm, eh_proj, one decoder layer of the target's family,
shared_head.norm) reads the target's final-normed hidden state and drafts over the full target
vocabulary through the target's own embedding and lm_head (borrowed, frozen, not saved). It trains
with the same loop as the EAGLE3 head (`loop.py`, training-time test in `ttt.py`).

Init (``init="target"``, the default): the decoder layer is a copy of the target's LAST decoder
layer and shared_head.norm a copy of the target's final norm (the lm_head then reads inputs at the
per-channel scale it was trained on); eh_proj keeps its default Linear init, enorm / hnorm 1.
``init="default"``: default Linear init, norms 1 (like the EAGLE3 head). Measured on the demo target
(CPU, 200 steps, seq_len 128, batch 8, ttt_steps 3; held-out loss, step-0 agreement): default 4.20 /
0.39; last layer + final norm 3.68 / 0.46 (seed 1: 3.65 / 0.45); last layer with norm 1 4.10 /
0.41; eh_proj = [0 | I] on top (start by passing the hidden through) 3.70 / 0.47 (3.68 / 0.46),
no better and it starts confidently wrong (loss 10.7 > ln V), so eh_proj stays default.

Saved: config.json (the target's config, num_hidden_layers 1, num_nextn_predict_layers 1) and
model.safetensors with ``model.layers.0.<name>`` in bf16 for every parameter of the layer.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable

import torch

from ..models.config import DecoderConfig, load_config
from ..models.mtp import MTPConfig, MTPLayer
from .frozen import FrozenTarget
from .loop import LoopSettings, device_setup, fmt_metrics, load_streams, run_loop, write_train_log

__all__ = ["INITS", "build_mtp", "mtp_config", "mtp_state", "save_mtp", "train_mtp"]

INITS = ("target", "default")
PREFIX = "model.layers.0."                 # an exported single-layer DeepSeek NextN checkpoint
_BORROWED = ("embed_tokens.", "lm_head.")  # the target's, attached for training: never saved


def mtp_config(target_raw: dict) -> dict:
    """config.json of the exported layer: the target's, one layer, one NextN layer, bf16."""
    cfg = {**target_raw, "num_hidden_layers": 1, "num_nextn_predict_layers": 1,
           "torch_dtype": "bfloat16"}
    if "dtype" in cfg:
        cfg["dtype"] = "bfloat16"
    return cfg


def build_mtp(tcfg: DecoderConfig, target: FrozenTarget | None = None, init: str = "target") -> MTPLayer:
    """A float32 MTPLayer shaped like the target on the CPU, without its own embedding or head.
    init "default": default Linear init, norms 1; "target": see the module docstring (needs
    `target`)."""
    if init not in INITS:
        raise ValueError(f"init {init!r}: expected one of {', '.join(INITS)}")
    layer = MTPLayer(MTPConfig(layer=tcfg, layout="deepseek", hidden_first=False),
                     own_embedding=False, own_head=False)
    if init == "target":
        if target is None:
            raise ValueError("init 'target' needs the frozen target")
        _init_from_target(layer, target)
    return layer


@torch.no_grad()
def _init_from_target(layer: MTPLayer, target: FrozenTarget) -> None:
    decoder = target.model.get_decoder()
    last = {k: v.float().cpu() for k, v in decoder.layers[-1].state_dict().items() if "rotary" not in k}
    missing, unexpected = layer.load_state_dict(last, strict=False)
    if unexpected:
        raise ValueError(f"the target's last layer has weights {unexpected[:3]} an MTP layer lacks "
                         f"(a dense {layer.cfg.layer.architecture} layer is expected)")
    outside = ("enorm.", "hnorm.", "eh_proj.", "shared_head.")
    left = [n for n in missing if not n.startswith(outside)]
    if left:
        raise ValueError(f"the target's last layer lacks weights {left[:3]} of the MTP layer")
    layer.shared_head.norm.weight.copy_(decoder.norm.weight.float().cpu())


def mtp_state(layer: MTPLayer) -> dict[str, torch.Tensor]:
    """The layer's own tensors (not the target's borrowed embedding / lm_head)."""
    return {n: t for n, t in layer.state_dict().items() if not n.startswith(_BORROWED)}


def save_mtp(layer: MTPLayer, cfg: dict, out_dir: str | Path,
             state: dict[str, torch.Tensor] | None = None) -> int:
    """model.safetensors (bf16, model.layers.0.<name>) + config.json; returns file bytes."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = state if state is not None else mtp_state(layer)
    tensors = {PREFIX + n: t.detach().to(torch.bfloat16).cpu().contiguous() for n, t in state.items()
               if not n.startswith(_BORROWED)}
    path = out / "model.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return path.stat().st_size


def train_mtp(target_dir, tokens_dir, out_dir, *, ttt_steps: int = 4, step_weight: float = 0.8,
              seq_len: int = 512, batch_size: int = 32, steps: int = 2000, lr: float = 1e-3,
              warmup: int = 100, weight_decay: float = 0.0, eval_every: int = 250, seed: int = 0,
              init: str = "target", device: str = "cuda", log: Callable[[str], None] = print,
              eval_windows: int = 128) -> dict:
    """Train a NextN/MTP layer for the frozen target at `target_dir` on ``tokens_dir/train.bin``
    and save the best (lowest weighted eval loss on ``tokens_dir/heldout.bin`` windows) to
    `out_dir` as an exported DeepSeek-layout checkpoint.

    `ttt_steps`: unrolled steps (step 0 reads the target's hidden state); train with ttt_steps >=
    the recipe's num_steps S. Returns the metrics also written to train_log.json.
    """
    t_start = time.perf_counter()
    dev = device_setup(device)
    tokens_dir, out_dir = Path(tokens_dir), Path(out_dir)
    tcfg, raw = load_config(target_dir)
    settings = LoopSettings(ttt_steps=ttt_steps, step_weight=step_weight, seq_len=seq_len,
                            batch_size=batch_size, steps=steps, lr=lr, warmup=warmup,
                            weight_decay=weight_decay, eval_every=eval_every, seed=seed,
                            eval_windows=eval_windows)
    train, held = load_streams(tokens_dir, seq_len, tcfg.vocab_size)

    target = FrozenTarget(target_dir, (), dev)          # features: the final-normed hidden
    torch.manual_seed(seed)
    layer = build_mtp(tcfg, target, init).to(dev).train()
    layer.embed_tokens = target.model.get_input_embeddings()     # borrowed, frozen (what
    layer.lm_head = target.model.get_output_embeddings()         # attach() does at inference)
    params = [p for n, p in layer.named_parameters() if not n.startswith(_BORROWED)]
    n_params = sum(p.numel() for p in params)
    log(f"mtp: target {target_dir} ({tcfg.num_layers} layers, H {tcfg.hidden_size}), init {init}, "
        f"full vocab {tcfg.vocab_size}, {n_params / 1e6:.2f}M trainable params, {len(train)} train / "
        f"{len(held)} held-out tokens, device {dev}")

    r = run_loop(layer, params, target, train, held, None, lambda: mtp_state(layer), settings, dev, log)
    n_bytes = save_mtp(layer, mtp_config(raw), out_dir, r.best_state)
    metrics = write_train_log(out_dir, r, settings, t_start=t_start, params=n_params, n_bytes=n_bytes,
                              extra={"init": init}, dev=dev, train_tokens=len(train),
                              heldout_tokens=len(held))
    log(f"mtp: saved step {r.best_step} to {out_dir} ({n_bytes / 1e6:.1f} MB), eval "
        f"{fmt_metrics(r.best_eval)}, {metrics['seconds']:.0f}s")
    return metrics
