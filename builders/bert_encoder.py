"""BERT's own encoder (Devlin et al. 2018, Google's post-norm layout and names): embeddings with
learned position and segment tables, post-norm layers, the tanh pooler. Registered as the
`bert` family; GroupBERT reuses its embeddings and pooler.

Weights are created under name scopes that map one-to-one to Hugging Face names (see
`popbert.hf.mapping`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from popbert.builders import layers
from popbert.builders.bert_config import BertConfig
from popbert.builders.families import Embedded, Family, Inputs, register_family
from popbert.graph.builder import Builder

if TYPE_CHECKING:
    from popbert.builders.bert import BertGraph


@dataclass
class BertContext:
    """What BERT's layers read: the additive attention mask [B, 1, S, S]."""

    mask: str


def embed(b: Builder, config: BertConfig, init: layers.WeightInit, inputs: Inputs,
          seq: int | str, dynamic_sequence: bool) -> Embedded:
    """The `bert` family's embeddings and attention mask (block-diagonal for packed rows)."""
    if config.packed:
        hidden, word_table = embeddings(b, config, init, inputs.input_ids, inputs.segment_ids,
                                        inputs.position_ids)
        mask = layers.packed_attention_mask(b, inputs.sequence_index, seq)
    else:
        hidden, word_table = embeddings(b, config, init, inputs.input_ids, inputs.segment_ids,
                                        dynamic_sequence=dynamic_sequence)
        mask = layers.attention_mask(b, inputs.input_mask, seq)
    return Embedded(hidden, word_table, BertContext(mask))


def layer(b: Builder, config: BertConfig, init: layers.WeightInit, x: str,
          context: BertContext, index: int, seq: int | str) -> str:
    return encoder_layer(b, config, init, x, context.mask, index, seq)


def first_row_layer(b: Builder, config: BertConfig, init: layers.WeightInit, x: str,
                    context: BertContext, index: int, seq: int | str) -> str:
    """`layer` for the [CLS] row alone, [B, 1, H] (what `pooler` reads of the last layer)."""
    return encoder_layer(b, config, init, x, context.mask, index, seq, first_row_only=True)


def pool(b: Builder, config: BertConfig, init: layers.WeightInit, graph: BertGraph,
         hidden: str, context: object, task: str) -> str | None:
    """The tanh pooler on [CLS] (each packed sequence's [CLS]); none for an MLM-only model's
    pre-training and encoder graphs (no pooler was trained; task heads start their own)."""
    if task in ("pretraining", "encoder") and not config.next_sentence_prediction:
        return None
    if config.packed:
        cls_positions = graph.add_input("cls_positions",
                                        [graph.batch_size, config.max_sequences_per_pack])
        return packed_pooler(b, config, init, hidden, cls_positions)
    return pooler(b, config, init, hidden)


def embeddings(b: Builder, config: BertConfig, init: layers.WeightInit, input_ids: str,
               segment_ids: str, position_ids: str | None = None,
               dynamic_sequence: bool = False) -> tuple[str, str]:
    """Word + position + segment embeddings, LayerNorm, dropout. Returns (hidden, word table).

    Positions are 0..S-1 unless `position_ids` [B, S] come from the data (packed rows); with
    `dynamic_sequence` the first S rows of the position table, S read from `input_ids`.
    """
    h = config.hidden_size
    with b.nameScope("Embedding"):
        word_table = b.addInitializedInputTensor(init.normal([config.vocab_size, h]),
                                                 "Embedding_Dict")
        position_table = b.addInitializedInputTensor(
            init.normal([config.max_position_embeddings, h]), "Positional_Dict")
        segment_table = b.addInitializedInputTensor(init.normal([config.type_vocab_size, h]),
                                                    "Segment_Dict")
        words = b.aiOnnx.gather([word_table, layers.as_index(b, input_ids, "WordIndex")],
                                "Words", axis=0)
        if position_ids is None and dynamic_sequence:
            length = b.aiOnnx.shape([input_ids], "Length", start=1, end=2)
            zero = b.addConstant(np.array([0], np.int64), "first_position")
            positions = b.aiOnnx.slice([position_table, zero, length, zero], "Positions")
        else:
            if position_ids is None:
                position_ids = b.addConstant(np.arange(config.sequence_length, dtype=np.int64),
                                             "position_ids")
            positions = b.aiOnnx.gather(
                [position_table, layers.as_index(b, position_ids, "PositionIndex")],
                "Positions", axis=0)
        segments = b.aiOnnx.gather(
            [segment_table, layers.as_index(b, segment_ids, "SegmentIndex")], "Segments", axis=0)
        x = b.aiOnnx.add([b.aiOnnx.add([words, positions], "AddPositions"), segments],
                         "AddSegments")
        x = layers.layer_norm(b, x, h, config.layer_norm_eps, init)
        x = layers.dropout(b, x, config.hidden_dropout)
    return x, word_table


