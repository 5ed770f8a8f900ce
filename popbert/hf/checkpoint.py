"""Hugging Face model directories ↔ popbert checkpoints (`popbert import-hf` / `export-hf`).

A Hugging Face BERT or ModernBERT directory is `config.json` (its `model_type` picks the family)
+ `model.safetensors` (or `pytorch_model.bin`, or a sharded index of either) + its tokenizer:
`vocab.txt` (WordPiece) or `tokenizer.json` (any model; ModernBERT ships a BPE one). Import
builds the matching popbert run config (`model.*` from `config.json`, `data.vocab_file` = the
copied tokenizer file) and a checkpoint that has every weight of the pre-training graph: those
the directory holds, converted exactly by `popbert.hf.mapping`, and the rest (e.g. the
MLM/NSP heads a `BertModel` lacks) initialised fresh and reported. Export writes the reverse, as
the `transformers` class that holds exactly the checkpoint's heads, so `from_pretrained`
reports no missing or unexpected keys.

A sentence-transformers folder imports too: a SentenceTransformer's pooling, normalisation and
prompts, or a CrossEncoder's activation (`model.task.activation`), which serving applies to the
score and `export-hf` writes back into config.json.

Layout of an imported directory (a run directory, so every `--checkpoint` option accepts it):
`config.yaml`, `vocab.txt` or `tokenizer.json`, `import.json` (what was read, initialised
fresh, ignored) and `checkpoints/step-000000/`.
"""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from popbert.atomic import atomic_directory
from popbert.builders.bert_config import BertConfig, TaskConfig
from popbert.builders.families import FAMILIES
from popbert.errors import CheckpointError, UsageError, one_line
from popbert.hf import mapping as hf
from popbert.hf.mapping import bert_config_from_hf, config_from_hf, hf_config_from_bert
from popbert.io.run_dir import step_dir
from popbert.textfile import read_json

log = logging.getLogger(__name__)

SAFETENSORS = "model.safetensors"
PYTORCH_BIN = "pytorch_model.bin"
IMPORT_REPORT = "import.json"
VOCAB = "vocab.txt"
TOKENIZER_JSON = "tokenizer.json"
MODEL_TYPES = hf.MODEL_TYPES


@dataclass
class ImportReport:
    """What `import_hf` wrote and where each weight came from."""

    output_dir: Path
    checkpoint: Path
    architecture: str
    loaded: list[str] = field(default_factory=list)
    fresh: list[str] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)


# ----------------------------------------------------------------------------------------------
# Reading a Hugging Face directory


def _read_json(path: Path, what: str) -> dict[str, Any]:
    value = read_json(path, what, error=UsageError)
    if not isinstance(value, dict):
        raise UsageError(f"{path}: expected a JSON object")
    return value


def _to_numpy(tensors: dict[str, Any]) -> dict[str, np.ndarray]:
    """torch tensors → numpy; half-precision floats widened to FP32 (exactly)."""
    import torch

    out = {}
    for name, value in tensors.items():
        if value.is_floating_point() and value.dtype != torch.float32:
            value = value.float()
        out[name] = value.numpy()
    return out


def _load_file(path: Path) -> dict[str, np.ndarray]:
    try:
        if path.suffix == ".safetensors":
            import safetensors.torch

            return _to_numpy(safetensors.torch.load_file(str(path)))
        import torch

        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # a corrupt file: name it, no traceback
        raise UsageError(f"{path}: unreadable weights ({type(error).__name__}: "
                         f"{one_line(error, 200)})") from None
    if not isinstance(state, dict):
        raise UsageError(f"{path}: expected a state dict, got {type(state).__name__}")
    return _to_numpy({k: v for k, v in state.items() if hasattr(v, "is_floating_point")})


def _finite(state: dict[str, np.ndarray], path: Path) -> dict[str, np.ndarray]:
    """`state`, refused in one line naming its NaN/Inf tensors (`checkpoint.check_finite`)."""
    from popbert.io.checkpoint import check_finite

    check_finite(state, path, UsageError)
    return state


