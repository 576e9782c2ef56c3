"""Mapping Hugging Face parameter names onto our fused layout, and the weights fingerprint."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import safe_open

from kvblend.errors import ModelNotFoundError
from kvblend.models.transformer import Transformer

_FUSED = {
    "qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "gate_up": ("mlp.gate_proj", "mlp.up_proj"),
}
_RENAMED = {
    "o": "self_attn.o_proj",
    "down": "mlp.down_proj",
    "input_norm": "input_layernorm",
    "post_norm": "post_attention_layernorm",
    "q_norm": "self_attn.q_norm",
    "k_norm": "self_attn.k_norm",
}
# Gemma's four norms: its "post_attention_layernorm" normalises the attention output;
# the MLP's input norm (our post_norm) is "pre_feedforward_layernorm".
_SANDWICH_RENAMED = {
    **_RENAMED,
    "post_norm": "pre_feedforward_layernorm",
    "attn_out_norm": "post_attention_layernorm",
    "mlp_out_norm": "post_feedforward_layernorm",
}


def _layer_state(hf: Mapping[str, torch.Tensor], i: int, sandwich: bool) -> dict[str, torch.Tensor]:
    pre = f"model.layers.{i}."
    out: dict[str, torch.Tensor] = {}
    for ours, parts in _FUSED.items():
        for kind in ("weight", "bias"):
            names = [f"{pre}{p}.{kind}" for p in parts]
            if all(n in hf for n in names):
                out[f"layers.{i}.{ours}.{kind}"] = torch.cat([hf[n] for n in names])
    for ours, theirs in (_SANDWICH_RENAMED if sandwich else _RENAMED).items():
        for kind in ("weight", "bias"):
            if f"{pre}{theirs}.{kind}" in hf:
                out[f"layers.{i}.{ours}.{kind}"] = hf[f"{pre}{theirs}.{kind}"]
    return out


def to_our_state(
    hf: Mapping[str, torch.Tensor], num_layers: int, tied: bool, sandwich: bool = False, norm_plus_one: bool = False,
) -> dict[str, torch.Tensor]:
    """Hugging Face Llama/Qwen2/Gemma 3 names -> our parameter names (q/k/v and gate/up
    fused). ``norm_plus_one``: the checkpoint's norm weights w scale by 1 + w (Gemma);
    ours then hold 1 + w, so one RMSNorm serves every architecture."""
    out = {"embed_tokens.weight": hf["model.embed_tokens.weight"], "norm.weight": hf["model.norm.weight"]}
    out["lm_head.weight"] = hf["model.embed_tokens.weight"] if tied else hf["lm_head.weight"]
    for i in range(num_layers):
        out.update(_layer_state(hf, i, sandwich))
    if norm_plus_one:
        out = {k: v + 1 if _is_norm(k) else v for k, v in out.items()}
    return out


def _is_norm(name: str) -> bool:
    return name.rsplit(".", 2)[-2].endswith("norm")


def load_into(model: Transformer, hf_state: Mapping[str, torch.Tensor]) -> None:
    """Copy weights into ``model``; raise naming any missing or unexpected tensor."""
    c = model.cfg
    state = to_our_state(hf_state, c.num_layers, c.tie_word_embeddings, c.sandwich_norm, c.norm_plus_one)
    expected = set(model.state_dict())
    missing, unexpected = expected - set(state), set(state) - expected
    if missing or unexpected:
        raise ModelNotFoundError(
            f"weights do not fit the config: missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}"
        )
    model.load_state_dict(state, strict=True, assign=True)


def safetensors_files(folder: Path) -> list[Path]:
    """The weight files of a Hugging Face folder (single or sharded)."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / s for s in shards]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(f"no .safetensors weights in {folder}")
    return files


def read_safetensors(files: list[Path], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as reader:
            for name in reader.keys():
                state[name] = reader.get_tensor(name).to(dtype)
    return state


def fingerprint_files(files: list[Path]) -> str:
    """sha256 hex over the files' bytes in order (names excluded): a weights fingerprint
    that changes when any weight does; given one file, that file's sha256."""
    digest = hashlib.sha256()
    for f in files:
        with open(f, "rb") as fh:
            while chunk := fh.read(1 << 22):
                digest.update(chunk)
    return digest.hexdigest()
