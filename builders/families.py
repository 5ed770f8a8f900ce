"""The model families the builder emits (`model.architecture`): one table, one entry each.

A family owns what differs between encoders: the graph inputs it reads besides `input_ids`, its
embeddings and the per-layer context they hand on (attention masks, rotary tables), one encoder
layer, the norm after the last layer, how a pooled output for sentence-level heads is made, the
bias switches of the shared heads and its Hugging Face facts (`model_type`, classes,
`config.json` fields, tokenizer files: plain names, so the builder imports nothing of
`popbert.io`). Its config options and their checks sit with the config
(`bert_config.FAMILY_CHECKS`), which builds nothing.
Everything else — placement and pipeline stages, recomputation checkpoints, the task heads and
their losses — is shared and lives in `popbert.builders.bert.build_bert`. Adding a family is one
module and one entry here (the code of its Hugging Face mapping, weight rules and config
checks, is one entry of `popbert.hf.mapping.HF_FAMILIES`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from popbert.builders.bert_config import ARCHITECTURES, BertConfig
from popbert.builders.layers import WeightInit
from popbert.graph.builder import Builder

if TYPE_CHECKING:
    from popbert.builders.bert import BertGraph


@dataclass
class Inputs:
    """The graph inputs an encoder reads (None where the family or layout has none)."""

    input_ids: str
    segment_ids: str | None = None
    input_mask: str | None = None  # unpacked rows: 1 real token, 0 padding
    position_ids: str | None = None  # packed rows: positions restarting per sequence
    sequence_index: str | None = None  # packed rows: 0 padding, 1..k the packed sequence


@dataclass
class Embedded:
    """The embeddings' output, the word table the MLM head ties to, and what the layers read."""

    hidden: str
    word_table: str
    context: Any


@dataclass(frozen=True)
class HeadBias:
    """Which of the shared heads' weights carry a bias (BERT: all; ModernBERT: as configured)."""

    dense: bool = True  # the MLM transform's (and a pooled head's) dense layer
    norm: bool = True  # their LayerNorm's beta
    decoder: bool = True  # the MLM decoder's output bias


Embed = Callable[[Builder, BertConfig, WeightInit, Inputs, "int | str", bool], Embedded]
Layer = Callable[[Builder, BertConfig, WeightInit, str, Any, int, "int | str"], str]
Final = Callable[[Builder, BertConfig, WeightInit, str], str]
Pool = Callable[[Builder, BertConfig, WeightInit, "BertGraph", str, Any, str], "str | None"]
Features = Callable[[Builder, BertConfig, WeightInit, str], str]


@dataclass(frozen=True)
class Family:
    """One encoder family: the functions `build_bert` calls, in the order it calls them."""

    name: str
    title: str  # how reports name it ("ModernBERT")
    # `config.json`'s `model_type` of its Hugging Face checkpoints (None: transformers has none)
    hf_model_type: str | None
    segments: bool  # reads `segment_ids` (BERT's sentence A/B embedding)
    embed: Embed  # inputs → Embedded (run in the embeddings' placement)
    layer: Layer  # one encoder layer (run in that layer's placement)
    pool: Pool  # the pooled [B, H] (or packed [B, K, H]) output sentence heads read, or None
    final: Final | None = None  # after the last layer (pre-norm families' final LayerNorm)
    # `layer` computed for the first row alone ([B, 1, H]; keys and values still from every
    # row), and whether `pool` reads nothing but that row under `config`: together they let a
    # head of the pooled output skip the rest of the last layer (None: always every row)
    first_row_layer: Layer | None = None
    pools_first_row: Callable[[BertConfig], bool] = lambda config: False
    head_bias: Callable[[BertConfig], HeadBias] = lambda config: HeadBias()
    span_features: Features | None = None  # per-token transform before the SQuAD logits
    # Dropout fine-tuning uses when the user names none (None: the checkpoint's own); a family
    # that pre-trains without dropout may still fine-tune with it.
    finetune_dropout: float | None = None
    # Its Hugging Face checkpoints, as plain names (`popbert.hf.mapping` holds the code that
    # reads and writes them): the bare encoder's `transformers` class; its pre-training classes,
    # most specific heads first (each task's class is the task's, `popbert.tasks.Task`); the
    # `config.json` keys it reads and writes, each with the `model` field it holds (dotted into
    # the family's options); its tokenizer files, the one its checkpoints ship first.
    hf_base: str | None = None
    hf_pretraining: tuple[str, ...] = ()
    hf_config_fields: tuple[tuple[str, str], ...] = ()
    hf_tokenizers: tuple[str, ...] = ()


FAMILIES: dict[str, Family] = {}


def register_family(family: Family) -> Family:
    """Add `family` to the table (each family module registers itself on import)."""
    if family.name not in ARCHITECTURES:
        raise ValueError(f"family {family.name!r} is not in model.architecture's choices "
                         f"{ARCHITECTURES}")
    FAMILIES[family.name] = family
    return family


def family_of(config: BertConfig) -> Family:
    """The family `config.architecture` names (`popbert.builders` imports every family
    module, so each has registered before anything reaches this one)."""
    return FAMILIES[config.architecture]


__all__ = ["FAMILIES", "Embedded", "Family", "HeadBias", "Inputs", "family_of",
           "register_family"]
