"""The demo target: a small Llama with GQA, saved as an ordinary HF checkpoint.

:func:`train_target` trains it from scratch on the token streams of
:mod:`specbatch.train.corpus` and keeps the weights with the best held-out loss.
"""
from __future__ import annotations

import json
import math
import shutil
import time
from pathlib import Path
from typing import Any, Callable

from .corpus import token_tensor
from .schedule import warmup_cosine

# Shape of the shipped demo target (bf16 on disk): ~6.8M parameters with a vocabulary of
# 8192 (tied embedding 2.1M + 6 layers x 0.79M), ~13.6 MB of weights. The shipped bundle
# (target + draft heads) must stay <= 24 MB, so do not grow it.
DEMO_SHAPE = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=6,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                  rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=True)


def _llama_config(tok: Any, shape: dict | None):
    import transformers as tf

    return tf.LlamaConfig(**(shape or DEMO_SHAPE), vocab_size=len(tok), eos_token_id=tok.eos_token_id,
                          bos_token_id=None, pad_token_id=tok.pad_token_id)


def _save_checkpoint(model: Any, out: Path, tokenizer_dir: str | Path, eos_id: int) -> None:
    """bf16 safetensors + config, the tokenizer files and an EOS-list generation config."""
    import torch

    model.to(torch.bfloat16).save_pretrained(str(out))
    for f in Path(tokenizer_dir).iterdir():
        if f.is_file():
            shutil.copy(f, out / f.name)
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos_id]}) + "\n")


# --------------------------------------------------------------------------- training


def _autocast(device: Any):
    """bf16 autocast on CUDA (fp32 master weights), plain fp32 elsewhere."""
    import contextlib

    import torch

    if torch.device(device).type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def heldout_loss(model: Any, tokens: Any, seq_len: int = 512, batch_size: int = 64) -> float:
    """Mean next-token cross-entropy over the WHOLE stream `tokens` (1-D int tensor): every token
    after the first is predicted once, from non-overlapping windows of `seq_len` inputs (the
    shorter tail is a last window of its own). Runs on the model's device, in eval mode."""
    import torch
    import torch.nn.functional as F

    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    n = tokens.numel() - 1                                   # predicted positions
    full = n // seq_len
    x = tokens[: full * seq_len].view(full, seq_len)
    y = tokens[1 : full * seq_len + 1].view(full, seq_len)
    batches = [(x[i : i + batch_size], y[i : i + batch_size]) for i in range(0, full, batch_size)]
    if n > full * seq_len:
        batches.append((tokens[full * seq_len : n][None], tokens[full * seq_len + 1 :][None]))
    total = torch.zeros((), dtype=torch.float64, device=device)
    with torch.no_grad():
        for xb, yb in batches:
            with _autocast(device):
                logits = model(input_ids=xb.to(device), use_cache=False).logits   # [B, T, V]
            total += F.cross_entropy(logits.float().flatten(0, 1), yb.to(device).flatten(),
                                     reduction="sum")
    model.train(was_training)
    return total.item() / n


