"""Exact weight mapping between popbert's ONNX names and Hugging Face models, and each family's
Hugging Face code.

popbert stores dense weights as [in, out] (x @ W, Google's layout) and fuses Q, K and V into one
[H, 3H] matrix; Hugging Face stores `nn.Linear` weights as [out, in] with separate Q/K/V. The
map is a list of rules, each knowing how to move one popbert tensor to its HF tensors and back,
so both directions are the same table and round trips are bit-exact.

`ARCHITECTURES` describes every `transformers` class a checkpoint can be written as (BERT's
`BertForPreTraining` — the `to_hf`/`from_hf` pair — `BertModel`, `BertForMaskedLM`, ...;
ModernBERT's `ModernBertModel`, `ModernBertForMaskedLM`, ...), each with exactly the keys
`transformers` expects. A family's plain facts are its own (`popbert.builders.families.Family`:
`hf_model_type`, `hf_base`, `hf_pretraining`, `hf_config_fields`, `hf_tokenizers`), each task's
class is the task's (`popbert.tasks.Task.hf_architectures`), and the family's code — encoder
rules, config.json checks, how import reads a directory — is its entry in `HF_FAMILIES`: nothing
here branches on a family's name. `popbert.hf.checkpoint` reads and writes whole Hugging Face
model directories with these tables.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from popbert.builders.bert_config import BertConfig
from popbert.builders.families import FAMILIES, Family
from popbert.errors import UsageError
from popbert.hf import modernbert as hf_modernbert

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


def encoder_rules(config: BertConfig, prefix: str = "bert.", pooler: bool = True) -> list[Rule]:
    """Embeddings, encoder layers and (unless `pooler=False`) the pooler: `transformers.BertModel`
    under `prefix`."""
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
    if pooler:
        rules += _dense("NSP/Pool", f"{prefix}pooler.dense")
    return rules


def mlm_head_rules() -> list[Rule]:
    """`cls.predictions`, the MLM head (the decoder weight is tied to the word embedding)."""
    return [
        *_dense("CLS/LMPrediction/Dense", "cls.predictions.transform.dense"),
        *_norm("CLS/LMPrediction/Norm", "cls.predictions.transform.LayerNorm"),
        _same("CLS/MLM/Bias", "cls.predictions.bias"),
    ]


def head_rules() -> list[Rule]:
    """`BertForPreTraining`'s `cls.*` heads: MLM and NSP."""
    return [*mlm_head_rules(), *_dense("NSP/Cls", "cls.seq_relationship")]


def squad_rules() -> list[Rule]:
    """`BertForQuestionAnswering.qa_outputs` ↔ the span head of `popbert.tasks.squad`."""
    return _dense("Squad/Logits", "qa_outputs")


def classification_rules() -> list[Rule]:
    """`BertForSequenceClassification.classifier` ↔ the classification head."""
    return _dense("Classifier", "classifier")


def pretraining_rules(config: BertConfig) -> list[Rule]:
    return encoder_rules(config) + head_rules()


def task_head_rules() -> list[Rule]:
    """Fine-tuning heads: read when present, never reported missing by `from_hf`."""
    return squad_rules() + classification_rules()


# HF keys that are aliases of tensors the rules already carry (tied weights).
TIED_HF_KEYS = {
    "cls.predictions.decoder.weight": "bert.embeddings.word_embeddings.weight",
    "cls.predictions.decoder.bias": "cls.predictions.bias",
}


@dataclass(frozen=True)
class Architecture:
    """One `transformers` class: its family, key prefix, whether it has a pooler, and its
    heads. `rules(config)` lists every tensor the class holds."""

    name: str
    prefix: str
    pooler: bool
    heads: Callable[[BertConfig], list[Rule]]
    tied: tuple[tuple[str, str], ...] = ()
    family: str = "bert"

    def rules(self, config: BertConfig) -> list[Rule]:
        encoder = HF_FAMILIES[self.family].encoder
        return encoder(config, self.prefix, self.pooler) + self.heads(config)