def load_hf_state(model_dir: Path) -> tuple[dict[str, np.ndarray], Path]:
    """All tensors of a Hugging Face directory (safetensors preferred; sharded indexes too)."""
    model_dir = Path(model_dir)
    for name in (SAFETENSORS, PYTORCH_BIN):
        single = model_dir / name
        if single.is_file():
            return _finite(_load_file(single), single), single
        index = model_dir / f"{name}.index.json"
        if index.is_file():
            weight_map = _read_json(index, "the weights' shard index (JSON)").get("weight_map")
            if not isinstance(weight_map, dict):
                raise UsageError(f"{index}: no weight_map")
            state: dict[str, np.ndarray] = {}
            for shard in sorted(set(weight_map.values())):
                state.update(_finite(_load_file(model_dir / str(shard)), model_dir / str(shard)))
            return state, index
    raise UsageError(f"{model_dir}: no {SAFETENSORS} or {PYTORCH_BIN} (nor a sharded index of "
                     "either) in this directory")


def read_lowercase(model_dir: Path) -> bool:
    """Whether the checkpoint's tokenizer lowercases (tokenizer_config.json; default True)."""
    path = Path(model_dir) / "tokenizer_config.json"
    if not path.is_file():
        log.info("%s: no tokenizer_config.json; assuming an uncased (lowercasing) vocabulary",
                 model_dir)
        return True
    value = _read_json(path, "a tokenizer_config.json").get("do_lower_case", True)
    return bool(value) if value is not None else True


ST_CONFIG = "config_sentence_transformers.json"
# A CrossEncoder's activation as sentence-transformers records it (the dotted path of a torch
# module; the short torch.nn names load the same) → popbert's `model.task.activation`.
ST_ACTIVATIONS = {"torch.nn.modules.activation.Sigmoid": "sigmoid",
                  "torch.nn.Sigmoid": "sigmoid",
                  "torch.nn.modules.linear.Identity": "identity",
                  "torch.nn.Identity": "identity"}
# popbert's `model.task.activation` → what export-hf records (sentence-transformers' own path).
HF_ACTIVATIONS = {"sigmoid": "torch.nn.modules.activation.Sigmoid",
                  "identity": "torch.nn.modules.linear.Identity"}
# sentence-transformers' Pooling config keys → popbert's `model.task.pooling`.
ST_POOLINGS = {"pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls",
               "pooling_mode_max_tokens": "max",
               "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len"}


@dataclass(frozen=True)
class SentenceTransformer:
    """What a sentence-transformers folder adds to its transformer: the pooling, whether the
    vectors are normalised, the longest input and the prompts."""

    model_dir: Path  # where the transformer's config.json and weights are
    pooling: str
    normalize: bool
    max_seq_length: int | None
    prompts: dict[str, str]


def read_sentence_transformer(folder: Path) -> SentenceTransformer | None:
    """A sentence-transformers folder's modules (`modules.json`: a Transformer, then Pooling,
    then optionally Normalize), or None when `folder` is a plain Hugging Face directory. A
    module or pooling mode popbert has no node for is one line naming it."""
    modules_file = folder / "modules.json"
    if not modules_file.is_file():
        return None
    modules = read_json(modules_file, "sentence-transformers' modules.json", error=UsageError)
    if not isinstance(modules, list) or not modules or not all(isinstance(m, dict)
                                                               for m in modules):
        raise UsageError(f"{modules_file}: expected a list of modules")
    kinds = [str(m.get("type", "")).rsplit(".", 1)[-1] for m in modules]
    paths = [str(m.get("path", "")) for m in modules]
    if kinds[:2] != ["Transformer", "Pooling"] or any(k != "Normalize" for k in kinds[2:]):
        raise UsageError(f"{modules_file}: modules {', '.join(kinds)}; popbert reads a "
                         "Transformer, then Pooling, then optionally Normalize")
    pooling_file = folder / paths[1] / "config.json"
    config = _read_json(pooling_file, "sentence-transformers' Pooling config.json")
    if isinstance(config.get("pooling_mode"), str):  # sentence-transformers 5 and later
        named = [f"pooling_mode_{config['pooling_mode'].removesuffix('_tokens')}_tokens"
                 if config["pooling_mode"] != "cls" else "pooling_mode_cls_token"]
    else:
        named = sorted(k for k, v in config.items() if k.startswith("pooling_mode") and v)
    chosen = [ST_POOLINGS[k] for k in named if k in ST_POOLINGS]
    if len(named) != 1 or not chosen:
        raise UsageError(f"{pooling_file}: pooling {', '.join(named) or 'none'}; popbert pools "
                         f"with one of {', '.join(ST_POOLINGS)}")
    if config.get("include_prompt") is False:
        raise UsageError(f"{pooling_file}: include_prompt false (the prompt's tokens left out "
                         "of the pooling); popbert pools over every token")
    extra = folder / ST_CONFIG
    prompts = (_read_json(extra, ST_CONFIG).get("prompts") or {} if extra.is_file() else {})
    return SentenceTransformer(folder / paths[0], chosen[0], len(kinds) > 2,
                               _max_length(folder, folder / paths[0]),
                               {str(k): str(v) for k, v in prompts.items()})


