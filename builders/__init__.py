"""Graph builders: BERT layers and heads written once against the Builder API."""

from popbert.builders.bert_config import BertConfig

__all__ = ["BertConfig"]
