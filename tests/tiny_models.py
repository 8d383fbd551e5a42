"""Tiny random HF checkpoints and a tiny tokenizer, built offline with `save_pretrained`."""
from __future__ import annotations

import json
from pathlib import Path

import torch

CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "for i in range(10):\n    print(i * i)\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "import os\nimport sys\nprint(os.getcwd(), sys.argv)\n",
    "The quick brown fox jumps over the lazy dog. Hello world! Ünïcödé ✓\n",
    "while True:\n    line = input()\n    if not line:\n        break\n",
]
EOS = "<|endoftext|>"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6,
              initializer_range=0.2)


def make_tokenizer(out_dir: str | Path, vocab_size: int = 320):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOS, "<|user|>", "<|assistant|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out_dir))
    return fast


def make_checkpoint(arch: str, out_dir: str | Path, *, seed: int = 0, vocab_size: int = 320,
                    eos_token_id: int | list[int] = 0, tie: bool = False, dtype=torch.float32,
                    max_shard_size: str | None = None, **overrides) -> Path:
    """A random `arch` checkpoint (llama | llama3 | qwen2 | qwen3 | mistral) with a tokenizer."""
    import transformers as tf

    out = Path(out_dir)
    kw = dict(COMMON, vocab_size=vocab_size, tie_word_embeddings=tie, eos_token_id=eos_token_id)
    if arch == "llama":
        cfg = tf.LlamaConfig(**kw)
    elif arch == "llama3":
        cfg = tf.LlamaConfig(**kw, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32}, rope_theta=500000.0)
    elif arch == "qwen2":
        cfg = tf.Qwen2Config(**kw)
    elif arch == "qwen3":
        cfg = tf.Qwen3Config(**kw, head_dim=24)
    elif arch == "mistral":
        cfg = tf.MistralConfig(**kw, sliding_window=None)
    else:
        raise ValueError(arch)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    cls = {"qwen2": tf.Qwen2ForCausalLM, "qwen3": tf.Qwen3ForCausalLM,
           "mistral": tf.MistralForCausalLM}.get(arch, tf.LlamaForCausalLM)
    torch.manual_seed(seed)
    model = cls(cfg).to(dtype)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(str(out), **kwargs)
    make_tokenizer(out, vocab_size)
    gen = {"eos_token_id": eos_token_id}
    (out / "generation_config.json").write_text(json.dumps(gen))
    return out


def hf_greedy(model_dir: str | Path, prompts: list[list[int]], max_new_tokens: int,
              eos_token_id=None) -> list[list[int]]:
    """What transformers generates greedily for each prompt (one at a time, float32, CPU)."""
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    outs = []
    for p in prompts:
        ids = torch.tensor([p])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=max_new_tokens, eos_token_id=eos_token_id, pad_token_id=0)
        outs.append(out[0, len(p):].tolist())
    return outs


