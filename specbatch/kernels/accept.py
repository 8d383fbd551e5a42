"""Tree acceptance in one launch: one program per sequence walks its tree from the root.

Same result as `specbatch.speculative.accept.walk`, element for element: at each level the
target's token at the current node (its argmax, or a sampled row's seeded draw) is compared with
the current node's children (nodes whose parent is the current node); the first child in node
order holding that token is accepted and becomes the current node, else the token is the emitted
correction and the walk stops. tokens past num are 0; path entries past the last accepted node
repeat it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["N", "max_depth"])
def _walk_kernel(tok_ptr, par_ptr, tgt_ptr, s_tok, s_par, s_tgt, N, max_depth,
                 out_tok, out_num, out_path, s_otok, s_opath, NB: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    lane = tl.arange(0, NB)
    valid = lane < N
    toks = tl.load(tok_ptr + b * s_tok + lane, mask=valid, other=0)
    pars = tl.load(par_ptr + b * s_par + lane, mask=valid, other=-2)   # -2: nobody's child
    cur = tl.zeros([], tl.int32)          # current node
    alive = tl.full([], 1, tl.int32)      # the walk has not stopped
    num = tl.zeros([], tl.int64)
    tl.store(out_path + b * s_opath, 0)
    for d in range(max_depth + 1):
        tok = tl.load(tgt_ptr + b * s_tgt + cur)                        # the target's token at cur
        hit = (pars == cur) & (toks == tok) & valid
        nxt = tl.min(tl.where(hit, lane, NB), axis=0)                   # first matching child
        # accepted child or correction: either way the emitted token is the target's
        tl.store(out_tok + b * s_otok + d, tl.where(alive != 0, tok, 0))
        num += alive
        alive = alive * (nxt < NB).to(tl.int32)
        cur = tl.where(alive != 0, nxt, cur)
        tl.store(out_path + b * s_opath + d + 1, cur.to(tl.int64), mask=d < max_depth)
    tl.store(out_num + b, num)


def walk_targets(node_tokens: torch.Tensor, parents: torch.Tensor, targets: torch.Tensor,
                  max_depth: int, out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """node_tokens / parents / targets [B, N] int64 (node 0 the root, parents[:, 0] = -1)
    -> (tokens [B, D+1], num [B], path [B, D+1]) int64, D = max_depth.

    out: optional (tokens, num, path) to write into (last dims contiguous). Graph-capturable.
    """
    B, N = node_tokens.shape
    dev = node_tokens.device
    for t in (node_tokens, parents, targets):
        if t.shape != (B, N) or t.dtype != torch.int64 or t.stride(1) != 1:
            raise ValueError("walk_targets wants int64 [B, N] inputs with contiguous rows")
    if out is None:
        out = (torch.empty(B, max_depth + 1, dtype=torch.int64, device=dev),
               torch.empty(B, dtype=torch.int64, device=dev),
               torch.empty(B, max_depth + 1, dtype=torch.int64, device=dev))
    tokens, num, path = out
    if tokens.shape != (B, max_depth + 1) or path.shape != (B, max_depth + 1) or num.shape != (B,) \
            or tokens.stride(1) != 1 or path.stride(1) != 1 or not num.is_contiguous() \
            or any(t.dtype != torch.int64 for t in out):
        raise ValueError("walk_targets out= wants int64 ([B, D+1], [B], [B, D+1]) with contiguous rows")
    if B == 0:
        return tokens, num, path
    _walk_kernel[(B,)](node_tokens, parents, targets, node_tokens.stride(0), parents.stride(0), targets.stride(0),
                       N, max_depth, tokens, num, path, tokens.stride(0), path.stride(0),
                       NB=triton.next_power_of_2(N), num_warps=1)
    return tokens, num, path
