"""A `transformers` `config.json` ↔ popbert's `model` section, field by field.

Every family's fields go through one reader and one writer (`read_fields`, `write_fields`), of
the family's own table, `Family.hf_config_fields`; this module also holds ModernBERT's checks
(BERT's are in `popbert.hf.mapping`, which puts each family's into `HF_FAMILIES`).

For ModernBERT, both spellings `transformers` has used are read: `layer_types` +
`rope_parameters` (5.x) and `global_attn_every_n_layers` + `global_rope_theta` /
`local_rope_theta` (the Hub's original ModernBERT files); both are written, so older and newer
`transformers` load an export. Options popbert does not build (another activation, a rope
scaling type, untied decoder weights, a layer pattern that is not "every n-th global") are
refused in one line naming the field.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from popbert.builders.bert_config import BertConfig
from popbert.builders.families import FAMILIES
from popbert.builders.modernbert_config import POOLINGS
from popbert.errors import UsageError

# The family whose config.json this module's checks read and write.
FAMILY = "modernbert"
# The dropouts popbert's one `hidden_dropout` stands for; they must agree.
HIDDEN_DROPOUTS = ("embedding_dropout", "mlp_dropout", "classifier_dropout")
DEFAULT_THETA = {"full_attention": 160000.0, "sliding_attention": 10000.0}


def typed(value: Any, expected: type, source: str, key: str) -> Any:
    """`value` of config.json's `key` if it is an `expected` (an int stands for a float)."""
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, expected) or (expected is not bool and isinstance(value, bool)):
        raise UsageError(f"{source}: {key}: expected {expected.__name__}, got {value!r}")
    return value


def _field(config: BertConfig, name: str) -> Any:
    for part in name.split("."):
        config = getattr(config, part)
    return config


def read_fields(hf_config: dict[str, Any], fields: tuple[tuple[str, str], ...],
                source: str) -> dict[str, Any]:
    """config.json's `fields` (a family's `hf_config_fields`) → {`model` field: value}, each
    of its default's type (the default where config.json has no such key)."""
    defaults = BertConfig()
    values = {}
    for theirs, ours in fields:
        default = _field(defaults, ours)
        values[ours] = typed(hf_config.get(theirs, default), type(default), source, theirs)
    return values


def model_config(values: dict[str, Any], **fixed: Any) -> BertConfig:
    """The `BertConfig` of `values` (`read_fields`'s; a dotted name sets a field of that
    option group) and `fixed`."""
    top: dict[str, Any] = dict(fixed)
    groups: dict[str, dict[str, Any]] = {}
    for name, value in values.items():
        group, _, field = name.rpartition(".")
        if group:
            groups.setdefault(group, {})[field] = value
        else:
            top[name] = value
    defaults = BertConfig()
    for group, chosen in groups.items():
        top[group] = dataclasses.replace(getattr(defaults, group), **chosen)
    return BertConfig(**top)


def write_fields(config: BertConfig, fields: tuple[tuple[str, str], ...]) -> dict[str, Any]:
    """`config`'s values of `fields` under their config.json keys."""
    return {theirs: _field(config, ours) for theirs, ours in fields}


def _every_n(hf_config: dict[str, Any], layers: int, source: str) -> int:
    """`global_attn_every_n_layers`, read directly or recovered from `layer_types`."""
    kinds = hf_config.get("layer_types")
    if kinds is None:
        return typed(hf_config.get("global_attn_every_n_layers", 3), int, source,
                      "global_attn_every_n_layers")
    if not isinstance(kinds, list) or len(kinds) != layers:
        raise UsageError(f"{source}: layer_types: expected a list of {layers} entries")
    globals_ = [i for i, kind in enumerate(kinds) if kind == "full_attention"]
    n = globals_[1] if len(globals_) > 1 else layers
    expected = ["full_attention" if i % n == 0 else "sliding_attention" for i in range(layers)]
    if not globals_ or kinds != expected:
        raise UsageError(f"{source}: layer_types: popbert builds every n-th layer global from "
                         f"layer 0 (full_attention, then sliding_attention), got {kinds}")
    return n