# ----------------------------------------------------------------------------------------------
# ModernBERT (`transformers.ModernBertModel` and its task classes; `model.architecture:
# modernbert`). Its linear layers are bias-free and its norms beta-free unless the config says
# otherwise, so each rule is listed only where the tensor exists.


def _modern_dense(ours: str, theirs: str, bias: bool) -> list[Rule]:
    rules = [_linear(f"{ours}/W", f"{theirs}.weight")]
    if bias:
        rules.append(_same(f"{ours}/B", f"{theirs}.bias"))
    return rules


def _modern_norm(config: BertConfig, ours: str, theirs: str) -> list[Rule]:
    rules = [_same(f"{ours}/Gamma", f"{theirs}.weight")]
    if config.modernbert.norm_bias:
        rules.append(_same(f"{ours}/Beta", f"{theirs}.bias"))
    return rules


def modernbert_encoder_rules(config: BertConfig, prefix: str = "model.",
                             pooler: bool = False) -> list[Rule]:
    """`ModernBertModel` under `prefix`: embeddings, layers (layer 0 has no attention norm),
    final norm (no pooler: `pooler` must be False). Wqkv is [Q; K; V] by output rows, exactly
    popbert's fused QKV transposed."""
    if pooler:
        raise ValueError("ModernBertModel has no pooler")
    m = config.modernbert
    rules = [_same("Embedding/Embedding_Dict", f"{prefix}embeddings.tok_embeddings.weight"),
             *_modern_norm(config, "Embedding/Norm", f"{prefix}embeddings.norm")]
    for i in range(config.num_layers):
        ours, theirs = f"Layer{i}", f"{prefix}layers.{i}"
        if i > 0:
            rules += _modern_norm(config, f"{ours}/Attention/Norm", f"{theirs}.attn_norm")
        rules += [
            *_modern_dense(f"{ours}/Attention/QKV", f"{theirs}.attn.Wqkv", m.attention_bias),
            *_modern_dense(f"{ours}/Attention/Out", f"{theirs}.attn.Wo", m.attention_bias),
            *_modern_norm(config, f"{ours}/MLP/Norm", f"{theirs}.mlp_norm"),
            *_modern_dense(f"{ours}/MLP/Wi", f"{theirs}.mlp.Wi", m.mlp_bias),
            *_modern_dense(f"{ours}/MLP/Wo", f"{theirs}.mlp.Wo", m.mlp_bias),
        ]
    return rules + _modern_norm(config, "FinalNorm", f"{prefix}final_norm")


def _modern_head(config: BertConfig, ours: str) -> list[Rule]:
    """`ModernBertPredictionHead` (`head.*`): dense, GELU, norm."""
    return [*_modern_dense(f"{ours}/Dense", "head.dense", config.modernbert.classifier_bias),
            *_modern_norm(config, f"{ours}/Norm", "head.norm")]


def modernbert_mlm_rules(config: BertConfig) -> list[Rule]:
    rules = _modern_head(config, "CLS/LMPrediction")
    if config.modernbert.decoder_bias:
        rules.append(_same("CLS/MLM/Bias", "decoder.bias"))
    return rules


def modernbert_classification_rules(config: BertConfig) -> list[Rule]:
    return _modern_head(config, "Pooler/Head") + _dense("Classifier", "classifier")


def modernbert_squad_rules(config: BertConfig) -> list[Rule]:
    return _modern_head(config, "Squad/Head") + _dense("Squad/Logits", "classifier")


def token_classification_rules() -> list[Rule]:
    """`BertForTokenClassification.classifier` ↔ the token head of
    `popbert.tasks.token_classification`."""
    return _dense("Tokens/Classifier", "classifier")


def modernbert_token_classification_rules(config: BertConfig) -> list[Rule]:
    return _modern_head(config, "Tokens/Head") + _dense("Tokens/Classifier", "classifier")


