"""GroupBERT's encoder (Chelombiev et al. 2021, arXiv 2106.05822) emitted through the Builder.

Registered as the `groupbert` family: BERT's embeddings and pooler, and each layer four PreNorm
residual modules, convolution → FFN → attention → FFN, then a final LayerNorm.
The modules, and why a final LayerNorm: docs/design.md, section "popbert.builders.groupbert".
"""

from __future__ import annotations

from dataclasses import dataclass

from popbert.builders import bert_encoder, layers
from popbert.builders.bert_config import BertConfig
from popbert.builders.families import Embedded, Family, Inputs, register_family
from popbert.graph.builder import Builder


def _residual(b: Builder, config: BertConfig, init: layers.WeightInit, x: str,
              module_out: str) -> str:
    """x + dropout(module output): the residual add every PreNorm module ends with."""
    out = layers.dropout(b, module_out, config.hidden_dropout)
    return b.aiOnnx.add([x, out], "Residual")


def _norm(b: Builder, config: BertConfig, init: layers.WeightInit, x: str,
          name: str = "Norm") -> str:
    return layers.layer_norm(b, x, config.hidden_size, config.layer_norm_eps, init, name)


def convolution_module(b: Builder, config: BertConfig, init: layers.WeightInit, x: str,
                       keep: str, conv_keep: str | None = None) -> str:
    """GLU → zero the padding → grouped conv1d → LayerNorm → SiLU → dense (pre-residual)."""
    h = config.hidden_size
    y = layers.glu(b, _norm(b, config, init, x), h, h, init, "GLU")
    # Padding zeroed after the GLU and before the convolution: the kernel spans up to k//2
    # neighbours, and a padded token's activations must not reach a real token.
    y = b.aiOnnx.mul([y, keep], "ZeroPadding")
    # Packed rows (`conv_keep` from `layers.packed_conv_keep`): each token's window reads only
    # its own sequence's tokens, so neighbouring sequences of a pack never mix.
    y = layers.grouped_conv1d(b, y, h, config.groupbert.conv_group_size,
                              config.groupbert.conv_kernel_size, init,
                              "Conv", offsets_keep=conv_keep)
    y = layers.silu(b, _norm(b, config, init, y, "ConvNorm"))
    return layers.dense(b, y, h, h, init, "Out")


def grouped_ffn(b: Builder, config: BertConfig, init: layers.WeightInit, x: str,
                seq_len: int | str | None = None) -> str:
    """Dense H→I, GELU, grouped I→H, dense H→H (pre-residual). `seq_len`: the graph's sequence
    axis (symbolic in dynamic exports), the config's if None."""
    h, inner = config.hidden_size, config.intermediate_size
    y = layers.gelu(b, layers.dense(b, _norm(b, config, init, x), h, inner, init, "1"))
    y = layers.grouped_matmul(b, y, inner, h, config.groupbert.ffn_groups,
                              config.sequence_length if seq_len is None else seq_len, init,
                              "Grouped")
    return layers.dense(b, y, h, h, init, "Out")


def attention_module(b: Builder, config: BertConfig, init: layers.WeightInit, x: str,
                     mask: str, seq_len: int | str | None = None) -> str:
    """PreNorm multi-head attention: LayerNorm, fused QKV, attention, output (pre-residual)."""
    h = config.hidden_size
    qkv = layers.dense(b, _norm(b, config, init, x), h, 3 * h, init, "QKV")
    q, k, v = layers.split(b, qkv, 3, -1, "Split")
    context = layers.multi_head_attention(
        b, q, k, v, mask, h, config.num_heads,
        config.sequence_length if seq_len is None else seq_len, config.attention_dropout)
    return layers.dense(b, context, h, h, init, "Out")


def groupbert_layer(b: Builder, config: BertConfig, init: layers.WeightInit, x: str, mask: str,
                    keep: str, index: int, conv_keep: str | None = None,
                    seq_len: int | str | None = None) -> str:
    """One GroupBERT layer: Conv, FFN1, Attention, FFN2 modules, each PreNorm + residual.

    `mask` is the additive attention mask, `keep` the float [B, S, 1] 1/0 padding mask,
    `conv_keep` (packed rows only) the convolution's per-offset same-sequence mask, `seq_len`
    the graph's sequence axis (symbolic in dynamic exports; the config's if None).
    """
    with b.nameScope(f"Layer{index}"):
        with b.nameScope("Conv"):
            x = _residual(b, config, init, x, convolution_module(b, config, init, x, keep,
                                                                   conv_keep))
        with b.nameScope("FFN1"):
            x = _residual(b, config, init, x, grouped_ffn(b, config, init, x, seq_len))
        with b.nameScope("Attention"):
            x = _residual(b, config, init, x, attention_module(b, config, init, x, mask,
                                                               seq_len))
        with b.nameScope("FFN2"):
            x = _residual(b, config, init, x, grouped_ffn(b, config, init, x, seq_len))
    return x


def final_norm(b: Builder, config: BertConfig, init: layers.WeightInit, x: str) -> str:
    """The LayerNorm after the last PreNorm layer (weights `FinalNorm/Gamma`, `FinalNorm/Beta`)."""
    return _norm(b, config, init, x, "FinalNorm")


@dataclass
class GroupBertContext:
    """What GroupBERT's layers read: the additive attention mask, the float [B, S, 1] padding
    keep, and (packed rows) the convolution's per-offset same-sequence keep."""

    mask: str
    keep: str
    conv_keep: str | None = None


def embed(b: Builder, config: BertConfig, init: layers.WeightInit, inputs: Inputs,
          seq: int | str, dynamic_sequence: bool) -> Embedded:
    """BERT's embeddings and mask, plus the padding keeps the convolution module needs."""
    embedded = bert_encoder.embed(b, config, init, inputs, seq, dynamic_sequence)
    if config.packed:
        keep = layers.padding_keep(b, layers.real_tokens(b, inputs.sequence_index))
        conv_keep = layers.packed_conv_keep(b, inputs.sequence_index,
                                            config.groupbert.conv_kernel_size)
    else:
        keep, conv_keep = layers.padding_keep(b, inputs.input_mask), None
    embedded.context = GroupBertContext(embedded.context.mask, keep, conv_keep)
    return embedded


def layer(b: Builder, config: BertConfig, init: layers.WeightInit, x: str,
          context: GroupBertContext, index: int, seq: int | str) -> str:
    return groupbert_layer(b, config, init, x, context.mask, context.keep, index,
                           context.conv_keep, seq)


# GroupBERT pre-trains without dropout and fine-tunes with it (Graphcore's recipe).
GROUPBERT = register_family(Family(name="groupbert", title="GroupBERT",
                                   hf_model_type=None, segments=True, embed=embed,
                                   layer=layer, pool=bert_encoder.pool, final=final_norm,
                                   finetune_dropout=0.1))