def _max_length(folder: Path, transformer_dir: Path) -> int | None:
    """A sentence-transformers folder's longest input: sentence_bert_config.json's
    max_seq_length, else (sentence-transformers 5 and later) its tokenizer's model_max_length."""
    settings = folder / "sentence_bert_config.json"
    length = (_read_json(settings, "sentence_bert_config.json").get("max_seq_length")
              if settings.is_file() else None)
    tokenizer_config = transformer_dir / "tokenizer_config.json"
    if length is None and tokenizer_config.is_file():  # sentence-transformers 5 keeps it here
        length = _read_json(tokenizer_config, "tokenizer_config.json").get("model_max_length")
        length = length if isinstance(length, int) and length < 1_000_000 else None
    return int(length) if length else None


@dataclass(frozen=True)
class CrossEncoder:
    """What makes a Hugging Face `*ForSequenceClassification` directory a sentence-transformers
    CrossEncoder: the activation its `predict` puts the logits through (the dotted torch path
    as recorded, and the file recording it; None: its default) and its longest input."""

    model_dir: Path  # where the transformer's config.json and weights are
    activation: tuple[Path, str | None] | None
    max_seq_length: int | None


def read_cross_encoder(folder: Path) -> CrossEncoder | None:
    """A CrossEncoder folder: sentence-transformers 5 and later write `modules.json` (one
    Transformer) and `config_sentence_transformers.json` (`model_type` CrossEncoder,
    `activation_fn`); older ones a plain Hugging Face directory whose config.json holds
    `sentence_transformers.activation_fn` (4.x) or `sbert_ce_default_activation_function`.
    None when `folder` is neither."""
    extra = folder / ST_CONFIG
    settings = _read_json(extra, ST_CONFIG) if extra.is_file() else {}
    if settings.get("model_type") == "CrossEncoder":
        modules_file = folder / "modules.json"
        modules = (read_json(modules_file, "sentence-transformers' modules.json",
                             error=UsageError) if modules_file.is_file() else
                   [{"type": "Transformer", "path": ""}])
        if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
            raise UsageError(f"{modules_file}: expected a list of modules")
        kinds = [str(m.get("type", "")).rsplit(".", 1)[-1] for m in modules]
        if kinds != ["Transformer"]:
            raise UsageError(f"{modules_file}: modules {', '.join(kinds) or 'none'}; popbert "
                             "reads a CrossEncoder of one Transformer (a "
                             "*ForSequenceClassification)")
        model_dir = folder / str(modules[0].get("path", ""))
        recorded = (extra, settings["activation_fn"]) if settings.get("activation_fn") else None
        return CrossEncoder(model_dir, recorded or _legacy_activation(model_dir) or
                            (extra, None), _max_length(folder, model_dir))
    recorded = _legacy_activation(folder)
    return (None if recorded is None
            else CrossEncoder(folder, recorded, _max_length(folder, folder)))


def _legacy_activation(model_dir: Path) -> tuple[Path, str | None] | None:
    """The activation config.json records for sentence-transformers before 5: its
    `sentence_transformers` mapping (4.x; without `activation_fn`, the default) or
    `sbert_ce_default_activation_function` (before 4); None when it records neither."""
    path = model_dir / "config.json"
    config = _read_json(path, "a Hugging Face config.json") if path.is_file() else {}
    if isinstance(config.get("sentence_transformers"), dict):
        return path, config["sentence_transformers"].get("activation_fn")
    old = config.get("sbert_ce_default_activation_function")
    return (path, old) if old is not None else None