MODERNBERT_TIED = (("decoder.weight", "model.embeddings.tok_embeddings.weight"),)

ARCHITECTURES: dict[str, Architecture] = {
    "BertModel": Architecture("BertModel", "", True, lambda config: []),
    "BertForPreTraining": Architecture("BertForPreTraining", "bert.", True,
                                       lambda config: head_rules(),
                                       tied=tuple(TIED_HF_KEYS.items())),
    # MLM-only pre-training (model.next_sentence_prediction: false): no pooler, no NSP head.
    "BertForMaskedLM": Architecture("BertForMaskedLM", "bert.", False,
                                    lambda config: mlm_head_rules(),
                                    tied=tuple(TIED_HF_KEYS.items())),
    "BertForQuestionAnswering": Architecture("BertForQuestionAnswering", "bert.", False,
                                             lambda config: squad_rules()),
    "BertForSequenceClassification": Architecture("BertForSequenceClassification", "bert.",
                                                  True, lambda config: classification_rules()),
    "BertForTokenClassification": Architecture("BertForTokenClassification", "bert.", False,
                                               lambda config: token_classification_rules()),
    "ModernBertModel": Architecture("ModernBertModel", "", False, lambda config: [],
                                    family="modernbert"),
    "ModernBertForMaskedLM": Architecture("ModernBertForMaskedLM", "model.", False,
                                          modernbert_mlm_rules, tied=MODERNBERT_TIED,
                                          family="modernbert"),
    "ModernBertForSequenceClassification": Architecture(
        "ModernBertForSequenceClassification", "model.", False,
        modernbert_classification_rules, family="modernbert"),
    "ModernBertForQuestionAnswering": Architecture(
        "ModernBertForQuestionAnswering", "model.", False, modernbert_squad_rules,
        family="modernbert"),
    "ModernBertForTokenClassification": Architecture(
        "ModernBertForTokenClassification", "model.", False,
        modernbert_token_classification_rules, family="modernbert"),
}

def task_architecture(family: str, task: str) -> str | None:
    """The `transformers` class of a `family` model fine-tuned for `task`, if there is one
    (each task's own table, `popbert.tasks.Task.hf_architectures`; GroupBERT has none)."""
    from popbert.tasks import TASKS

    return TASKS[task].hf_architecture(family) if task in TASKS else None


def architectures_of(family: str) -> list[str]:
    """The `transformers` classes a checkpoint of `family` can be written as."""
    return [name for name, spec in ARCHITECTURES.items() if spec.family == family]


def architectures_by_heads(family: str) -> list[str]:
    """The `transformers` classes of `family` that hold heads, most specific first: each
    task's (`popbert.tasks.TASKS`, in order), then the family's pre-training ones. The bare
    encoder (an embedding model's class) holds none: it is `architecture_for`'s last resort."""
    from popbert.tasks import TASKS

    base = FAMILIES[family].hf_base
    tasks = [task.hf_architecture(family) for task in TASKS.values()]
    return [name for name in tasks if name and name != base] + list(
        FAMILIES[family].hf_pretraining)


def architecture_for(weights: Mapping[str, object], config: BertConfig | None = None) -> str:
    """The `transformers` class that holds exactly the heads present in `weights`, of the
    family `config.architecture` (the default family's without a config)."""
    config = config or BertConfig()
    for name in architectures_by_heads(config.architecture):
        heads = ARCHITECTURES[name].heads(config)
        if all(rule.ours in weights for rule in heads):
            return name
    return str(FAMILIES[config.architecture].hf_base)


