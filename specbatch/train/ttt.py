"""Training-time test for one-layer draft modules (an EAGLE3 head or a NextN/MTP layer): the module
unrolled over whole windows exactly as ``LayerDrafter`` runs it at inference, and the distillation
loss.

Alignment (the drafter in ``specbatch/speculative/layer_drafter.py``, the same for both modules): row p
holds the token at position p+1 and the feature of position p; its output predicts the token at
position p+2, i.e. it is scored against the target's distribution at position p+1. Training-time
test unrolls ``ttt_steps`` steps over every row of a window at once:

* step 0, row p: token x[p+1], the target's feature at p (the catch-up: committed rows). EAGLE3:
  fc(aux[p]), the three aux layers' outputs; MTP: the target's final-normed hidden state at p;
* step j >= 1, row p: token x[p+1], feature out_{j-1}[p-1] (the module's own output one row up:
  EAGLE3's pre-norm h, MTP's normed output). This is the drafted node at depth j of a chain whose
  committed prefix is rows 0..p-j (propose step s = j writes at row L+s-1 = p with L = p-j+1). It
  attends to the step-0 keys of rows <= p-j and to the step-s keys of rows p-j+s, s = 1..j (its
  ancestors' and its own draft K/V), RoPE position p. Rows p < j have no such prefix and are left
  out of the loss.

Only what surrounds the attention differs between the modules (`_Eagle3Steps`, `_MTPSteps`):

    EAGLE3  a = cat(input_layernorm(emb), hidden_norm(h_in)) [2H];   residual h_in
            out = y + mlp(post_attention_layernorm(y)),  y = residual + o_proj(attn(a))
    MTP     x = eh_proj(cat(enorm(emb), hnorm(h_in)));  a = input_layernorm(x);  residual x
            out = shared_head.norm(y + mlp(post_attention_layernorm(y)))

Every step at row p is scored against the same target distribution (position p+1): soft
cross-entropy against the target's probabilities restricted to the draft vocabulary and
renormalised (the MTP: the full vocabulary), step j weighted by ``step_weight ** j``. Step j's
top-1 agreement with the target's argmax is what chain drafting position j+1 gets accepted on
(given the earlier ones were).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..models.eagle3 import Eagle3Head
from ..models.llama import Attention, rope_cos_sin, rotate_half
from ..models.mtp import MTPLayer

DraftModule = Eagle3Head | MTPLayer


def _shift_rows(x: torch.Tensor, d: int) -> torch.Tensor:
    """y[:, p] = x[:, p - d] (zeros for p < d), along dim 1."""
    if d == 0:
        return x
    pad = x.new_zeros(x.shape[0], d, *x.shape[2:])
    return torch.cat([pad, x[:, :-d]], dim=1)


def _ttt_attention(q: torch.Tensor, ks: list[torch.Tensor], vs: list[torch.Tensor], j: int,
                   scale: float) -> torch.Tensor:
    """Step j >= 1. q [B, n, Hq, D]; ks/vs[s] [B, n, Hkv, D], the keys/values step s wrote at every
    row. Row p sees step-0 rows r <= p - j and, for s = 1..j, step s's row p - j + s."""
    B, n, Hq, D = q.shape
    g = Hq // ks[0].shape[2]
    exp = (lambda t: t.repeat_interleave(g, dim=2)) if g > 1 else (lambda t: t)
    qh = q.transpose(1, 2)                                               # [B, Hq, n, D]
    k0, v0 = exp(ks[0]).transpose(1, 2), exp(vs[0]).transpose(1, 2)      # [B, Hq, n, D]
    s0 = torch.matmul(qh, k0.transpose(-1, -2)).float() * scale          # [B, Hq, n, n]
    visible = torch.ones(n, n, dtype=torch.bool, device=q.device).tril(-j)
    s0 = s0.masked_fill(~visible, float("-inf"))
    rows = torch.arange(n, device=q.device)
    diag, vals = [], []
    for s in range(1, j + 1):
        ksh = exp(_shift_rows(ks[s], j - s))                             # [B, n, Hq, D]: row p -> p-j+s
        d = (q * ksh).sum(-1).float().transpose(1, 2) * scale            # [B, Hq, n]
        diag.append(d.masked_fill(rows < j - s, float("-inf")))
        vals.append(exp(_shift_rows(vs[s], j - s)).transpose(1, 2))      # [B, Hq, n, D]
    probs = torch.softmax(torch.cat([s0, torch.stack(diag, dim=-1)], dim=-1), dim=-1)
    out = torch.matmul(probs[..., :n].to(v0.dtype), v0)
    for s in range(1, j + 1):
        out = out + probs[..., n + s - 1, None].to(v0.dtype) * vals[s - 1]
    return out.transpose(1, 2)                                           # [B, n, Hq, D]


