"""ModernBERT's own settings: the `model.modernbert` section (names as `transformers`' config).

Shared shape keys (`hidden_size`, `num_layers`, `num_heads`, `intermediate_size`,
`layer_norm_eps`, `hidden_dropout`, `attention_dropout`, ...) stay in `model`; what only
ModernBERT has lives here so the other families' sections stay as they were.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from popbert.rules import POSITIVE_INT, Invalid, Rule, check_fields, one_of, setting

if TYPE_CHECKING:
    from popbert.builders.bert_config import BertConfig

# How a sentence-level head pools the last hidden state (`classifier_pooling`).
POOLINGS = ("cls", "mean")
POSITIVE_FLOAT = Rule(lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0,
                      "a number > 0")


@dataclass
class ModernBertOptions:
    """Rotary theta per attention kind, the sliding window, which layers are global, and
    which weights carry biases (ModernBERT-base's values by default)."""

    # Rotary base of the full-attention layers and of the sliding-window layers.
    global_rope_theta: float = setting(160000.0, POSITIVE_FLOAT)
    local_rope_theta: float = setting(10000.0, POSITIVE_FLOAT)
    # Tokens a sliding-window layer sees: half on each side (|i - j| <= local_attention // 2).
    local_attention: int = setting(128, POSITIVE_INT)
    # Layer i attends globally when i % global_attn_every_n_layers == 0, else in the window.
    global_attn_every_n_layers: int = setting(3, POSITIVE_INT)
    attention_bias: bool = False  # Wqkv and Wo
    mlp_bias: bool = False  # Wi and Wo of the GeGLU MLP
    norm_bias: bool = False  # every LayerNorm's beta
    classifier_bias: bool = False  # the prediction heads' dense layer
    decoder_bias: bool = True  # the MLM decoder's output bias
    classifier_pooling: str = setting("cls", one_of(POOLINGS))
    # Truncation of the initial weights' normal at this many standard deviations (theirs: 2).
    initializer_cutoff_factor: float = setting(2.0, POSITIVE_FLOAT)


def check_modernbert(config: BertConfig) -> None:
    """ModernBERT is MLM-only, its rotary halves need an even head size, and its settings
    section is checked key by key. It packs MLM-only rows (one document chunk a sequence)."""
    check_fields(config.modernbert, "model.modernbert")
    if config.next_sentence_prediction:
        raise Invalid("model.next_sentence_prediction must be false for model.architecture "
                      "'modernbert' (it pre-trains on MLM only, as ModernBERT)",
                      "model.next_sentence_prediction", "model.architecture")
    head_dim = config.hidden_size // config.num_heads
    if head_dim % 2:
        raise Invalid(f"model.hidden_size / model.num_heads ({head_dim}) must be even for "
                      "rotary position embeddings", "model.hidden_size", "model.num_heads")


__all__ = ["POOLINGS", "ModernBertOptions", "check_modernbert"]