def _thetas(hf_config: dict[str, Any], source: str) -> tuple[float, float]:
    """(global, local) rotary theta from `rope_parameters` or the older `*_rope_theta` keys."""
    if hf_config.get("rope_scaling"):
        raise UsageError(f"{source}: rope_scaling: popbert builds the default rotary embedding "
                         f"only, got {hf_config['rope_scaling']!r}")
    params = hf_config.get("rope_parameters") or {}
    thetas = {}
    for kind, old_key in (("full_attention", "global_rope_theta"),
                          ("sliding_attention", "local_rope_theta")):
        entry = params.get(kind) or {}
        rope_type = entry.get("rope_type", "default")
        if rope_type != "default":
            raise UsageError(f"{source}: rope_parameters.{kind}.rope_type: popbert builds the "
                             f"default rotary embedding only, got {rope_type!r}")
        value = entry.get("rope_theta", hf_config.get(old_key, DEFAULT_THETA[kind]))
        thetas[kind] = typed(value, float, source, f"rope_parameters.{kind}.rope_theta")
    return thetas["full_attention"], thetas["sliding_attention"]


def modernbert_config_from_hf(hf_config: dict[str, Any], source: str,
                              sequence_length: int | None = None) -> BertConfig:
    """popbert's `model` section from a `transformers` ModernBERT `config.json`.

    `sequence_length` defaults to min(1024, max_position_embeddings), ModernBERT's phase-1
    length; fine-tuning and export set their own.
    """
    for key in ("hidden_activation", "classifier_activation"):
        if hf_config.get(key, "gelu") != "gelu":
            raise UsageError(f"{source}: {key} is {hf_config[key]!r}; popbert's ModernBERT "
                             "uses the exact (erf) GELU, 'gelu'")
    if hf_config.get("tie_word_embeddings", True) is not True:
        raise UsageError(f"{source}: tie_word_embeddings is false; popbert ties the MLM "
                         "decoder to the token embeddings, as ModernBERT does")
    pooling = hf_config.get("classifier_pooling", "cls")
    if pooling not in POOLINGS:
        raise UsageError(f"{source}: classifier_pooling is {pooling!r}; expected one of "
                         f"{', '.join(POOLINGS)}")
    values = read_fields(hf_config, FAMILIES[FAMILY].hf_config_fields, source)
    if "norm_eps" not in hf_config:
        values["layer_norm_eps"] = 1e-5
    dropouts = {k: float(hf_config.get(k, 0.0)) for k in HIDDEN_DROPOUTS}
    if len(set(dropouts.values())) > 1:
        raise UsageError(f"{source}: embedding_dropout, mlp_dropout and classifier_dropout "
                         f"differ ({dropouts}); popbert's ModernBERT has one hidden dropout")
    values["hidden_dropout"] = dropouts["mlp_dropout"]
    values["modernbert.global_attn_every_n_layers"] = _every_n(hf_config, values["num_layers"],
                                                               source)
    (values["modernbert.global_rope_theta"],
     values["modernbert.local_rope_theta"]) = _thetas(hf_config, source)
    values["sequence_length"] = sequence_length or min(1024, values["max_position_embeddings"])
    values["max_predictions_per_seq"] = min(int(0.3 * values["sequence_length"]) or 1,
                                            values["sequence_length"])
    config = model_config(values, architecture=FAMILY, next_sentence_prediction=False)
    try:
        config.validate()
    except ValueError as error:
        raise UsageError(f"{source}: {error}") from None
    return config


def hf_config_from_modernbert(config: BertConfig, architecture: str,
                              special_ids: dict[str, int]) -> dict[str, Any]:
    """The `config.json` that `transformers.ModernBertConfig` reads back into `config`, with
    the tokenizer's special ids (`[PAD]`, `[CLS]`, `[SEP]`)."""
    m = config.modernbert
    layer_types = ["full_attention" if i % m.global_attn_every_n_layers == 0
                   else "sliding_attention" for i in range(config.num_layers)]
    out: dict[str, Any] = {
        "architectures": [architecture], "model_type": FAMILIES[FAMILY].hf_model_type,
        "torch_dtype": "float32",
        "hidden_activation": "gelu", "classifier_activation": "gelu",
        "tie_word_embeddings": True, "layer_types": layer_types,
        "global_attn_every_n_layers": m.global_attn_every_n_layers,
        "global_rope_theta": m.global_rope_theta, "local_rope_theta": m.local_rope_theta,
        "rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": m.global_rope_theta},
            "sliding_attention": {"rope_type": "default", "rope_theta": m.local_rope_theta}},
        "pad_token_id": special_ids["[PAD]"], "cls_token_id": special_ids["[CLS]"],
        "bos_token_id": special_ids["[CLS]"], "sep_token_id": special_ids["[SEP]"],
        "eos_token_id": special_ids["[SEP]"],
    }
    out.update(write_fields(config, FAMILIES[FAMILY].hf_config_fields))
    for key in HIDDEN_DROPOUTS:
        out[key] = config.hidden_dropout
    return out


__all__ = ["hf_config_from_modernbert", "model_config", "modernbert_config_from_hf",
           "read_fields", "typed", "write_fields"]