def train_target(tokens_dir: str | Path, tokenizer_dir: str | Path, out_dir: str | Path, *,
                 shape: dict | None = None, seq_len: int = 512, batch_size: int = 64,
                 steps: int = 2000, lr: float = 2e-3, min_lr_ratio: float = 0.1, warmup: int = 100,
                 weight_decay: float = 0.1, eval_every: int = 200, seed: int = 0,
                 device: str = "cuda", heldout_tokens: int | None = None,
                 log: Callable[[str], Any] = print) -> dict:
    """Train the demo target from scratch on `tokens_dir`/train.bin and save the weights with the
    best loss on `tokens_dir`/heldout.bin (evaluated every `eval_every` steps and at the end) to
    `out_dir` as a bf16 HF checkpoint with the tokenizer. Returns the metrics (also written to
    `out_dir`/train_log.json with the run's arguments and the evaluation history).

    Batches are `batch_size` random windows of seq_len+1 tokens of the train stream (they may
    cross documents, which EOS separates), drawn from a torch.Generator seeded with `seed`.
    AdamW (betas 0.9/0.95; no decay on norms), warmup + cosine schedule, grad-norm clip 1.0;
    fp32 master weights under bf16 autocast on CUDA, plain fp32 on CPU. `heldout_tokens` cuts
    the held-out stream to its first N tokens (CPU smoke runs only: evaluating all 125k tokens
    of the demo corpus takes seconds there); None evaluates the whole stream.
    """
    import torch
    import torch.nn.functional as F
    import transformers as tf
    from transformers import AutoTokenizer

    if steps < 1 or eval_every < 1:
        raise ValueError("steps and eval_every must be positive")
    t0 = time.perf_counter()
    dev = torch.device(device)
    tokens_dir, out = Path(tokens_dir), Path(out_dir)
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    train = token_tensor(tokens_dir / "train.bin")
    held = token_tensor(tokens_dir / "heldout.bin")[:heldout_tokens]
    if len(train) < seq_len + 1 or len(held) < 2:
        raise ValueError(f"{tokens_dir}: streams too short for seq_len {seq_len}")
    if max(int(train.max()), int(held.max())) >= len(tok):
        raise ValueError(f"{tokens_dir}: token ids beyond the tokenizer's vocabulary ({len(tok)})")

    torch.manual_seed(seed)
    cfg = _llama_config(tok, shape)
    model = tf.LlamaForCausalLM(cfg).to(dev).train()
    n_params = sum(p.numel() for p in model.parameters())  # tied embedding counted once
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(
        [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
         {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
        lr=lr, betas=(0.9, 0.95), fused=dev.type == "cuda")
    log(f"target: {n_params / 1e6:.2f}M params, {len(train)} train / {len(held)} held-out tokens, "
        f"{steps} steps x {batch_size} x {seq_len} on {dev}")

    gen = torch.Generator().manual_seed(seed)
    train = train.to(dev)
    offsets = torch.arange(seq_len + 1)
    history: list[dict] = []
    best_loss, best_step, best_state = math.inf, 0, None
    loss_sum, loss_n, eval_s = torch.zeros((), device=dev), 0, 0.0
    for step in range(1, steps + 1):
        lr_t = lr * warmup_cosine(step - 1, steps, warmup, min_lr_ratio)
        for group in opt.param_groups:
            group["lr"] = lr_t
        starts = torch.randint(0, len(train) - seq_len, (batch_size, 1), generator=gen)
        batch = train[(starts + offsets).to(dev)]               # [B, seq_len + 1]
        with _autocast(dev):
            logits = model(input_ids=batch[:, :-1], use_cache=False).logits   # [B, T, V]
        loss = F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss_sum += loss.detach()
        loss_n += 1

        if step % eval_every == 0 or step == steps:
            te = time.perf_counter()
            train_loss = loss_sum.item() / loss_n              # mean since the last evaluation
            loss_sum.zero_()
            loss_n = 0
            h = heldout_loss(model, held, seq_len, batch_size)
            if h < best_loss:
                best_loss, best_step = h, step
                best_state = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
            eval_s += time.perf_counter() - te
            history.append(dict(step=step, lr=lr_t, train_loss=round(train_loss, 5),
                                heldout_loss=round(h, 5), seconds=round(time.perf_counter() - t0, 2)))
            log(f"step {step}/{steps}  lr {lr_t:.2e}  train {train_loss:.4f}  held-out {h:.4f}"
                f"{'  *' if best_step == step else ''}  {time.perf_counter() - t0:.0f}s")
    train_s = time.perf_counter() - t0

    model.load_state_dict(best_state)
    _save_checkpoint(model, out, tokenizer_dir, tok.eos_token_id)
    # what ships is the bf16-rounded best state: its own held-out loss (fp32 / autocast compute)
    saved_loss = heldout_loss(model.float(), held, seq_len, batch_size)
    weights = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    metrics = dict(
        steps=steps, seconds=round(train_s, 2), eval_seconds=round(eval_s, 2),
        tokens_seen=steps * batch_size * seq_len, epochs=round(steps * batch_size * seq_len / len(train), 2),
        train_loss=round(train_loss, 5), best_heldout_loss=round(best_loss, 5),
        best_heldout_ppl=round(math.exp(best_loss), 3), best_step=best_step,
        heldout_loss=round(saved_loss, 5), heldout_ppl=round(math.exp(saved_loss), 3),
        params=n_params, checkpoint_bytes=weights,
        dir_bytes=sum(f.stat().st_size for f in out.iterdir() if f.is_file()),
        device=str(dev) + (f" ({torch.cuda.get_device_name(dev)})" if dev.type == "cuda" else ""),
    )
    args = dict(shape=shape or DEMO_SHAPE, seq_len=seq_len, batch_size=batch_size, steps=steps, lr=lr,
                min_lr_ratio=min_lr_ratio, warmup=warmup, weight_decay=weight_decay,
                eval_every=eval_every, seed=seed, heldout_tokens=len(held),
                tokens_dir=str(tokens_dir), torch=torch.__version__,
                transformers=tf.__version__)
    log_json = dict(metrics=metrics, args=args, history=history)
    (out / "train_log.json").write_text(json.dumps(log_json, indent=2) + "\n")
    log(f"saved {out} (best held-out {best_loss:.4f} at step {best_step}, bf16 {saved_loss:.4f}, "
        f"{weights / 1e6:.1f} MB weights, {train_s:.0f}s)")
    return metrics


def write_examples(path: str | Path, tokenizer_dir: str | Path, n: int = 32, prefix_tokens: int = 64,
                   seed: int = 0) -> None:
    """examples/prompts.jsonl: held-out stdlib code prefixes."""
    from .heldout import heldout_prefixes

    rows = heldout_prefixes(str(tokenizer_dir), n=n, prefix_tokens=prefix_tokens, seed=seed)
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
