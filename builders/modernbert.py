"""ModernBERT (Warner et al. 2024, arXiv 2412.13663) emitted op by op through the Builder.

Exactly `transformers.ModernBertModel`: token embeddings + LayerNorm (no position table); per
layer a pre-LayerNorm attention block (layer 0's norm is the identity) with fused QKV, rotary
positions (one theta for global layers, another for sliding-window ones) and, on every layer
but each `global_attn_every_n_layers`-th, a window of `local_attention // 2` tokens each side;
then a pre-LayerNorm GeGLU MLP; a final LayerNorm. Biases as `model.modernbert` says (none by
default). Registered as the `modernbert` family; the MLM head and losses are the shared ones.

Everything is composed from ops both dialects have (opset 11 included): the rotary embedding is
Reshape/Slice/Concat/Mul/Add with cos/sin tables as constants, the window a band of
|i - j| > w/2 built from Sub/Abs/Greater and added to the padding mask.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from popbert.builders import layers
from popbert.builders.bert_config import BertConfig
from popbert.builders.families import Embedded, Family, HeadBias, Inputs, register_family
from popbert.graph.builder import Builder

if TYPE_CHECKING:
    from popbert.builders.bert import BertGraph

GLOBAL, LOCAL = "global", "local"


@dataclass
class Rotary:
    """cos and sign-folded sin tables [S, 1, head_dim] for one theta (see `rotate`)."""

    cos: str
    sin: str


@dataclass
class ModernBertContext:
    """What the layers read: the padding mask, the padding + window mask, the rotary tables of
    each attention kind, and the input mask (mean pooling)."""

    global_mask: str
    local_mask: str
    rotary: dict[str, Rotary]
    input_mask: str


def is_global(config: BertConfig, index: int) -> bool:
    """Layer `index` attends to the whole sequence (else within the sliding window)."""
    return index % config.modernbert.global_attn_every_n_layers == 0


def rotary_tables(theta: float, head_dim: int, positions: int) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin [positions, head_dim] of `transformers`' default rope, in FP32 as theirs:
    inv_freq = 1 / theta^(2i/d), angles = position · inv_freq, both halves the same."""
    exponents = np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)
    inv_freq = (np.float32(1.0) / np.power(np.float32(theta), exponents)).astype(np.float32)
    angles = np.arange(positions, dtype=np.float32)[:, None] * inv_freq[None, :]
    angles = np.concatenate([angles, angles], axis=-1)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def _rotary(b: Builder, config: BertConfig, theta: float, seq: int | str, length: str | None,
            positions: str | None, name: str) -> Rotary:
    """The constant tables for positions 0..S-1 as [S, 1, d], broadcasting over the heads; for
    packed rows (`positions` [B, S], restarting per sequence) the rows they pick, [B, S, 1, d].

    The sine is stored sign-folded, [-sin, sin] over the two halves, so that
    rotate_half(x)·sin = concat(x2, x1)·folded exactly (a negation is exact in float)."""
    head_dim = config.hidden_size // config.num_heads
    whole = length is not None or positions is not None
    rows = config.max_position_embeddings if whole else seq
    cos, sin = rotary_tables(theta, head_dim, int(rows))
    half = head_dim // 2
    folded = np.concatenate([-sin[:, :half], sin[:, half:]], axis=-1)
    tables = []
    for table, part in ((cos, "Cos"), (folded, "Sin")):
        tensor = b.addConstant(np.ascontiguousarray(table[:, None, :]), f"{name}/{part}")
        if positions is not None:  # packed rows: each token's own position
            tensor = b.aiOnnx.gather([tensor, positions], f"{name}/{part}/AtPositions", axis=0)
        elif length is not None:  # symbolic sequence: the first S rows
            zero = b.addConstant(np.array([0], np.int64), f"{name}/{part}/first")
            tensor = b.aiOnnx.slice([tensor, zero, length, zero], f"{name}/{part}/Rows")
        tables.append(tensor)
    return Rotary(*tables)


