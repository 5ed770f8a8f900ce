"""Graph builders: the model families (BERT, GroupBERT, ModernBERT) and heads written once against
the Builder API.

Importing the package imports every family module, so each has registered itself in
`popbert.builders.families.FAMILIES` before any graph is built.
"""

from popbert.builders import bert_encoder, groupbert, modernbert  # noqa: F401  (registration)
from popbert.builders.bert_config import BertConfig

__all__ = ["BertConfig"]
