"""The frozen target a draft module is distilled from: a transformers CausalLM that hands back, per
window, the feature the drafter reads at inference and the logits it is scored against.

EAGLE3 reads three aux layers' outputs (the residual stream after layer i, before any final norm:
what the engine's ``CausalLM.forward(capture=...)`` gives the drafter); a NextN/MTP layer reads
the final-normed hidden state (the input of the target's lm_head, the engine's ``hidden``).
"""
from __future__ import annotations

from pathlib import Path

import torch

__all__ = ["FrozenTarget"]


class FrozenTarget:
    """A transformers CausalLM, frozen (bf16 on GPU, float32 on CPU by default).

    `__call__(ids [B, T])` -> (features, logits [B, T, V]). Features: with three `aux_layers`,
    [B, T, 3H], the outputs of those layers (captured by forward hooks on the decoder layers, so
    the last layer is pre-final-norm too); with `aux_layers` empty, [B, T, H], the final-normed
    hidden state, and the logits are lm_head of exactly that tensor.
    """

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
        if self.aux_layers and (len(self.aux_layers) != 3 or bad):
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
        if not self.aux_layers:               # MTP: the decoder's output is final-normed
            hidden = self.model.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state
            return hidden, self.model.get_output_embeddings()(hidden)
        self._captured.clear()
        out = self.model(input_ids=ids, use_cache=False)
        aux = torch.cat([self._captured[i] for i in self.aux_layers], dim=-1)
        self._captured.clear()
        return aux, out.logits