def to_hf_architecture(weights: Mapping[str, Array], config: BertConfig, architecture: str,
                       include_tied: bool = False) -> dict[str, Array]:
    """popbert weights → the state dict of `architecture` (one of `ARCHITECTURES`).

    Every key the class expects is produced (a missing popbert weight is a KeyError naming it);
    tensors of other heads are left out, so `transformers` reports no unexpected keys. Tied
    aliases are left out by default, as `save_pretrained` does.
    """
    if architecture not in ARCHITECTURES:
        raise KeyError(f"unknown architecture {architecture!r}; expected one of "
                       f"{', '.join(ARCHITECTURES)}")
    spec = ARCHITECTURES[architecture]
    out: dict[str, Array] = {}
    for rule in spec.rules(config):
        if rule.ours not in weights:
            raise KeyError(f"popbert weight {rule.ours!r} is missing (needed by {architecture})")
        for name, value in zip(rule.theirs, rule.to_hf(np.asarray(weights[rule.ours]))):
            out[name] = value
    if include_tied:
        for alias, source in spec.tied:
            out[alias] = out[source]
    return out


def from_hf_architecture(state: Mapping[str, Array], config: BertConfig, architecture: str
                         ) -> tuple[dict[str, Array], list[str]]:
    """The state dict of `architecture` → (popbert weights, names of popbert weights whose
    HF tensors are absent). A tied alias stands in for its source when only it is stored."""
    spec = ARCHITECTURES[architecture]
    state = dict(state)
    for alias, source in spec.tied:
        if source not in state and alias in state:
            state[source] = state[alias]
    weights: dict[str, Array] = {}
    missing: list[str] = []
    for rule in spec.rules(config):
        if all(name in state for name in rule.theirs):
            weights[rule.ours] = rule.from_hf(*(np.asarray(state[n]) for n in rule.theirs))
        else:
            missing.append(rule.ours)
    return weights, missing


def to_hf(weights: Mapping[str, Array], config: BertConfig,
          include_tied: bool = True) -> dict[str, Array]:
    """popbert weights → `BertForPreTraining` state dict (numpy). Missing heads (and the pooler,
    which MLM-only models do not have) are skipped."""
    out: dict[str, Array] = {}
    optional = {rule.ours for rule in head_rules() + _dense("NSP/Pool", "")}
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
    state = with_bert_prefix(state)
    for alias, source in TIED_HF_KEYS.items():
        # Some checkpoints carry only the alias of a tied tensor (e.g. the decoder's bias).
        if source not in state and alias in state:
            state[source] = state[alias]
    weights: dict[str, Array] = {}
    missing: list[str] = []
    for rule in pretraining_rules(config):
        if all(name in state for name in rule.theirs):
            weights[rule.ours] = rule.from_hf(*(np.asarray(state[n]) for n in rule.theirs))
        else:
            missing.append(rule.ours)
    for rule in task_head_rules():
        if all(name in state for name in rule.theirs):
            weights[rule.ours] = rule.from_hf(*(np.asarray(state[n]) for n in rule.theirs))
    return weights, missing


# Top-level modules of the `transformers` BERT classes besides `bert.` itself.
HEAD_PREFIXES = ("cls.", "qa_outputs.", "classifier.")


def with_bert_prefix(state: Mapping[str, Array]) -> dict[str, Array]:
    """A `BertModel` state dict (no `bert.` prefix) renamed like the task models' (`bert.*`).

    A state that already has `bert.` keys is returned as is; head keys never get the prefix.
    """
    if any(k.startswith("bert.") for k in state):
        return dict(state)
    return {k if k.startswith(HEAD_PREFIXES) else f"bert.{k}": v for k, v in state.items()}


def unused_hf_keys(state: Mapping[str, Array], config: BertConfig) -> list[str]:
    """HF keys no rule reads (after `with_bert_prefix`), except tied aliases of read tensors and
    the `position_ids` buffer (an arange, not a weight)."""
    state = with_bert_prefix(state)
    read = {name for rule in pretraining_rules(config) + task_head_rules()
            for name in rule.theirs}
    read |= set(TIED_HF_KEYS)
    return sorted(k for k in state if k not in read and not k.endswith("position_ids"))


# ----------------------------------------------------------------------------------------------
# Each family's Hugging Face code, found by family name (its plain facts are the family's own,
# `Family.hf_*`): config.json ↔ `model` section, and the weight rules import reads a directory
# with. Adding a family with a `transformers` class is one entry here.

