"""Load HF checkpoints (config.json + *.safetensors, single file or sharded) straight into our modules."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Callable, Iterator

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from .config import DTYPE_NAMES, DecoderConfig, ModelError, load_config
from .llama import CausalLM, rope_inv_freq
from .registry import model_class

DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}
_CONFIG_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16",
                  "torch.float32": "float32", "torch.bfloat16": "bfloat16", "torch.float16": "float16"}


def resolve_dtype(name: str, cfg: DecoderConfig, device: torch.device) -> torch.dtype:
    """`auto`: the checkpoint's dtype on a GPU, float32 on the CPU (bf16 matmuls there are slow)."""
    if name != "auto":
        if name not in DTYPES:
            raise ModelError(f"dtype {name!r} is not supported (expected auto, {', '.join(DTYPES)})")
        return DTYPES[name]
    if device.type == "cpu":
        return torch.float32
    return DTYPES[_CONFIG_DTYPES.get(str(cfg.torch_dtype), "bfloat16")]


def safetensors_files(model_dir: str | Path) -> list[Path]:
    """The weight files: the index's shards where there is one (vLLM's rule), else model.safetensors
    where there is one (transformers' rule: an old copy, Mistral's consolidated.safetensors or an
    adapter beside it is not read), else every *.safetensors. A tensor two of the files hold (a
    stale model.safetensors beside the shards) is refused naming both: transformers would load the
    one and vLLM the other."""
    d = Path(model_dir)
    index = d / "model.safetensors.index.json"
    if index.is_file():
        try:
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError) as e:
            raise ModelError(f"{index}: not a valid safetensors index ({e})") from None
        missing = [f for f in files if not (d / f).is_file()]
        if missing:
            raise ModelError(f"{index}: shard {missing[0]} is missing from {d}")
        shards = [d / f for f in files]
        others = [p for p in sorted(d.glob("*.safetensors")) if p.name not in files]
        if others:                  # (e.g. Mistral's consolidated.safetensors: other names, no clash)
            _no_second_copy(shards + others, d, index.name)
        return shards
    if (d / "model.safetensors").is_file():
        return [d / "model.safetensors"]
    files = sorted(d.glob("*.safetensors"))
    if len(files) > 1:
        _no_second_copy(files, d)
    if not files:
        bins = sorted(p.name for p in d.glob("*.bin") if p.name.startswith(("pytorch_model", "model")))
        if bins:
            raise ModelError(f"{d}: holds PyTorch weights ({bins[0]}), which specbatch does not load (a pickle can run "
                             "code); convert them to safetensors: transformers' save_pretrained writes them, or "
                             "safetensors.torch.save_file(torch.load(path), 'model.safetensors') for a bare state dict")
        raise ModelError(f"{d}: no *.safetensors weights (expected model.safetensors or a sharded index)")
    return files


def _no_second_copy(files: list[Path], d: Path, index: str | None = None) -> None:
    seen: dict[str, Path] = {}
    for path in files:
        for name in sorted(tensor_names([path])):
            if name in seen:
                named = f": {index} names {seen[name].name}, transformers would load {path.name}" if index else ""
                raise ModelError(f"{d}: {seen[name].name} and {path.name} both hold tensor {name} (two copies of the "
                                 f"weights{named}); remove the one that is not the model's")
            seen[name] = path


_LFS_POINTER = b"version https://git-lfs"


def _unreadable(path: Path, e: Exception) -> Exception:
    """A weights file safetensors cannot read, in one line: a git-lfs pointer left by a clone without
    LFS is named as such. Out of memory or a CUDA error while copying a tensor to the device is the
    device's, not the file's: returned as itself."""
    if isinstance(e, torch.OutOfMemoryError) or (isinstance(e, RuntimeError) and "CUDA" in str(e)):
        return e
    try:
        with open(path, "rb") as f:
            head = f.read(len(_LFS_POINTER))
    except OSError:
        head = b""
    if head == _LFS_POINTER:
        return ModelError(f"{path}: a git-lfs pointer, not the weights (the repository was cloned without LFS); "
                          "run `git lfs pull` in its directory, or download the file itself")
    why = str(e).splitlines()[0] if str(e) else type(e).__name__
    damaged = "; the file is cut short or damaged: download it again" if isinstance(e, SafetensorError) else ""
    return ModelError(f"{path}: cannot read safetensors ({why}){damaged}")