def encoder_layer(b: Builder, config: BertConfig, init: layers.WeightInit, x: str, mask: str,
                  index: int, seq_len: int | str | None = None,
                  first_row_only: bool = False) -> str:
    """Post-norm transformer layer: attention → add & norm → FFN → add & norm.

    `seq_len`: the graph's sequence axis (symbolic in dynamic exports); the config's if None.
    `first_row_only`: the output of row 0 ([CLS]) alone, [B, 1, H]: keys and values from every
    row, the query, the output projection, the norms and the FFN for that row."""
    h, heads = config.hidden_size, config.num_heads
    with b.nameScope(f"Layer{index}"):
        with b.nameScope("Attention"):
            qkv = layers.dense(b, x, h, 3 * h, init, "QKV")
            q, k, v = layers.split(b, qkv, 3, -1, "Split")
            if first_row_only:
                q, mask, x = layers.first_row_query(b, q, mask, x)
            context = layers.multi_head_attention(
                b, q, k, v, mask, h, heads,
                config.sequence_length if seq_len is None else seq_len,
                config.attention_dropout, query_len=1 if first_row_only else None)
            out = layers.dense(b, context, h, h, init, "Out")
            out = layers.dropout(b, out, config.hidden_dropout)
            x = layers.layer_norm(b, b.aiOnnx.add([x, out], "Residual"), h,
                                  config.layer_norm_eps, init)
        with b.nameScope("FF"):
            inner = layers.gelu(b, layers.dense(b, x, h, config.intermediate_size, init, "1"))
            out = layers.dense(b, inner, config.intermediate_size, h, init, "2")
            out = layers.dropout(b, out, config.hidden_dropout)
            x = layers.layer_norm(b, b.aiOnnx.add([x, out], "Residual"), h,
                                  config.layer_norm_eps, init)
    return x


def pooler(b: Builder, config: BertConfig, init: layers.WeightInit, hidden: str) -> str:
    """tanh(W · h[CLS] + B): the pooled output NSP and classification heads use."""
    with b.nameScope("NSP"):
        cls = b.aiOnnx.gather([hidden, b.addConstant(np.array(0, np.int64), "cls_index")],
                              "CLS", axis=1)
        return b.aiOnnx.tanh([layers.dense(b, cls, config.hidden_size, config.hidden_size,
                                           init, "Pool")], "Pooled")


def packed_pooler(b: Builder, config: BertConfig, init: layers.WeightInit, hidden: str,
                  cls_positions: str) -> str:
    """tanh(W · h[CLS] + B) at each packed sequence's [CLS]: [B, K, H], same weights as `pooler`."""
    with b.nameScope("NSP"):
        cls = layers.gather_positions(b, hidden, cls_positions, "CLS",
                                      index_name="CLSIndex")  # [B, K, H]
        return b.aiOnnx.tanh([layers.dense(b, cls, config.hidden_size, config.hidden_size,
                                           init, "Pool")], "Pooled")




BERT = register_family(Family(
    name="bert", title="BERT", hf_model_type="bert", segments=True,
    embed=embed, layer=layer, pool=pool,
    first_row_layer=first_row_layer, pools_first_row=lambda config: True,
    hf_base="BertModel", hf_pretraining=("BertForPreTraining", "BertForMaskedLM"),
    hf_config_fields=(("vocab_size", "vocab_size"), ("hidden_size", "hidden_size"),
                      ("num_hidden_layers", "num_layers"),
                      ("num_attention_heads", "num_heads"),
                      ("intermediate_size", "intermediate_size"),
                      ("max_position_embeddings", "max_position_embeddings"),
                      ("type_vocab_size", "type_vocab_size"),
                      ("hidden_dropout_prob", "hidden_dropout"),
                      ("attention_probs_dropout_prob", "attention_dropout"),
                      ("layer_norm_eps", "layer_norm_eps"),
                      ("initializer_range", "initializer_range")),
    hf_tokenizers=("vocab.txt", "tokenizer.json")))
