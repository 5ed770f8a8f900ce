"""Sentence embeddings: one vector per text, the token states pooled (mean, [CLS], max or
mean over the square root of the length) and optionally L2-normalised inside the graph, as
sentence-transformers' Pooling and Normalize modules compute them.

Trained (`popbert finetune embedding`) on rows of several texts, each row one graph input of
[batch, texts, sequence] (`model.task.texts`), with sentence-transformers' losses computed in
the graph from the rows' vectors:

- `mnrl`: in-batch negatives (InfoNCE; `MultipleNegativesRankingLoss`). Each anchor's cosine
  similarity to every positive and hard negative of the global batch (all replicas'), times
  `scale` (20), is a softmax over candidates whose target is its own positive; `symmetric`
  also ranks each positive against every anchor and averages the two (its `doc_to_query`
  direction, per-direction).
- `cosent`: scored pairs (`CoSENTLoss`): log(1 + sum over pairs (i, j) with score_i < score_j
  of exp(scale · (cos_i - cos_j))).
- Matryoshka (`MatryoshkaLoss`): the loss summed over the leading `matryoshka_dims` of each
  vector, so a prefix of the vector is an embedding too.

The trained weights are scored by retrieval (nDCG@10, MRR@10, Recall@100 by exact cosine search)
on a BEIR directory or on the pairs file itself (each anchor's positive among all its
candidates), or for scored pairs by the Spearman and Pearson correlations of cosine and score.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from popbert.atomic import atomic_write_text
from popbert.builders import layers
from popbert.builders.bert import BertGraph, Encoded, register_task
from popbert.builders.bert_config import POOLINGS, BertConfig, TaskConfig
from popbert.data.classification import regression_metrics
from popbert.data.embedding_pairs import PairsData, encode_pairs, encode_texts, read_pairs
from popbert.data.retrieval import RetrievalSet, exact_search_metrics, read_beir, unit_rows
from popbert.data.tokenization import load_tokenizer
from popbert.errors import UsageError
from popbert.graph.builder import Builder
from popbert.tasks.task import Flag, Infer, Setting, Task

log = logging.getLogger(__name__)

NAME = "embedding"
TOKEN_STATES = "token_embeddings"  # sentence-transformers' name for them
DEFAULT_SCALE = 20.0  # sentence-transformers' MultipleNegativesRankingLoss and CoSENTLoss


def _axes(b: Builder, axes: list[int], name: str) -> str:
    return b.addConstant(np.array(axes, np.int64), name)


def pooled_vectors(b: Builder, config: BertConfig, hidden: str, input_mask: str) -> str:
    """[N, S, H] token states → [N, H]: pooled over the real tokens as `model.task.pooling`
    says (default mean), then L2-normalised when `model.task.normalize` (x / max(|x|, 1e-12),
    sentence-transformers' Normalize)."""
    pooling = config.task.pooling or "mean"
    seq_axis = _axes(b, [1], "seq_axis")
    if pooling == "cls":
        pooled = b.aiOnnx.gather([hidden, b.addConstant(np.array(0, np.int64), "cls")], "CLS",
                                 axis=1)
    else:
        keep = layers.padding_keep(b, input_mask)  # [N, S, 1]
        if pooling == "max":  # padded tokens at -1e9, as sentence-transformers sets them
            low = b.aiOnnx.mul([b.aiOnnx.sub([keep, layers.scalar(b, 1.0, np.float32, "one")],
                                             "Padded"),
                                layers.scalar(b, 1e9, np.float32, "big")], "Low")
            pooled = b.aiOnnx.reducemax([b.aiOnnx.add([b.aiOnnx.mul([hidden, keep], "Real"),
                                                       low], "Masked"), seq_axis],
                                        "Max", keepdims=0)
        else:
            total = b.aiOnnx.reducesum([b.aiOnnx.mul([hidden, keep], "Real"), seq_axis], "Sum",
                                       keepdims=0)
            count = b.aiOnnx.max([b.aiOnnx.reducesum([keep, seq_axis], "Count", keepdims=0),
                                  layers.scalar(b, 1e-9, np.float32, "tiny")], "AtLeast")
            if pooling == "mean_sqrt_len":
                count = b.aiOnnx.sqrt([count], "SqrtLength")
            pooled = b.aiOnnx.div([total, count], "Mean")
    return l2_normalize(b, pooled, "Normalize") if config.task.normalize else pooled


def l2_normalize(b: Builder, x: str, name: str) -> str:
    """x / max(|x|, 1e-12) along the last axis (torch's F.normalize)."""
    with b.nameScope(name):
        square = b.aiOnnx.reducesum([b.aiOnnx.mul([x, x], "Square"), _axes(b, [-1], "last")],
                                    "SumSquare", keepdims=1)
        norm = b.aiOnnx.max([b.aiOnnx.sqrt([square], "L2"),
                             layers.scalar(b, 1e-12, np.float32, "eps")], "Norm")
        return b.aiOnnx.div([x, norm], "Unit")


def logsumexp(b: Builder, x: str, axis: int, name: str) -> str:
    """log(sum(exp(x))) over `axis` (dropped), shifted by the maximum so it cannot overflow."""
    with b.nameScope(name):
        axes = _axes(b, [axis], "axis")
        top = b.aiOnnx.reducemax([x, axes], "Max", keepdims=1)
        total = b.aiOnnx.reducesum([b.aiOnnx.exp([b.aiOnnx.sub([x, top], "Shifted")], "Exp"),
                                    axes], "Sum", keepdims=1)
        return layers.squeeze(b, b.aiOnnx.add([b.aiOnnx.log([total], "Log"), top], "LSE"),
                              [axis], "Squeeze")


def _text(b: Builder, rows: str, index: int, name: str) -> str:
    """[B, T, D] → the `index`-th text of every row, [B, D]."""
    return b.aiOnnx.gather([rows, b.addConstant(np.array(index, np.int64), f"{name}_index")],
                           name, axis=1)


def _similarities(b: Builder, queries: str, documents: str, scale: str, name: str) -> str:
    """scale · cosine of unit vectors: [Q, D] x [C, D] → [Q, C]."""
    return b.aiOnnx.mul([b.aiOnnx.matmul([queries, b.aiOnnx.transpose([documents], "T",
                                                                        perm=[1, 0])], name),
                         scale], f"{name}/Scaled")


def ranking_loss(b: Builder, rows: str, texts: int, scale: str, symmetric: bool
                 ) -> tuple[str, str]:
    """In-batch negatives over unit vectors [B, T, D] (anchor, positive, hard negatives): the
    mean over anchors of logsumexp(scale · cos(anchor, every candidate)) - scale ·
    cos(anchor, its positive), and the fraction of anchors whose positive scores highest. The
    candidates are every replica's (`ReplicatedAllGather`, the identity in one process), as
    sentence-transformers' `gather_across_devices`: N replicas of B rows train as 1 of N·B."""
    anchors, positives = _text(b, rows, 0, "Anchors"), _text(b, rows, 1, "Positives")
    # Candidates [C, D] as sentence-transformers concatenates them: every positive, then
    # every row's first negative, and so on (the loss does not depend on their order).
    candidates = b.aiOnnx.slice([rows, _axes(b, [1], "from"), _axes(b, [texts], "to"),
                                 _axes(b, [1], "text_axis")], "Candidates")
    candidates = b.aiOnnx.transpose([candidates], "ByText", perm=[1, 0, 2])
    candidates = b.aiOnnx.flatten([candidates], "AllCandidates", axis=2)  # [(T-1)·B, D]
    # Every replica's candidates (and anchors) are this replica's negatives too.
    candidates = b.aiGraphcore.replicatedallgather([candidates], "EveryReplica")
    scores = _similarities(b, anchors, candidates, scale, "Scores")  # [B, C]
    positive = b.aiOnnx.mul([b.aiOnnx.reducesum([b.aiOnnx.mul([anchors, positives], "Dot"),
                                                 _axes(b, [-1], "last")], "Cosine",
                                                keepdims=0), scale], "Positive")  # [B]
    partition = logsumexp(b, scores, -1, "Forward")
    if symmetric:  # each positive against every anchor, the two softmaxes averaged
        every_anchor = b.aiGraphcore.replicatedallgather([anchors], "EveryReplicaAnchors")
        backward = logsumexp(b, _similarities(b, positives, every_anchor, scale, "Backward"),
                             -1, "BackwardLSE")
        partition = b.aiOnnx.mul([b.aiOnnx.add([partition, backward], "BothDirections"),
                                  layers.scalar(b, 0.5, np.float32, "half")], "Mean")
    loss = b.aiOnnx.reducemean([b.aiOnnx.sub([partition, positive], "NLL")], "Loss",
                               keepdims=0)
    best = b.aiOnnx.reducemax([scores, _axes(b, [-1], "row")], "Best", keepdims=0)
    hit = b.aiOnnx.cast([b.aiOnnx.greaterorequal([positive, best], "PositiveFirst")], "Hit",
                        to=1)
    return loss, b.aiOnnx.reducemean([hit], "Accuracy", keepdims=0)


def cosent_loss(b: Builder, rows: str, scores: str, scale: str) -> str:
    """CoSENT over unit vectors [B, 2, D] and their gold `scores` [B]: log(1 + sum over pairs
    with score_i < score_j of exp(scale · cos_i - scale · cos_j))."""
    first, second = _text(b, rows, 0, "First"), _text(b, rows, 1, "Second")
    cosine = b.aiOnnx.mul([b.aiOnnx.reducesum([b.aiOnnx.mul([first, second], "Dot"),
                                               _axes(b, [-1], "last")], "Cosine", keepdims=0),
                           scale], "Scaled")  # [B]
    difference = b.aiOnnx.sub([layers.unsqueeze(b, cosine, [1], "Column"),
                               layers.unsqueeze(b, cosine, [0], "Row")], "Difference")
    lower = b.aiOnnx.less([layers.unsqueeze(b, scores, [1], "GoldColumn"),
                           layers.unsqueeze(b, scores, [0], "GoldRow")], "LowerGold")
    masked = b.aiOnnx.where([lower, difference, layers.scalar(b, -1e12, np.float32, "never")],
                            "Ordered")
    flat = b.aiOnnx.reshape([masked, _axes(b, [-1], "flat")], "Pairs")
    return logsumexp(b, b.aiOnnx.concat([b.addConstant(np.zeros(1, np.float32), "zero"), flat],
                                        "WithZero", axis=0), 0, "Loss")


@register_task(NAME)
def embedding_head(b: Builder, config: BertConfig, init: layers.WeightInit, graph: BertGraph,
                   encoded: Encoded, with_loss: bool) -> None:
    """`embedding` [N, H], one vector per text (`pooled_vectors`); with the loss, rows of
    `model.task.texts` texts and the loss `model.task.loss` names, over the leading
    `matryoshka_dims` of the vectors (summed), and for in-batch negatives the accuracy."""
    if encoded.input_mask is None:
        raise ValueError("the embedding head pools over unpacked rows (an input_mask)")
    with b.nameScope("Embedding"):
        vectors = pooled_vectors(b, config, encoded.hidden, encoded.input_mask)
    graph.outputs["embedding"] = vectors  # training too: gradient caching cuts the graph here
    if not with_loss:
        # Each token's final state as well (TEI's `/embed_all`, late interaction): computed
        # for the pooling anyway, fetched only by a caller that asks (`Task.on_request_outputs`).
        graph.outputs[TOKEN_STATES] = encoded.hidden
        return
    task = config.task
    if task.texts is None or task.loss is None:
        raise ValueError("training an embedding needs model.task.texts and model.task.loss "
                         "(`popbert finetune embedding` sets them)")
    width = config.hidden_size
    dims = task.matryoshka_dims or [width]
    gold = (graph.add_float_input("labels", [graph.batch_size]) if task.loss == "cosent"
            else None)  # a scored pair's score
    with b.nameScope("Loss"):
        scale = layers.scalar(b, float(task.scale or DEFAULT_SCALE), np.float32, "scale")
        rows = b.aiOnnx.reshape([vectors, _axes(b, [-1, task.texts, width], "rows")], "Rows")
        losses, accuracy = [], None
        for dim in dims:
            with b.nameScope(f"Dim{dim}"):
                part = rows if dim == width else b.aiOnnx.slice(
                    [rows, _axes(b, [0], "start"), _axes(b, [dim], "end"),
                     _axes(b, [2], "feature_axis")], "Leading")
                unit = l2_normalize(b, part, "Cosine")
                if gold is not None:
                    losses.append(cosent_loss(b, unit, gold, scale))
                else:
                    loss, hits = ranking_loss(b, unit, task.texts, scale, bool(task.symmetric))
                    losses.append(loss)
                    accuracy = accuracy or hits
        graph.outputs["loss"] = (losses[0] if len(losses) == 1
                                 else b.aiOnnx.sum(losses, "MatryoshkaSum"))
        if accuracy is not None:
            graph.outputs["accuracy"] = accuracy


@dataclass
class EmbeddingRun:
    """One run's data: the training rows' features, the head's settings, and what the trained
    weights are scored on (a BEIR directory, or a pairs file)."""

    setting: Setting
    head: TaskConfig
    arrays: dict[str, np.ndarray]
    eval_pairs: PairsData | None
    eval_beir: RetrievalSet | None

    def task_config(self) -> TaskConfig:
        return self.head

    def score(self, infer: Infer, output_dir: Path) -> dict[str, float]:
        """Retrieval on the BEIR directory or the pairs file, or for scored pairs the
        correlations of cosine and score (eval_results.json)."""
        tokenizer = load_tokenizer(self.setting.vocab, self.setting.lowercase)

        def embed(texts: list[str]) -> np.ndarray:
            arrays, _ = encode_texts(texts, tokenizer, self.setting.max_seq_length)
            return infer(arrays)["embedding"]

        metrics: dict[str, Any]
        if self.eval_beir is not None:
            metrics = exact_search_metrics(self.eval_beir, embed, embed)
            where = str(self.eval_beir.directory)
        else:
            pairs = self.eval_pairs
            assert pairs is not None
            where = str(pairs.path)
            if pairs.scores is not None:
                cosine = np.sum(unit_rows(embed([row[0] for row in pairs.texts]))
                                * unit_rows(embed([row[1] for row in pairs.texts])), axis=1)
                metrics = {**regression_metrics(cosine, pairs.scores),
                           "examples": len(pairs)}
                metrics.pop("mse")  # a cosine is not on the scores' scale
            else:
                metrics = exact_search_metrics(_pairs_as_retrieval(pairs), embed, embed)
        atomic_write_text(output_dir / "eval_results.json", json.dumps(metrics, indent=2))
        shown = ", ".join(f"{k} {v:.4f}" for k, v in metrics.items() if isinstance(v, float))
        log.info("embedding %s: %s", where, shown)
        return metrics


def _pairs_as_retrieval(pairs: PairsData) -> RetrievalSet:
    """Each distinct anchor a query whose relevant documents are its positives, among every
    distinct positive and negative of the file."""
    documents = {text: f"d{i}" for i, text in enumerate(
        dict.fromkeys(text for row in pairs.texts for text in row[1:]))}
    queries = {anchor: f"q{i}" for i, anchor in enumerate(
        dict.fromkeys(row[0] for row in pairs.texts))}
    qrels: dict[str, dict[str, int]] = {}
    for row in pairs.texts:
        qrels.setdefault(queries[row[0]], {})[documents[row[1]]] = 1
    return RetrievalSet(pairs.path, {i: text for text, i in documents.items()},
                        {i: text for text, i in queries.items()}, qrels)


def _loss(cfg: Any, pairs: PairsData) -> str:
    """The loss `finetune.loss` names, else the one the file's columns call for."""
    loss = cfg.finetune.loss or ("cosent" if pairs.scores is not None else "mnrl")
    if loss == "cosent" and pairs.scores is None:
        raise UsageError(f"{pairs.path}: the cosent loss needs a score column "
                         f"{cfg.finetune.score_column!r} (--score-column)")
    return loss


def read(cfg: Any, setting: Setting) -> EmbeddingRun:
    """The training rows as [rows, texts, sequence] features and the head's settings: the
    checkpoint's pooling and normalisation (mean, not normalised, for one that has none)
    unless `finetune.pooling`/`normalize` name others."""
    f = cfg.finetune
    columns = (f.anchor_column, f.positive_column, f.negative_column, f.score_column)
    scored = {"cosent": True, "mnrl": False}.get(f.loss) if f.loss else None
    train = read_pairs(Path(f.train_file), *columns, scored=scored)
    loss = _loss(cfg, train)
    dims = list(f.matryoshka_dims) if f.matryoshka_dims else None
    width = setting.hidden_size
    if dims and any(d > width for d in dims):
        raise UsageError(f"finetune.matryoshka_dims {dims}: the checkpoint's vectors have "
                         f"{width} dimensions")
    eval_pairs = eval_beir = None
    if f.eval_file and Path(f.eval_file).is_dir():
        eval_beir = read_beir(f.eval_file)
    elif f.eval_file:
        eval_pairs = read_pairs(Path(f.eval_file), *columns,
                                scored=train.scores is not None)
    else:
        eval_pairs = train
    tokenizer = load_tokenizer(setting.vocab, setting.lowercase)
    arrays, truncated = encode_pairs(train, tokenizer, setting.max_seq_length)
    theirs = setting.checkpoint_task
    pooling = f.pooling or (theirs.pooling if theirs else None) or "mean"
    normalize = f.normalize if f.normalize is not None else bool(theirs and theirs.normalize)
    head = TaskConfig(name=NAME, hf_architecture=setting.hf_architecture,
                      lowercase=setting.lowercase, pooling=pooling, normalize=normalize,
                      prompts=theirs.prompts if theirs else None, texts=len(train.columns),
                      loss=loss, scale=float(f.scale), symmetric=bool(f.symmetric),
                      matryoshka_dims=dims)
    log.info("embedding: %d rows of %s (%s), %s loss at scale %g%s%s; %s pooling%s",
             len(train), ", ".join(train.columns), train.path.name, loss, f.scale,
             ", symmetric" if f.symmetric and loss == "mnrl" else "",
             f", Matryoshka dimensions {dims}" if dims else "", pooling,
             ", normalised" if normalize else "")
    return EmbeddingRun(setting, head, arrays, eval_pairs, eval_beir)


def _dims(text: str) -> list[int]:
    """argparse's type for --matryoshka-dims: "768,512,256" → [768, 512, 256]."""
    import argparse

    try:
        dims = [int(part) for part in text.split(",")]
    except ValueError:
        dims = []
    if not dims or min(dims) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated dimensions >= 1 (768,512,"
                                         f"256), got {text!r}")
    return dims


TASK = Task(
    predictor="popbert.serve.embed:EmbedPredictor",
    name=NAME, command="embedding",
    help="sentence embeddings from (anchor, positive[, negatives]) rows or scored pairs",
    description="Fine-tune sentence embeddings with in-batch negatives (InfoNCE / multiple-"
                "negatives ranking) or CoSENT on scored pairs; report retrieval nDCG@10, "
                "MRR@10 and Recall@100 on --eval (a BEIR directory or a pairs file; default: "
                "the training file), or Spearman's correlation for scored pairs, as JSON.",
    files="pairs", read=read,
    flags=(
        Flag("--eval", "finetune.eval_file",
             {"metavar": "FILE|DIR", "help": "a pairs file or a BEIR directory (corpus.jsonl, "
                                             "queries.jsonl, qrels/test.tsv)"},
             file="pairs_or_beir"),
        Flag("--anchor-column", "finetune.anchor_column",
             {"help": "default: anchor (sentence1 for scored pairs)"}),
        Flag("--positive-column", "finetune.positive_column",
             {"help": "default: positive (sentence2 for scored pairs)"}),
        Flag("--negative-column", "finetune.negative_column",
             {"help": "hard negatives: this column and NAME_1, NAME_2, ... (default: "
                      "negative)"}),
        Flag("--score-column", "finetune.score_column",
             {"help": "a scored pair's similarity (default: score)"}),
        Flag("--loss", "finetune.loss",
             {"choices": ("mnrl", "cosent"),
              "help": "mnrl: in-batch negatives (default); cosent: scored pairs (default when "
                      "the file has a score column)"}),
        Flag("--scale", "finetune.scale",
             {"type": float, "help": "the cosine similarities' scale, 1/temperature (default "
                                     "20)"}),
        Flag("--symmetric", "finetune.symmetric",
             {"action": "store_true", "default": None,
              "help": "also rank each positive against the batch's anchors (mnrl)"}),
        Flag("--matryoshka-dims", "finetune.matryoshka_dims",
             {"type": _dims, "metavar": "D,D,...",
              "help": "train the leading dimensions of each vector too (e.g. 768,512,256,128,"
                      "64), losses summed"}),
        Flag("--mini-batch-size", "execution.gradient_cache_rows",
             {"type": int, "metavar": "ROWS",
              "help": "cached mode (GradCache, as sentence-transformers' Cached* losses): "
                      "encode ROWS rows at a time, so --batch-size can outgrow memory with "
                      "the same gradients"}),
        Flag("--pooling", "finetune.pooling",
             {"choices": POOLINGS,
              "help": "how token states become one vector (default: the checkpoint's, else "
                      "mean)"}),
        Flag("--normalize", "finetune.normalize",
             {"action": "store_true", "default": None,
              "help": "L2-normalise the vectors in the model (default: the checkpoint's)"}),
    ),
    default_max_seq_length=128, metric_keys=("loss", "accuracy"),
    final_metrics=("ndcg@10", "mrr@10", "recall@100", "spearman", "pearson"),
    # BERT-Base and wider: sentence-transformers' trainer defaults (transformers'
    # TrainingArguments: 5e-5, 3 epochs); a small model a faster rate (not measured here).
    size_defaults=((2e-4, 3), (5e-5, 3)),
    hf_architectures={"bert": "BertModel", "modernbert": "ModernBertModel"},
    outputs=("embedding", TOKEN_STATES), metadata_keys=(),
    per_token_outputs={TOKEN_STATES: 0.0}, on_request_outputs=(TOKEN_STATES,),
    always_print_metrics=True,
)

__all__ = ["DEFAULT_SCALE", "NAME", "TASK", "TOKEN_STATES", "cosent_loss", "embedding_head",
           "l2_normalize", "logsumexp", "pooled_vectors", "ranking_loss", "read"]