def rotate(b: Builder, config: BertConfig, x: str, rotary: Rotary, seq: int | str,
           name: str) -> str:
    """Rotary position embedding of [B, S, H] queries or keys, per head:
    x·cos + rotate_half(x)·sin with rotate_half(x) = concat(-x2, x1) (`transformers`' form)."""
    h, heads = config.hidden_size, config.num_heads
    d = h // heads
    with b.nameScope(name):
        shaped = b.aiOnnx.reshape(
            [x, b.addConstant(np.array([0, layers.sequence_entry(seq), heads, d], np.int64),
                              "heads_shape")], "Heads")
        axis = b.addConstant(np.array([3], np.int64), "axis")
        first = b.aiOnnx.slice([shaped, b.addConstant(np.array([0], np.int64), "start"),
                                b.addConstant(np.array([d // 2], np.int64), "middle"), axis],
                               "FirstHalf")
        second = b.aiOnnx.slice([shaped, b.addConstant(np.array([d // 2], np.int64), "from"),
                                 b.addConstant(np.array([d], np.int64), "end"), axis],
                                "SecondHalf")
        swapped = b.aiOnnx.concat([second, first], "Swap", axis=3)
        out = b.aiOnnx.add([b.aiOnnx.mul([shaped, rotary.cos], "Cos"),
                            b.aiOnnx.mul([swapped, rotary.sin], "Sin")], "Rotated")
        return b.aiOnnx.reshape(
            [out, b.addConstant(np.array([0, layers.sequence_entry(seq), h], np.int64),
                                "merge_shape")], "Merge")


def window_mask(b: Builder, config: BertConfig, global_mask: str, seq: int | str,
                length: str | None, positions: str | None = None) -> str:
    """The padding mask plus -10000 wherever |i - j| > local_attention // 2: the band
    `transformers`' bidirectional sliding window keeps (inclusive of the half-window).

    Packed rows measure the distance by their `positions` [B, S]: within a sequence it is the
    distance in the row, and across sequences the packed mask already drops the pair."""
    half = config.modernbert.local_attention // 2
    with b.nameScope("WindowMask"):
        if positions is not None:
            index = positions  # [B, S]
            rows = layers.unsqueeze(b, index, [2], "Rows", "row_axis")  # [B, S, 1]
            cols = layers.unsqueeze(b, index, [1], "Cols", "col_axis")  # [B, 1, S]
        else:
            if length is None:
                index = b.addConstant(np.arange(int(seq), dtype=np.int32), "positions")
            else:
                index = b.aiOnnx.slice(
                    [b.addConstant(np.arange(config.max_position_embeddings, dtype=np.int32),
                                   "positions"),
                     b.addConstant(np.array([0], np.int64), "first"), length,
                     b.addConstant(np.array([0], np.int64), "axis")], "Positions")
            rows = layers.unsqueeze(b, index, [1], "Rows", "row_axis")  # [S, 1]
            cols = layers.unsqueeze(b, index, [0], "Cols", "col_axis")  # [1, S]
        distance = b.aiOnnx.abs([b.aiOnnx.sub([rows, cols], "Offset")], "Distance")
        limit = b.addConstant(np.array(half, np.dtype(b.getTensorDtypeString(index))),
                              "half_window")
        outside = b.aiOnnx.greater([distance, limit], "Outside")
        band = b.aiOnnx.mul([b.aiOnnx.cast([outside], "Cast", to=1),
                             layers.scalar(b, layers.MASK_VALUE, np.float32, "big")], "Band")
        if positions is not None:
            band = layers.unsqueeze(b, band, [1], "Heads", "head_axis")  # [B, 1, S, S]
        return b.aiOnnx.add([global_mask, band], "Add")


def embed(b: Builder, config: BertConfig, init: layers.WeightInit, inputs: Inputs,
          seq: int | str, dynamic_sequence: bool) -> Embedded:
    """Token embeddings → LayerNorm → dropout, and the masks and rotary tables of the layers."""
    m = config.modernbert
    h = config.hidden_size
    with b.nameScope("Embedding"):
        table = b.addInitializedInputTensor(
            init.truncated([config.vocab_size, h], config.initializer_range,
                           m.initializer_cutoff_factor), "Embedding_Dict")
        x = b.aiOnnx.gather([table, layers.as_index(b, inputs.input_ids, "WordIndex")],
                            "Words", axis=0)
        x = layers.layer_norm(b, x, h, config.layer_norm_eps, init, bias=m.norm_bias)
        x = layers.dropout(b, x, config.hidden_dropout)
    length = (b.aiOnnx.shape([inputs.input_ids], "Length", start=1, end=2)
              if dynamic_sequence else None)
    positions = None
    if config.packed:
        # Packed rows: attention within each sequence, positions restarting at each one.
        positions = layers.as_index(b, inputs.position_ids, "PositionIndex")
        global_mask = layers.packed_attention_mask(b, inputs.sequence_index, seq)
    else:
        global_mask = layers.attention_mask(b, inputs.input_mask, seq)
    local_mask = window_mask(b, config, global_mask, seq, length, positions)
    rotary = {kind: _rotary(b, config, theta, seq, length, positions, f"Rotary/{kind.title()}")
              for kind, theta in ((GLOBAL, m.global_rope_theta), (LOCAL, m.local_rope_theta))}
    return Embedded(x, table, ModernBertContext(global_mask, local_mask, rotary,
                                                inputs.input_mask))


def _weights(config: BertConfig, init: layers.WeightInit, rows: int, cols: int,
             out: bool) -> np.ndarray:
    """ModernBERT's initialisation: truncated normal, std 0.02 into a block and
    0.02 / sqrt(2 · layers) out of it (the residual branch's last projection)."""
    std = config.initializer_range
    if out:
        std /= math.sqrt(2.0 * config.num_layers)
    return init.truncated([rows, cols], std, config.modernbert.initializer_cutoff_factor)


def layer(b: Builder, config: BertConfig, init: layers.WeightInit, x: str,
          context: ModernBertContext, index: int, seq: int | str,
          first_row_only: bool = False) -> str:
    """x + Attention(norm(x)), then x + GeGLU-MLP(norm(x)); layer 0's attention norm is the
    identity (the embeddings' LayerNorm has just normalised x). `first_row_only`: the output of
    row 0 ([CLS]) alone, [B, 1, H]: keys and values from every row, the rest for that row."""
    m = config.modernbert
    h, inner = config.hidden_size, config.intermediate_size
    kind = GLOBAL if is_global(config, index) else LOCAL
    mask = context.global_mask if kind == GLOBAL else context.local_mask
    with b.nameScope(f"Layer{index}"):
        with b.nameScope("Attention"):
            normed = x if index == 0 else layers.layer_norm(
                b, x, h, config.layer_norm_eps, init, bias=m.norm_bias)
            qkv = layers.dense(b, normed, h, 3 * h, init, "QKV", bias=m.attention_bias,
                               initial=_weights(config, init, h, 3 * h, out=False))
            q, k, v = layers.split(b, qkv, 3, -1, "Split")
            q = rotate(b, config, q, context.rotary[kind], seq, "RotaryQ")
            k = rotate(b, config, k, context.rotary[kind], seq, "RotaryK")
            if first_row_only:
                q, mask, x = layers.first_row_query(b, q, mask, x)
            attended = layers.multi_head_attention(b, q, k, v, mask, h, config.num_heads, seq,
                                                   config.attention_dropout,
                                                   query_len=1 if first_row_only else None)
            out = layers.dense(b, attended, h, h, init, "Out", bias=m.attention_bias,
                               initial=_weights(config, init, h, h, out=True))
            out = layers.dropout(b, out, config.attention_dropout)
            x = b.aiOnnx.add([x, out], "Residual")
        with b.nameScope("MLP"):
            normed = layers.layer_norm(b, x, h, config.layer_norm_eps, init, bias=m.norm_bias)
            both = layers.dense(b, normed, h, 2 * inner, init, "Wi", bias=m.mlp_bias,
                                initial=_weights(config, init, h, 2 * inner, out=False))
            values, gates = layers.split(b, both, 2, -1, "Split")
            y = b.aiOnnx.mul([layers.gelu(b, values), gates], "GeGLU")
            y = layers.dropout(b, y, config.hidden_dropout)
            y = layers.dense(b, y, inner, h, init, "Wo", bias=m.mlp_bias,
                             initial=_weights(config, init, inner, h, out=True))
            x = b.aiOnnx.add([x, y], "Residual")
    return x


def first_row_layer(b: Builder, config: BertConfig, init: layers.WeightInit, x: str,
                    context: ModernBertContext, index: int, seq: int | str) -> str:
    """`layer` for the [CLS] row alone, [B, 1, H] (what `pool` reads with `cls` pooling)."""
    return layer(b, config, init, x, context, index, seq, first_row_only=True)


def final_norm(b: Builder, config: BertConfig, init: layers.WeightInit, x: str) -> str:
    return layers.layer_norm(b, x, config.hidden_size, config.layer_norm_eps, init,
                             "FinalNorm", bias=config.modernbert.norm_bias)


def prediction_head(b: Builder, config: BertConfig, init: layers.WeightInit, x: str,
                    name: str) -> str:
    """`ModernBertPredictionHead`: dense, GELU, LayerNorm (what the classification and span
    heads put before their classifier)."""
    m = config.modernbert
    h = config.hidden_size
    with b.nameScope(name):
        y = layers.gelu(b, layers.dense(b, x, h, h, init, "Dense", bias=m.classifier_bias,
                                        initial=_weights(config, init, h, h, out=True)))
        return layers.layer_norm(b, y, h, config.layer_norm_eps, init, bias=m.norm_bias)


def pool(b: Builder, config: BertConfig, init: layers.WeightInit, graph: BertGraph,
         hidden: str, context: ModernBertContext, task: str) -> str | None:
    """Classification reads the prediction head of the [CLS] state or of the mean over real
    tokens (`classifier_pooling`); no other task has a pooled output."""
    if task != "classification":
        return None
    with b.nameScope("Pooler"):
        if config.modernbert.classifier_pooling == "cls":
            pooled = b.aiOnnx.gather([hidden, b.addConstant(np.array(0, np.int64),
                                                            "cls_index")], "CLS", axis=1)
        else:
            keep = layers.padding_keep(b, context.input_mask)  # [B, S, 1]
            total = b.aiOnnx.reducesum([b.aiOnnx.mul([hidden, keep], "Real"),
                                        b.addConstant(np.array([1], np.int64), "seq_axis")],
                                       "Sum", keepdims=0)
            count = b.aiOnnx.reducesum([keep, b.addConstant(np.array([1], np.int64),
                                                            "count_axis")],
                                       "Count", keepdims=0)  # [B, 1]
            pooled = b.aiOnnx.div([total, count], "Mean")
        return prediction_head(b, config, init, pooled, "Head")


def span_features(b: Builder, config: BertConfig, init: layers.WeightInit, hidden: str) -> str:
    """The per-token prediction head `ModernBertForQuestionAnswering` puts before its logits."""
    features = prediction_head(b, config, init, hidden, "Head")
    return layers.dropout(b, features, config.hidden_dropout, "HeadDropout")


MODERNBERT = register_family(Family(
    name="modernbert", title="ModernBERT", hf_model_type="modernbert", segments=False,
    embed=embed, layer=layer, pool=pool, final=final_norm, first_row_layer=first_row_layer,
    pools_first_row=lambda config: config.modernbert.classifier_pooling == "cls",
    head_bias=lambda config: HeadBias(dense=config.modernbert.classifier_bias,
                                      norm=config.modernbert.norm_bias,
                                      decoder=config.modernbert.decoder_bias),
    span_features=span_features,
    hf_base="ModernBertModel", hf_pretraining=("ModernBertForMaskedLM",),
    hf_config_fields=(("vocab_size", "vocab_size"), ("hidden_size", "hidden_size"),
                      ("num_hidden_layers", "num_layers"),
                      ("num_attention_heads", "num_heads"),
                      ("intermediate_size", "intermediate_size"),
                      ("max_position_embeddings", "max_position_embeddings"),
                      ("norm_eps", "layer_norm_eps"),
                      ("initializer_range", "initializer_range"),
                      ("attention_dropout", "attention_dropout"),
                      *((key, f"modernbert.{key}") for key in (
                          "local_attention", "attention_bias", "mlp_bias", "norm_bias",
                          "classifier_bias", "decoder_bias", "classifier_pooling",
                          "initializer_cutoff_factor"))),
    hf_tokenizers=("tokenizer.json", "vocab.txt")))
