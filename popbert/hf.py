"""Exact weight mapping between popbert's ONNX names and Hugging Face `BertForPreTraining`.

popbert stores dense weights as [in, out] (x @ W, Google's layout) and fuses Q, K and V into one
[H, 3H] matrix; Hugging Face stores `nn.Linear` weights as [out, in] with separate Q/K/V. The
map is a list of rules, each knowing how to move one popbert tensor to its HF tensors and back,
so both directions are the same table and round trips are bit-exact.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from popbert.builders.bert_config import BertConfig

Array = np.ndarray


@dataclass(frozen=True)
class Rule:
    """popbert tensor `ours` ↔ HF tensors `theirs` via `to_hf` / `from_hf`."""

    ours: str
    theirs: tuple[str, ...]
    to_hf: Callable[[Array], tuple[Array, ...]]
    from_hf: Callable[..., Array]


def _same(ours: str, theirs: str) -> Rule:
    return Rule(ours, (theirs,), lambda w: (w,), lambda w: w)


def _linear(ours: str, theirs: str) -> Rule:
    return Rule(ours, (theirs,), lambda w: (np.ascontiguousarray(w.T),),
                lambda w: np.ascontiguousarray(w.T))


def _qkv_weight(ours: str, prefix: str) -> Rule:
    names = tuple(f"{prefix}.{p}.weight" for p in ("query", "key", "value"))
    return Rule(ours, names,
                lambda w: tuple(np.ascontiguousarray(part.T) for part in np.split(w, 3, axis=1)),
                lambda q, k, v: np.ascontiguousarray(np.concatenate([q.T, k.T, v.T], axis=1)))


def _qkv_bias(ours: str, prefix: str) -> Rule:
    names = tuple(f"{prefix}.{p}.bias" for p in ("query", "key", "value"))
    return Rule(ours, names, lambda b: tuple(np.split(b, 3)),
                lambda q, k, v: np.concatenate([q, k, v]))


def _norm(ours: str, theirs: str) -> list[Rule]:
    return [_same(f"{ours}/Gamma", f"{theirs}.weight"), _same(f"{ours}/Beta", f"{theirs}.bias")]


def _dense(ours: str, theirs: str) -> list[Rule]:
    return [_linear(f"{ours}/W", f"{theirs}.weight"), _same(f"{ours}/B", f"{theirs}.bias")]


def encoder_rules(config: BertConfig, prefix: str = "bert.") -> list[Rule]:
    """Embeddings, encoder layers and pooler (`transformers.BertModel` under `prefix`)."""
    rules = [
        _same("Embedding/Embedding_Dict", f"{prefix}embeddings.word_embeddings.weight"),
        _same("Embedding/Positional_Dict", f"{prefix}embeddings.position_embeddings.weight"),
        _same("Embedding/Segment_Dict", f"{prefix}embeddings.token_type_embeddings.weight"),
        *_norm("Embedding/Norm", f"{prefix}embeddings.LayerNorm"),
    ]
    for i in range(config.num_layers):
        ours, theirs = f"Layer{i}", f"{prefix}encoder.layer.{i}"
        rules += [
            _qkv_weight(f"{ours}/Attention/QKV/W", f"{theirs}.attention.self"),
            _qkv_bias(f"{ours}/Attention/QKV/B", f"{theirs}.attention.self"),
            *_dense(f"{ours}/Attention/Out", f"{theirs}.attention.output.dense"),
            *_norm(f"{ours}/Attention/Norm", f"{theirs}.attention.output.LayerNorm"),
            *_dense(f"{ours}/FF/1", f"{theirs}.intermediate.dense"),
            *_dense(f"{ours}/FF/2", f"{theirs}.output.dense"),
            *_norm(f"{ours}/FF/Norm", f"{theirs}.output.LayerNorm"),
        ]
    rules += _dense("NSP/Pool", f"{prefix}pooler.dense")
    return rules


def head_rules() -> list[Rule]:
    """`BertForPreTraining`'s `cls.*` heads (the decoder weight is tied to the word embedding)."""
    return [
        *_dense("CLS/LMPrediction/Dense", "cls.predictions.transform.dense"),
        *_norm("CLS/LMPrediction/Norm", "cls.predictions.transform.LayerNorm"),
        _same("CLS/MLM/Bias", "cls.predictions.bias"),
        *_dense("NSP/Cls", "cls.seq_relationship"),
    ]


def pretraining_rules(config: BertConfig) -> list[Rule]:
    return encoder_rules(config) + head_rules()


# HF keys that are aliases of tensors the rules already carry (tied weights).
TIED_HF_KEYS = {
    "cls.predictions.decoder.weight": "bert.embeddings.word_embeddings.weight",
    "cls.predictions.decoder.bias": "cls.predictions.bias",
}


def to_hf(weights: Mapping[str, Array], config: BertConfig,
          include_tied: bool = True) -> dict[str, Array]:
    """popbert weights → `BertForPreTraining` state dict (numpy). Missing heads are skipped."""
    out: dict[str, Array] = {}
    optional = {rule.ours for rule in head_rules()}
    for rule in pretraining_rules(config):
        if rule.ours not in weights:
            if rule.ours in optional:
                continue
            raise KeyError(f"popbert weight {rule.ours!r} is missing")
        for name, value in zip(rule.theirs, rule.to_hf(np.asarray(weights[rule.ours]))):
            out[name] = value
    if include_tied:
        for alias, source in TIED_HF_KEYS.items():
            if source in out:
                out[alias] = out[source]
    return out


def from_hf(state: Mapping[str, Array], config: BertConfig) -> tuple[dict[str, Array], list[str]]:
    """HF state dict (with or without the `bert.` prefix) → (popbert weights, missing names).

    A rule whose HF tensors are absent (e.g. `BertModel` has no `cls.*` heads) is reported in
    `missing` so the caller can initialise those weights fresh and say so.
    """
    keys = set(state)
    if not any(k.startswith("bert.") for k in keys):
        state = {f"bert.{k}" if not k.startswith("cls.") else k: v for k, v in state.items()}
    weights: dict[str, Array] = {}
    missing: list[str] = []
    for rule in pretraining_rules(config):
        if all(name in state for name in rule.theirs):
            weights[rule.ours] = rule.from_hf(*(np.asarray(state[n]) for n in rule.theirs))
        else:
            missing.append(rule.ours)
    return weights, missing
