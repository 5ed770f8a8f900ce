"""Small ModernBERT configs as popbert and `transformers` spell them, and padded batches.

The two configs are written side by side by hand (not through popbert's converter) so that a
parity test compares popbert against `transformers` and not against popbert's own mapping of
the config. Rows are longer than the window (window 8 = 4 tokens each side, rows up to 32) so
the sliding-window layers differ from the global ones.
"""

from __future__ import annotations

import numpy as np
import torch

from popbert.builders.bert_config import BertConfig, TaskConfig
from popbert.builders.modernbert_config import ModernBertOptions
from popbert.hf import mapping as hf

VOCAB = 300
SEQ = 32
WINDOW = 8


def popbert_config(biases: bool = False, **overrides) -> BertConfig:
    """4 layers (0 and 3 global, 1 and 2 sliding-window), hidden 64, 4 heads, GeGLU 96."""
    options = dict(local_attention=WINDOW, global_attn_every_n_layers=3,
                   global_rope_theta=160000.0, local_rope_theta=10000.0)
    if biases:
        options.update(attention_bias=True, mlp_bias=True, norm_bias=True, classifier_bias=True)
    options.update(overrides.pop("modernbert", {}))
    values = dict(architecture="modernbert", next_sentence_prediction=False, vocab_size=VOCAB,
                  hidden_size=64, num_layers=4, num_heads=4, intermediate_size=96,
                  max_position_embeddings=64, sequence_length=SEQ, max_predictions_per_seq=6,
                  hidden_dropout=0.0, attention_dropout=0.0, layer_norm_eps=1e-5,
                  modernbert=ModernBertOptions(**options))
    values.update(overrides)
    return BertConfig(**values)


def hf_config(biases: bool = False, **overrides):
    """The same model as `transformers.ModernBertConfig` (eager attention: exact softmax)."""
    import transformers

    values = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                  num_attention_heads=4, max_position_embeddings=64, local_attention=WINDOW,
                  global_attn_every_n_layers=3, global_rope_theta=160000.0,
                  local_rope_theta=10000.0, norm_eps=1e-5, pad_token_id=0, bos_token_id=1,
                  eos_token_id=2, cls_token_id=1, sep_token_id=2, attn_implementation="eager")
    if biases:
        values.update(attention_bias=True, mlp_bias=True, norm_bias=True, classifier_bias=True)
    values.update(overrides)
    return transformers.ModernBertConfig(**values)


def hf_model(cls_name: str, biases: bool = False, seed: int = 0, **overrides):
    """A `transformers` ModernBERT class with random weights, norms and biases perturbed too
    (their initial ones and zeros would hide a swapped or missing norm or bias), and queries
    and keys scaled up so attention is peaked: at the initial std of 0.02 every token attends
    almost uniformly and the rotary positions would barely change the output."""
    import transformers

    torch.manual_seed(seed)
    model = getattr(transformers, cls_name)(hf_config(biases, **overrides)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                param.add_(torch.randn_like(param) * 0.1)
            if name.endswith("attn.Wqkv.weight"):
                param[: 2 * param.shape[1]] *= 10.0
    return model


def popbert_weights(model, config: BertConfig, architecture: str) -> dict[str, torch.Tensor]:
    """The HF model's weights under popbert's names (every rule's tensors present)."""
    state = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    weights, missing = hf.from_hf_architecture(state, config, architecture)
    assert not missing, missing
    return {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in weights.items()}


def padded_rows(batch: int = 3, seq: int = SEQ, seed: int = 0) -> dict[str, np.ndarray]:
    """Rows of unequal real length (the first full), ids >= 5, MLM slots among real tokens."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(5, VOCAB, (batch, seq))
    mask = np.zeros((batch, seq), np.int64)
    positions = np.zeros((batch, 6), np.int64)
    labels = np.zeros((batch, 6), np.int64)
    for row in range(batch):
        length = seq if row == 0 else int(rng.integers(seq // 3, seq))
        mask[row, :length] = 1
        positions[row] = np.sort(rng.choice(np.arange(1, length), 6, replace=False))
        labels[row] = rng.integers(5, VOCAB, 6)
    return {"input_ids": ids * mask, "input_mask": mask, "masked_lm_positions": positions,
            "masked_lm_ids": labels}


def task_config(name: str, **task) -> TaskConfig:
    return TaskConfig(name=name, **task)