def iter_tensors(files: list[Path], device: torch.device,
                 keep: Callable[[str], bool] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every tensor in `files`, or of those whose name `keep` accepts."""
    for path in files:
        try:
            with safe_open(str(path), framework="pt", device=str(device)) as f:
                for name in f.keys():
                    if keep is None or keep(name):
                        yield name, f.get_tensor(name)
        except (OSError, ValueError, RuntimeError, SafetensorError) as e:
            raise _unreadable(path, e) from None


def check_tensor(where: str, name: str, p: torch.Tensor, t: torch.Tensor, expected: str = "") -> None:
    """A checkpoint tensor fits the parameter it fills: its shape, and real weights for a float
    parameter (fp8 / int8 codes would copy in as numbers, their scales dropped)."""
    if tuple(p.shape) != tuple(t.shape):
        raise ModelError(f"{where}: tensor {name} has shape {tuple(t.shape)}, expected {tuple(p.shape)}{expected}")
    if p.is_floating_point() and (not t.is_floating_point() or t.element_size() < 2):
        raise ModelError(f"{where}: tensor {name} is {str(t.dtype).removeprefix('torch.')} (a quantized "
                         "checkpoint?); expected float32, bfloat16 or float16 weights")


def load_weights(module: nn.Module, tensors: Iterator[tuple[str, torch.Tensor]], where: str,
                 optional: tuple[str, ...] = ()) -> list[str]:
    """Copy tensors into `module` by name. Returns names the module has no parameter for.

    Every parameter must be filled except those in `optional`; shape mismatches are errors.
    """
    params = dict(module.named_parameters())
    filled, extra = set(), []
    for name, t in tensors:
        p = params.get(name)
        if p is None:
            extra.append(name)
            continue
        check_tensor(where, name, p, t)
        with torch.no_grad():
            p.copy_(t)
        filled.add(name)
    missing = [n for n in params if n not in filled and n not in optional]
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise ModelError(f"{where}: missing weights {', '.join(missing[:3])}{more}")
    return extra


def load_target(model_dir: str | Path, dtype: str = "auto",
                device: str | torch.device = "cpu") -> tuple[CausalLM, dict]:
    """Build the decoder from `model_dir` on `device` (the class the registry names for its
    architecture); returns (model in eval mode, raw config dict)."""
    device = torch.device(device)
    cfg, raw = load_config(model_dir)
    files = safetensors_files(model_dir)
    torch_dtype = resolve_dtype(dtype, cfg, device)
    with torch.device("meta"):
        model = model_class(cfg.architecture)(cfg)
    # the dtype on meta first: to_empty(...).to(dtype) would materialise float32 weights (twice a
    # bf16 model's bytes) whose freed blocks then stay in torch's cache
    model = model.to(torch_dtype).to_empty(device=device)
    model.inv_freq = rope_inv_freq(cfg).to(device)       # float32 even when weights are not
    names = tensor_names(files)
    tie = "lm_head.weight" not in names
    if tie and raw.get("tie_word_embeddings") is False:
        raise ModelError(f"{model_dir}: no lm_head.weight, and config.json says tie_word_embeddings: false "
                         "(a checkpoint missing its output layer)")
    if tie:
        model.lm_head.weight = model.model.embed_tokens.weight
    # Only the decoder's own tensors: an MTP layer stored alongside (model.layers.{L}.*,
    # model.mtp_layers.*, mtp.*) is the drafter's to load.
    params = set(dict(model.named_parameters()))
    _say_unused(names - params, cfg.num_layers, model_dir)
    load_weights(model, iter_tensors(files, device, keep=params.__contains__), str(model_dir),
                 optional=("lm_head.weight",) if tie else ())
    return model.eval().requires_grad_(False), raw


def _say_unused(unused: set[str], layers: int, model_dir: str | Path) -> None:
    """Tensors the decoder config.json describes has no place for (biases under attention_bias:
    false, layers past num_hidden_layers) are left out, as transformers leaves them, and said: the
    config may not describe the checkpoint. An MTP layer stored alongside is the drafter's."""
    def mtp(name: str) -> bool:
        if name.startswith(("model.mtp_layers.", "mtp.")):
            return True
        parts = name.split(".")
        return (name.startswith("model.layers.") and parts[2].isdigit() and int(parts[2]) >= layers
                and f"model.layers.{parts[2]}.eh_proj.weight" in unused)
    left = sorted(n for n in unused if not mtp(n) and not n.endswith("rotary_emb.inv_freq"))
    if left:
        more = f" and {len(left) - 3} more" if len(left) > 3 else ""
        print(f"warning: {model_dir}: {len(left)} tensor{'s' if len(left) > 1 else ''} in the weights "
              f"({', '.join(left[:3])}{more}) fit no part of the model config.json describes; left out, as "
              "transformers leaves them: check config.json (attention_bias, mlp_bias, num_hidden_layers)",
              file=sys.stderr)


def tensor_names(files: list[Path]) -> set[str]:
    names: set[str] = set()
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as f:
                names.update(f.keys())
        except (OSError, ValueError, RuntimeError, SafetensorError) as e:
            raise _unreadable(path, e) from None
    return names