# The `model_type`s import reads and export writes: the families transformers has.
MODEL_TYPES = tuple(f.hf_model_type for f in FAMILIES.values() if f.hf_model_type)
# Hidden activations whose math is ONNX `Gelu` (exact, erf-based).
EXACT_GELU = ("gelu",)
# The family whose config.json and weights this module's BERT code reads and writes.
_BERT = "bert"


def hf_family(hf_config: dict[str, Any], source: str) -> Family:
    """The family whose `model_type` a `config.json` names (the default family's where it
    names none, as BERT's oldest files do)."""
    model_type = hf_config.get("model_type",
                               FAMILIES[BertConfig().architecture].hf_model_type)
    for family in FAMILIES.values():
        if family.hf_model_type is not None and family.hf_model_type == model_type:
            return family
    raise UsageError(f"{source}: model_type is {model_type!r}; expected one of "
                     f"{', '.join(MODEL_TYPES)}")


def bert_config_from_hf(hf_config: dict[str, Any], source: str,
                        sequence_length: int | None = None) -> BertConfig:
    """popbert's `model` section from a Hugging Face BERT `config.json` (checked field by field).

    `sequence_length` defaults to min(128, max_position_embeddings): fine-tuning and export set
    their own, and phase-1 pre-training uses 128.
    """
    family = hf_family(hf_config, source)
    if family is not FAMILIES[_BERT]:  # this reader's own family
        raise UsageError(f"{source}: model_type is {family.hf_model_type!r}; expected one of "
                         f"{', '.join(MODEL_TYPES)}")
    act = hf_config.get("hidden_act", "gelu")
    if act not in EXACT_GELU:
        raise UsageError(f"{source}: hidden_act is {act!r}; popbert's graph uses the exact "
                         "(erf) GELU, Hugging Face's 'gelu'")
    position_type = hf_config.get("position_embedding_type", "absolute")
    if position_type != "absolute":
        raise UsageError(f"{source}: position_embedding_type is {position_type!r}; only "
                         "'absolute' position embeddings are supported")
    if hf_config.get("is_decoder") or hf_config.get("add_cross_attention"):
        raise UsageError(f"{source}: is_decoder/add_cross_attention is set; popbert builds "
                         "the bidirectional BERT encoder only")
    values = hf_modernbert.read_fields(hf_config, family.hf_config_fields, source)
    values["sequence_length"] = sequence_length or min(128, values["max_position_embeddings"])
    values["max_predictions_per_seq"] = min(20, values["sequence_length"])
    config = hf_modernbert.model_config(values, architecture=family.name)
    try:
        config.validate()
    except ValueError as error:
        raise UsageError(f"{source}: {error}") from None
    return config


def hf_config_from_bert(config: BertConfig, architecture: str, pad_token_id: int = 0
                        ) -> dict[str, Any]:
    """The `config.json` `transformers.BertConfig.from_pretrained` reads back into `config`
    (`export_hf` adds a classifier's label names)."""
    family = FAMILIES[config.architecture]
    out: dict[str, Any] = {"architectures": [architecture], "model_type": family.hf_model_type,
                           "hidden_act": "gelu", "position_embedding_type": "absolute",
                           "pad_token_id": pad_token_id, "torch_dtype": "float32"}
    out.update(hf_modernbert.write_fields(config, family.hf_config_fields))
    return out


@dataclass
class Read:
    """What import read from a Hugging Face state dict: the class it holds, popbert's weights,
    the popbert weights it lacks (and which of them may be initialised fresh), the rules it
    was read with and the HF keys none read."""

    architecture: str
    weights: dict[str, Array]
    missing: list[str]
    rules: list[Rule]
    optional: set[str] = field(default_factory=set)
    ignored: list[str] = field(default_factory=list)