def make_eagle3_head(out_dir: str | Path, target_dir: str | Path, *, draft_vocab: int | None = 200,
                     seed: int = 0, aux_ids: list[int] | None = None, own_embedding: bool = False,
                     fc_bias: bool = False, hidden_size: int | None = None, std: float = 0.2,
                     prefix: str = "") -> Path:
    """A random EAGLE3 head for the target at `target_dir`, in the published tensor layout:
    fc, midlayer.*, norm, lm_head over a reduced draft vocabulary, d2t / t2d, optional embed_tokens.
    `draft_vocab=None` writes a full-vocabulary head without draft_vocab_size / d2t / t2d."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t = json.loads((Path(target_dir) / "config.json").read_text())
    Ht, V = t["hidden_size"], t["vocab_size"]
    H = hidden_size or Ht
    heads, kv, I = 4, 2, 2 * H
    d = H // heads
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": H,
           "intermediate_size": I, "num_attention_heads": heads, "num_key_value_heads": kv,
           "num_hidden_layers": 1, "vocab_size": V, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
           "max_position_embeddings": t["max_position_embeddings"], "tie_word_embeddings": False,
           "hidden_act": "silu", "torch_dtype": "float32"}
    if H != Ht:
        cfg["target_hidden_size"] = Ht
    if aux_ids is not None:
        cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux_ids, "use_aux_hidden_state": True}
    Vd = draft_vocab or V
    if draft_vocab is not None:
        cfg["draft_vocab_size"] = Vd
    g = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=g) * std
    w = {
        "fc.weight": r(H, 3 * Ht),
        "midlayer.input_layernorm.weight": 1 + r(H),
        "midlayer.hidden_norm.weight": 1 + r(H),
        "midlayer.post_attention_layernorm.weight": 1 + r(H),
        "midlayer.self_attn.q_proj.weight": r(heads * d, 2 * H),
        "midlayer.self_attn.k_proj.weight": r(kv * d, 2 * H),
        "midlayer.self_attn.v_proj.weight": r(kv * d, 2 * H),
        "midlayer.self_attn.o_proj.weight": r(H, heads * d),
        "midlayer.mlp.gate_proj.weight": r(I, H),
        "midlayer.mlp.up_proj.weight": r(I, H),
        "midlayer.mlp.down_proj.weight": r(H, I),
        "norm.weight": 1 + r(H),
        "lm_head.weight": r(Vd, H),
    }
    if fc_bias:
        w["fc.bias"] = r(H)
    if own_embedding or H != Ht:
        w["embed_tokens.weight"] = r(V, H)
    if draft_vocab is not None:
        chosen = torch.randperm(V, generator=g)[:Vd].sort().values
        w["d2t"] = chosen - torch.arange(Vd)
        t2d = torch.zeros(V, dtype=torch.bool)
        t2d[chosen] = True
        w["t2d"] = t2d
    save_file({prefix + k: v.contiguous() for k, v in w.items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    return out


MTP_MARK = {"deepseek": "model.layers.{i}.", "mimo": "model.mtp_layers.0.", "qwen": "mtp."}
_MTP_NAMES = {      # our (DeepSeek) names -> each layout's
    "deepseek": {},
    "mimo": {"enorm": "token_layernorm", "hnorm": "hidden_layernorm", "eh_proj": "input_proj",
             "shared_head.norm": "final_layernorm"},
    "qwen": {"enorm": "pre_fc_norm_embedding", "hnorm": "pre_fc_norm_hidden", "eh_proj": "fc",
             "shared_head.norm": "norm"},
}


def make_mtp_layer(target_dir: str | Path, layout: str = "deepseek", out_dir: str | Path | None = None,
                   *, seed: int = 0, std: float = 0.2, own_embedding: bool = False,
                   own_head: bool = False, drop: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """A random MTP layer for the target at `target_dir` in `layout` (deepseek | mimo | qwen),
    written into the target's own model.safetensors (`out_dir` None; DeepSeek at
    model.layers.{L}) or as an exported checkpoint in `out_dir` (DeepSeek at model.layers.0).
    The decoder layer is the target family's (a one-layer transformers model's layer 0); norms
    near 1, stored as offsets from 1 for qwen. `drop`: checkpoint names to leave out.
    Returns the tensors written, by checkpoint name."""
    import transformers as tf
    from safetensors.torch import load_file, save_file

    target_dir = Path(target_dir)
    raw = json.loads((target_dir / "config.json").read_text())
    cfg = tf.AutoConfig.from_pretrained(str(target_dir))
    cfg.num_hidden_layers = 1
    torch.manual_seed(seed)
    layer = tf.AutoModelForCausalLM.from_config(cfg).to(torch.float32).model.layers[0]
    g = torch.Generator().manual_seed(seed + 1)
    H, V = raw["hidden_size"], raw["vocab_size"]
    r = lambda *shape: torch.randn(*shape, generator=g) * std
    w = {k: v.detach().clone() for k, v in layer.state_dict().items() if "rotary" not in k}
    for k in w:
        if k.endswith("norm.weight"):
            w[k] = 1 + r(*w[k].shape)
    w.update({"enorm.weight": 1 + r(H), "hnorm.weight": 1 + r(H), "eh_proj.weight": r(H, 2 * H),
              "shared_head.norm.weight": 1 + r(H)})
    if own_embedding:
        w["embed_tokens.weight"] = r(V, H)
    if own_head:
        w["shared_head.head.weight"] = r(V, H)
    inside = out_dir is None
    prefix = MTP_MARK[layout].format(i=raw["num_hidden_layers"] if inside else 0)
    names = _MTP_NAMES[layout]
    out = {}
    for k, v in w.items():
        head = next((a for a in names if k.startswith(a + ".")), None)
        if head is not None:
            k = names[head] + k[len(head):]
        elif layout == "qwen" and not k.startswith(("embed_tokens", "shared_head")):
            k = "layers.0." + k
        if layout == "qwen" and k.endswith("norm.weight"):
            v = v - 1                  # Gemma-style storage
        out[prefix + k] = v.contiguous()
    out = {k: v for k, v in out.items() if k not in drop}
    if inside:
        path = target_dir / "model.safetensors"
        save_file({**load_file(str(path)), **out}, str(path), metadata={"format": "pt"})
        raw["mtp_num_hidden_layers" if layout == "qwen" else "num_nextn_predict_layers"] = 1
        (target_dir / "config.json").write_text(json.dumps(raw, indent=1))
    else:
        d = Path(out_dir)
        d.mkdir(parents=True, exist_ok=True)
        save_file(out, str(d / "model.safetensors"), metadata={"format": "pt"})
        (d / "config.json").write_text(json.dumps({**raw, "num_hidden_layers": 1,
                                                   "num_nextn_predict_layers": 1}, indent=1))
    return out