class _Eagle3Steps:
    """EAGLE3 around the attention: the attention reads [normed emb, normed h] (2H wide), the
    residual stream starts at h; the output is pre-norm."""

    def __init__(self, head: Eagle3Head):
        self.head, self.layer = head, head.midlayer
        self.attn: Attention = head.midlayer.self_attn

    def embed(self, emb: torch.Tensor) -> torch.Tensor:
        return self.layer.input_layernorm(emb)

    def first(self, feats: torch.Tensor) -> torch.Tensor:
        return self.head.fc(feats)                    # [B, n, 3H_target] -> [B, n, H]

    def attn_input(self, e: torch.Tensor, h_in: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.cat([e, self.layer.hidden_norm(h_in)], dim=-1), h_in

    def finish(self, y: torch.Tensor) -> torch.Tensor:
        return y + self.layer.mlp(self.layer.post_attention_layernorm(y))


class _MTPSteps:
    """NextN/MTP around the attention: x = eh_proj(cat(normed emb, normed h)) is the residual
    stream, the attention reads input_layernorm(x); the output is normed (shared_head.norm)."""

    def __init__(self, layer: MTPLayer):
        self.layer = layer
        self.attn: Attention = layer.self_attn

    def embed(self, emb: torch.Tensor) -> torch.Tensor:
        return self.layer.enorm(emb)

    def first(self, feats: torch.Tensor) -> torch.Tensor:
        return feats                                  # the target's final-normed hidden [B, n, H]

    def attn_input(self, e: torch.Tensor, h_in: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        m = self.layer
        h = m.hnorm(h_in)
        x = m.eh_proj(torch.cat([h, e] if m.cfg.hidden_first else [e, h], dim=-1))
        return m.input_layernorm(x), x

    def finish(self, y: torch.Tensor) -> torch.Tensor:
        m = self.layer
        return m.shared_head.norm(y + m.mlp(m.post_attention_layernorm(y)))


def _steps(head: DraftModule) -> _Eagle3Steps | _MTPSteps:
    if isinstance(head, Eagle3Head):
        return _Eagle3Steps(head)
    if isinstance(head, MTPLayer):
        return _MTPSteps(head)
    raise TypeError(f"ttt_forward: expected an Eagle3Head or an MTPLayer, got {type(head).__name__}")


def ttt_forward(head: DraftModule, embed_weight: torch.Tensor, tokens: torch.Tensor,
                feats: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """tokens [B, n] (row p: token at position p+1), feats (row p: the target's feature at position
    p; EAGLE3 [B, n, 3H] aux states, MTP [B, n, H] final-normed hidden) -> [out_0, ...,
    out_{steps-1}], each [B, n, H] (EAGLE3 pre-norm, MTP normed): out_j[:, p] is what the drafter
    computes for row p at draft depth j (see the module docstring)."""
    m = _steps(head)
    attn = m.attn
    c = attn.cfg
    B, n = tokens.shape
    if c.sliding_window is not None and c.sliding_window < n:
        raise ValueError(f"ttt_forward: windows of {n} tokens exceed the module's sliding window "
                         f"({c.sliding_window}); use seq_len <= {c.sliding_window}")
    D = c.head_dim
    pos = torch.arange(n, device=tokens.device)[None].expand(B, n)
    emb = m.embed(F.embedding(tokens, embed_weight))
    cos = sin = None
    ks: list[torch.Tensor] = []
    vs: list[torch.Tensor] = []
    outs: list[torch.Tensor] = []
    h = None
    for j in range(steps):
        h_in = m.first(feats) if j == 0 else _shift_rows(h, 1)
        x, residual = m.attn_input(emb, h_in)             # attention input, residual stream
        if cos is None:
            cos, sin = rope_cos_sin(head.inv_freq, pos, x.dtype)
        q = attn.q_proj(x).view(B, n, -1, D)
        k = attn.k_proj(x).view(B, n, -1, D)
        v = attn.v_proj(x).view(B, n, -1, D)
        if c.qk_norm:
            q, k = attn.q_norm(q), attn.k_norm(k)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        ks.append(k)
        vs.append(v)
        if j == 0:
            o = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                scale=attn.scale, enable_gqa=q.shape[2] != k.shape[2]).transpose(1, 2)
        else:
            o = _ttt_attention(q, ks, vs, j, attn.scale)
        h = m.finish(residual + attn.o_proj(o.reshape(B, n, -1)))
        outs.append(h)
    return outs


def distill_targets(logits: torch.Tensor, draft_ids: torch.Tensor | None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Target logits [B, n, V] at positions p+1 -> (probabilities over the draft vocab,
    renormalised, float32 [B, n, Vd]; the target's argmax over its full vocab [B, n]).
    `draft_ids` None: the full vocabulary (MTP), no gather copy."""
    sel = logits if draft_ids is None else logits.index_select(-1, draft_ids)
    return torch.softmax(sel.float(), dim=-1), logits.argmax(-1)


def ttt_loss(head: DraftModule, hs: list[torch.Tensor], probs: torch.Tensor, top: torch.Tensor,
             step_weight: float) -> tuple[torch.Tensor, dict]:
    """Weighted soft cross-entropy over the steps (weights step_weight**j, normalised) and, per
    step, summed statistics over its valid rows p >= j: ce, rows, top-1 agreement with the
    target's argmax, rows whose argmax is in the draft vocab and agreement among those (a module
    without `t2d`, the MTP, drafts over the full vocabulary: every row is in it)."""
    t2d = getattr(head, "t2d", None)
    weights = [step_weight ** j for j in range(len(hs))]
    total = 0.0
    stats = {"ce": [], "rows": [], "agree": [], "in_vocab": [], "agree_in_vocab": []}
    for j, h in enumerate(hs):
        logits = head.logits(h[:, j:]).float()                           # [B, n-j, Vd]
        logp = torch.log_softmax(logits, dim=-1)
        ce = -(probs[:, j:] * logp).sum(-1)                              # [B, n-j]
        total = total + weights[j] * ce.mean()
        with torch.no_grad():                # device tensors: no sync per step
            t = top[:, j:]
            hit = head.to_target(logits.argmax(-1)) == t
            inv = t2d[t] if t2d is not None else torch.ones_like(hit)
            stats["ce"].append(ce.detach().sum())
            stats["rows"].append(ce.numel())
            stats["agree"].append(hit.sum())
            stats["in_vocab"].append(inv.sum())
            stats["agree_in_vocab"].append((hit & inv).sum())
    return total / sum(weights), stats