def _read_bert(state: Mapping[str, Array], config: BertConfig,
               hf_config: dict[str, Any]) -> Read:
    """Any BERT class's keys, with or without the `bert.` prefix, every head read that is
    there; heads, and the pooler (BertForQuestionAnswering has none), may be fresh. A token
    classifier (named so in config.json) is read as that class: its `classifier.*` is per
    token, not the sequence classifier's."""
    named = (hf_config.get("architectures") or [None])[0]
    if named is not None and named == task_architecture(_BERT, "token-classification"):
        weights, missing = from_hf_architecture(state, config, named)
        rules = ARCHITECTURES[named].rules(config)
        return Read(named, weights, missing, rules, optional=set(),
                    ignored=sorted(set(state) - {n for r in rules for n in r.theirs}))
    weights, missing = from_hf(state, config)
    return Read(architecture_for(weights, config), weights, missing,
                pretraining_rules(config) + task_head_rules(),
                optional={r.ours for r in head_rules()} | {"NSP/Pool/W", "NSP/Pool/B"},
                ignored=unused_hf_keys(state, config))


def _modernbert_class(hf_config: dict[str, Any], state: Mapping[str, Array],
                      config: BertConfig) -> str:
    """The ModernBERT class a directory holds: `architectures` in config.json when it names
    one, else what its keys say."""
    family = FAMILIES[config.architecture]
    named = (hf_config.get("architectures") or [None])[0]
    if named in architectures_of(family.name):
        return named
    pretraining = family.hf_pretraining[0]
    if not any(k.startswith(ARCHITECTURES[pretraining].prefix) for k in state):
        return str(family.hf_base)
    if any(k.startswith("classifier.") for k in state):
        return str(task_architecture(family.name, "classification"))
    return pretraining


def _read_modernbert(state: Mapping[str, Array], config: BertConfig,
                     hf_config: dict[str, Any]) -> Read:
    """Exactly the keys of the one class the directory holds (no weight may be fresh)."""
    architecture = _modernbert_class(hf_config, state, config)
    weights, missing = from_hf_architecture(state, config, architecture)
    spec = ARCHITECTURES[architecture]
    rules = spec.rules(config)
    ignored = sorted(set(state) - {n for r in rules for n in r.theirs}
                     - {alias for alias, _ in spec.tied})
    return Read(architecture, weights, missing, rules, ignored=ignored)


@dataclass(frozen=True)
class HFFamily:
    """The code that reads and writes one family's Hugging Face checkpoints."""

    # Its encoder's rules: (config, key prefix, pooler) → rules (`Architecture.rules`).
    encoder: Callable[[BertConfig, str, bool], list[Rule]]
    # config.json → `model` section: (config.json, its path, sequence length or None).
    config_from_hf: Callable[[dict[str, Any], str, int | None], BertConfig]
    # `model` section → config.json: (config, class name, the tokenizer's special ids).
    config_to_hf: Callable[[BertConfig, str, dict[str, int]], dict[str, Any]]
    # A directory's state dict → what import takes from it: (state, config, config.json).
    read: Callable[[Mapping[str, Array], BertConfig, dict[str, Any]], Read]


HF_FAMILIES: dict[str, HFFamily] = {
    _BERT: HFFamily(encoder_rules, bert_config_from_hf,
                    lambda config, architecture, ids: hf_config_from_bert(config, architecture,
                                                                          ids["[PAD]"]),
                    _read_bert),
    hf_modernbert.FAMILY: HFFamily(modernbert_encoder_rules,
                                   hf_modernbert.modernbert_config_from_hf,
                                   hf_modernbert.hf_config_from_modernbert, _read_modernbert),
}


def config_from_hf(hf_config: dict[str, Any], source: str,
                   sequence_length: int | None = None) -> BertConfig:
    """popbert's `model` section from any `config.json` import reads (by its `model_type`)."""
    family = hf_family(hf_config, source)
    return HF_FAMILIES[family.name].config_from_hf(hf_config, source, sequence_length)