def cross_encoder_activation(cross: CrossEncoder) -> str | None:
    """`model.task.activation` for the activation the folder records for
    `CrossEncoder.predict`; None where it records none (its default: sigmoid for one output,
    identity for classes). One popbert does not apply (Tanh, a function of the folder's own
    code) is one line naming the file and the value."""
    if cross.activation is None or cross.activation[1] is None:
        return None
    path, value = cross.activation
    name = ST_ACTIVATIONS.get(str(value))
    if name is None:
        raise UsageError(f"{path}: activation_fn {value!r}; popbert applies "
                         "torch.nn.Sigmoid or torch.nn.Identity to a CrossEncoder's scores")
    return name


def _tokenizer_file(model_dir: Path, family: str) -> Path:
    """The directory's tokenizer: the one the family's checkpoints ship (`tokenizer.json` for
    ModernBERT, `vocab.txt` for BERT), the other where that one is absent."""
    for name in FAMILIES[family].hf_tokenizers:
        if (model_dir / name).is_file():
            return model_dir / name
    raise UsageError(f"{model_dir}: no {VOCAB} or {TOKENIZER_JSON} (popbert tokenizes with the "
                     "checkpoint's own tokenizer)")


def _prepare_output(path: Path, marker: str, flag: str) -> None:
    """Refuse to replace a directory that popbert did not write (atomic writes replace all)."""
    if path.exists() and (not path.is_dir() or
                          (any(path.iterdir()) and not (path / marker).exists())):
        raise UsageError(f"{flag}: {path} exists and is not an empty directory (nor one this "
                         "command wrote); choose a new directory")


# ----------------------------------------------------------------------------------------------
# Import


def import_hf(model_dir: Path, output_dir: Path, sequence_length: int | None = None,
              seed: int = 0) -> ImportReport:
    """Convert a Hugging Face BERT or ModernBERT directory into a popbert run directory with
    one checkpoint."""
    import torch
    from onnx import numpy_helper

    from popbert.builders.bert import build_bert
    from popbert.config import RunConfig, config_from_dict, dump_config
    from popbert.data.errors import DataError
    from popbert.data.tokenization import load_tokenizer
    from popbert.graph.annotations import trainable_initializers
    from popbert.io import checkpoint as ckpt

    model_dir, output_dir = Path(model_dir), Path(output_dir)
    if not model_dir.is_dir():
        raise UsageError(f"--model: not a directory: {model_dir}")
    _prepare_output(output_dir, IMPORT_REPORT, "--output-dir")
    cross = read_cross_encoder(model_dir)
    activation = cross_encoder_activation(cross) if cross is not None else None
    folder = cross or read_sentence_transformer(model_dir)
    sentence = folder if isinstance(folder, SentenceTransformer) else None
    if folder is not None:  # its transformer may sit in a subfolder (0_Transformer)
        model_dir = folder.model_dir
        sequence_length = sequence_length or folder.max_seq_length
    config_path = model_dir / "config.json"
    hf_config = _read_json(config_path, "a Hugging Face config.json")
    bert = config_from_hf(hf_config, str(config_path), sequence_length)
    vocab = _tokenizer_file(model_dir, bert.architecture)
    try:
        vocab_entries = load_tokenizer(vocab).vocab_size
    except DataError as error:
        raise UsageError(str(error)) from None
    if vocab_entries > bert.vocab_size:
        raise UsageError(f"{vocab}: {vocab_entries} entries but config.json vocab_size is "
                         f"{bert.vocab_size}")
    state, weights_file = load_hf_state(model_dir)
    read = hf.HF_FAMILIES[bert.architecture].read(state, bert, hf_config)
    weights, missing, rules = read.weights, read.missing, read.rules
    architecture, ignored = read.architecture, read.ignored
    # A missing encoder tensor means the file is not this config's model.
    absent = [n for n in missing if n not in read.optional]
    if absent:
        raise UsageError(f"{weights_file}: no tensor {_hf_names(absent[0], rules)} "
                         f"({len(absent)} tensors missing); is this a "
                         f"{FAMILIES[bert.architecture].hf_model_type} checkpoint matching its "
                         "config.json?")

    # A tokenizer.json carries its own normaliser; only a vocab.txt needs the lowercase flag.
    lowercase = read_lowercase(model_dir) if vocab.name == VOCAB else True
    bert.task = TaskConfig(hf_architecture=architecture, lowercase=lowercase)
    if sentence is not None:  # what `export --task embedding` pools and normalises
        bert.task.pooling, bert.task.normalize = sentence.pooling, sentence.normalize
        bert.task.prompts = sentence.prompts or None
    head = next((name for name in ("Classifier/B", "Tokens/Classifier/B") if name in weights),
                None)
    if head is not None:
        labels = hf_config.get("id2label") or {}
        bert.task.num_labels = int(weights[head].shape[0])
        names = [labels.get(str(i)) for i in range(bert.task.num_labels)]
        # One output is a score (a regression head, a cross-encoder): it names no classes.
        if bert.task.num_labels > 1 and all(isinstance(n, str) for n in names):
            bert.task.labels = names
        if cross is not None and head == "Classifier/B":  # what CrossEncoder.predict applies
            bert.task.activation = activation or ("sigmoid" if bert.task.num_labels == 1
                                                  else "identity")
            log.info("a sentence-transformers CrossEncoder: its scores go through %s",
                     bert.task.activation)

    graph = build_bert(bert, task="pretraining", seed=seed)
    model = graph.model()
    initial = {t.name: t for t in model.graph.initializer}
    checkpoint_weights: dict[str, torch.Tensor] = {}
    for name in trainable_initializers(model):
        expected = tuple(initial[name].dims)
        if name in weights:
            if tuple(weights[name].shape) != expected:
                raise UsageError(f"{weights_file}: {name} ({_hf_names(name, rules)}) has shape "
                                 f"{tuple(weights[name].shape)}, config.json implies {expected}")
            checkpoint_weights[name] = torch.from_numpy(np.ascontiguousarray(weights[name]))
        else:
            fresh_value = np.array(numpy_helper.to_array(initial[name]))
            checkpoint_weights[name] = torch.from_numpy(fresh_value)
    for name, value in weights.items():  # task heads (qa_outputs, classifier)
        checkpoint_weights.setdefault(name, torch.from_numpy(np.ascontiguousarray(value)))
    fresh = [n for n in trainable_initializers(model) if n not in weights]

    cfg = RunConfig(model=bert)
    cfg.data.vocab_file = str(output_dir.resolve() / vocab.name)
    cfg = config_from_dict(cfg.to_dict(), source=str(config_path))
    config_yaml = dump_config(cfg)
    report = ImportReport(output_dir, step_dir(output_dir, 0), bert.task.hf_architecture,
                          loaded=sorted(weights), fresh=fresh, ignored=ignored)
    with atomic_directory(output_dir) as tmp:
        shutil.copyfile(vocab, tmp / vocab.name)
        (tmp / "config.yaml").write_text(config_yaml)
        (tmp / IMPORT_REPORT).write_text(json.dumps({
            "source": str(model_dir.resolve()), "weights_file": weights_file.name,
            "architecture": report.architecture, "fresh": fresh, "ignored": ignored,
            "loaded": report.loaded}, indent=2))
        ckpt.save_checkpoint(step_dir(tmp, 0), ckpt.Checkpoint(step=0,
                             weights=checkpoint_weights), config_yaml)
    log.info("imported %s (%s, %d tensors) into %s", model_dir, report.architecture,
             len(weights), output_dir)
    if fresh:
        log.info("initialised fresh (not in the Hugging Face checkpoint): %s", ", ".join(fresh))
    if ignored:
        log.info("ignored Hugging Face tensors: %s", ", ".join(ignored))
    return report


def _hf_names(ours: str, rules: list[hf.Rule]) -> str:
    for rule in rules:
        if rule.ours == ours:
            return "/".join(rule.theirs)
    return ours


# ----------------------------------------------------------------------------------------------
# Export


def checkpoint_vocab(checkpoint: Path, vocab_file: str | None) -> Path | None:
    """The vocabulary of a checkpoint: the config's `data.vocab_file` if it exists, else the
    `vocab.txt` or `tokenizer.json` of the run directory (import-hf and fine-tuning put one
    there), else, when the config names none, the bundled one (what pre-training with no
    `data.vocab_file` used). None: the config names a vocabulary that is gone. A URL is read
    from its copy in the local shard cache (`popbert.data.storage`)."""
    from popbert.data import storage
    from popbert.data.errors import DataError
    from popbert.io.checkpoint import find_checkpoint

    if vocab_file and storage.is_url(vocab_file):
        try:
            return storage.local_file(vocab_file)
        except DataError as exc:
            log.warning("%s; looking for the vocabulary beside the checkpoint", exc)
    elif vocab_file and Path(vocab_file).is_file():
        return Path(vocab_file)
    checkpoint = Path(checkpoint)
    step = find_checkpoint(checkpoint)
    for directory in (checkpoint, step, step.parent.parent):
        for name in (VOCAB, TOKENIZER_JSON):
            if (directory / name).is_file():
                return directory / name
    if not vocab_file:
        from popbert.data.tokenization import bundled_vocab_path

        return bundled_vocab_path()
    return None


def export_hf(checkpoint: Path, output_dir: Path, architecture: str | None = None) -> Path:
    """Write a checkpoint as a Hugging Face directory `transformers` loads with no missing or
    unexpected keys: config.json, model.safetensors and its tokenizer (vocab.txt or
    tokenizer.json, with tokenizer_config.json)."""
    import safetensors.numpy

    from popbert.config import config_from_dict
    from popbert.data.tokenization import SPECIAL_TOKENS, is_tokenizer_json, load_tokenizer
    from popbert.io.checkpoint import load_checkpoint

    restored = load_checkpoint(checkpoint, weights_only=True)
    cfg = config_from_dict(restored.config, source=f"{checkpoint}/config.yaml")
    family = cfg.model.architecture
    choices = hf.architectures_of(family)
    if not choices:
        # transformers has no GroupBERT class: its weights would load into nothing.
        raise UsageError(f"{checkpoint}: model.architecture is {family!r}; Hugging Face has "
                         f"no such model, export-hf writes {', '.join(MODEL_TYPES)} only")
    weights = {k: v.numpy() for k, v in restored.weights.items()}
    if architecture is None:
        recorded = cfg.model.task.hf_architecture
        architecture = (recorded if recorded in choices
                        else hf.architecture_for(weights, cfg.model))
    if architecture not in choices:
        raise UsageError(f"--architecture: a {FAMILIES[family].title} checkpoint is written as "
                         f"one of {', '.join(choices)}; got {architecture!r}")
    try:
        state = hf.to_hf_architecture(weights, cfg.model, architecture)
    except KeyError as error:
        raise CheckpointError(f"{checkpoint}: cannot write {architecture}: {error.args[0]}"
                              ) from None
    vocab = checkpoint_vocab(checkpoint, cfg.data.vocab_file)
    output_dir = Path(output_dir)
    _prepare_output(output_dir, "config.json", "--output-dir")
    roles = (load_tokenizer(vocab).roles if vocab is not None
             else {token: index for index, token in enumerate(SPECIAL_TOKENS)})
    hf_config = hf.HF_FAMILIES[family].config_to_hf(cfg.model, architecture, roles)
    if architecture.endswith(("SequenceClassification", "TokenClassification")):
        labels = cfg.model.task.labels
        names = [str(x) for x in labels] if labels else [
            f"LABEL_{i}" for i in range(cfg.model.task.num_labels or 2)]
        hf_config["id2label"] = {str(i): name for i, name in enumerate(names)}
        hf_config["label2id"] = {name: i for i, name in enumerate(names)}
        if cfg.model.task.num_labels == 1:  # one score: transformers' MSE, not cross-entropy
            hf_config["problem_type"] = "regression"
        if cfg.model.task.activation is not None and architecture.endswith(
                "SequenceClassification"):  # a CrossEncoder: CrossEncoder(path) applies it
            hf_config["sentence_transformers"] = _cross_encoder_key(cfg.model.task.activation)
    special = {"unk_token": "[UNK]", "sep_token": "[SEP]", "pad_token": "[PAD]",
               "cls_token": "[CLS]", "mask_token": "[MASK]",
               "model_max_length": cfg.model.max_position_embeddings}
    with atomic_directory(output_dir) as tmp:
        (tmp / "config.json").write_text(json.dumps(hf_config, indent=2, sort_keys=True))
        safetensors.numpy.save_file({k: np.ascontiguousarray(v) for k, v in state.items()},
                                    str(tmp / SAFETENSORS), metadata={"format": "pt"})
        if vocab is None:
            log.warning("%s: its vocabulary %s is gone and there is no %s in the run "
                        "directory: wrote the model without a tokenizer", checkpoint,
                        cfg.data.vocab_file, VOCAB)
        elif is_tokenizer_json(vocab):
            shutil.copyfile(vocab, tmp / TOKENIZER_JSON)
            # A generic tokenizer returns no token_type_ids unless told to: a BERT then reads
            # every pair's second text as sentence A (a cross-encoder scores the wrong input).
            inputs = (["input_ids", "token_type_ids", "attention_mask"]
                      if FAMILIES[family].segments else ["input_ids", "attention_mask"])
            (tmp / "tokenizer_config.json").write_text(json.dumps(
                {"tokenizer_class": "PreTrainedTokenizerFast", "model_input_names": inputs,
                 **special}, indent=2))
        else:
            shutil.copyfile(vocab, tmp / VOCAB)
            (tmp / "tokenizer_config.json").write_text(json.dumps({
                "tokenizer_class": "BertTokenizer", "do_lower_case": cfg.model.task.lowercase,
                **special}, indent=2))
        if cfg.model.task.pooling is not None and architecture == FAMILIES[family].hf_base:
            _write_sentence_transformer(tmp, cfg.model)
    log.info("wrote %s (%s, %d tensors%s)", output_dir, architecture, len(state),
             ", a sentence-transformers folder" if cfg.model.task.pooling else "")
    return output_dir


def _cross_encoder_key(activation: str) -> dict[str, str]:
    """config.json's `sentence_transformers` mapping, as sentence-transformers 4 wrote it and
    every later version still reads it, recording the CrossEncoder's activation."""
    from importlib.metadata import PackageNotFoundError, version

    key = {"activation_fn": HF_ACTIVATIONS[activation]}
    try:
        key["version"] = version("sentence-transformers")
    except PackageNotFoundError:  # the version is a note; the activation is what loads
        pass
    return key


def _write_sentence_transformer(directory: Path, model: BertConfig) -> None:
    """The files that make a Hugging Face encoder directory a sentence-transformers folder with
    the checkpoint's pooling, normalisation, length and prompts (the layout
    `read_sentence_transformer` reads, in sentence-transformers' classic form)."""
    task = model.task
    modules = [{"idx": 0, "name": "0", "path": "",
                "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling",
                "type": "sentence_transformers.models.Pooling"}]
    if task.normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                        "type": "sentence_transformers.models.Normalize"})
        (directory / "2_Normalize").mkdir()
    (directory / "modules.json").write_text(json.dumps(modules, indent=2))
    (directory / "1_Pooling").mkdir()
    flags = {key: task.pooling == mode for key, mode in ST_POOLINGS.items()}
    (directory / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": model.hidden_size, **flags}, indent=2))
    (directory / "sentence_bert_config.json").write_text(json.dumps(
        {"max_seq_length": model.sequence_length, "do_lower_case": False}, indent=2))
    (directory / "config_sentence_transformers.json").write_text(json.dumps(
        {"prompts": task.prompts or {}, "default_prompt_name": None}, indent=2))


__all__ = ["CrossEncoder", "ImportReport", "bert_config_from_hf", "checkpoint_vocab",
           "config_from_hf", "cross_encoder_activation", "export_hf", "hf_config_from_bert",
           "import_hf", "load_hf_state", "read_cross_encoder", "read_lowercase"]
