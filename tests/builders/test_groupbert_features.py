"""GroupBERT through popbert's features, each checked the way the BERT tests check it.

tests/builders/test_groupbert.py has the model itself (parity with an independent PyTorch
GroupBERT, the graph, the popart dialect, placement and pipelining, one CLI run per preset shape,
the export).
Here, on tiny GroupBERTs (hidden 32-64, 1-2 layers, sequence 32-64, a handful of steps):

* half-precision weights (FP16, BF16) with stochastic rounding under LAMB and AdamW against the
  FP32 run (tests/train/test_precision.py's 2% bound), and data-parallel replicas with and
  without replicated tensor sharding against one process (the tolerances of
  tests/distributed/test_distributed.py);
* packed sequences: per-sequence losses of a packed batch equal the unpacked ones, and the
  packed batch's gradients equal the per-sequence unpacked gradients summed with the loss's
  weights (1e-4 of each tensor's largest, as the parity tests);
* phase 1 → phase 2 (`--init-from` at a longer sequence), then SQuAD and classification
  fine-tuning from the GroupBERT checkpoint through the CLI, their ONNX exports run in ONNX
  Runtime against the torch session on real windows;
* `popbert plan` of a GroupBERT preset: the parameter count from the paper's description, the
  per-stage rows of a pipelined placement.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from bert_helpers import one_thread, padded_batch, small_config  # noqa: F401 (autouse)
from checkpoint_helpers import final_step_weights, run_records
from packing_helpers import K, match_rows, only_sequence, sequences
from replica_helpers import assert_same, rendezvous
from test_popart_dialect import assert_gradients_close

from popbert.builders.bert import build_bert
from popbert.builders.bert_config import BertConfig
from popbert.cli.main import main
from popbert.config import load_config
from popbert.data.packing import pack_instance_arrays
from popbert.optimizers import AdamW, Lamb, param_groups_by_name
from popbert.runtime.session import SessionOptions, TrainingSession

FIXTURES = Path(__file__).parent.parent / "fixtures"
SQUAD = FIXTURES / "squad" / "squad-v1.1-sample.json"
SENTIMENT = FIXTURES / "classification" / "sentiment.tsv"


def config(**overrides) -> BertConfig:
    """Tiny GroupBERT: H 32 (2 conv groups of 16), I 64 in 4 FFN groups, kernel 7, 1 layer."""
    values = dict(architecture="groupbert",  # model.groupbert: 4 FFN groups, kernel 7, 16
                  hidden_size=32, num_heads=2, intermediate_size=64, num_layers=1)
    values.update(overrides)
    return small_config(**values)


# ------------------------------------------------------------- half weights, stochastic rounding

PRECISION_STEPS = 12
LR = {"lamb": 4e-2, "adamw": 1.5e-2}


def train_losses(weight_dtype: str, optimizer: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Loss per step of a seeded run over 4 fixed padded batches (vocab 300), FP32 compute and
    FP32 moments; half weights are stochastically rounded. Same initial weights, same batches."""
    cfg = config()
    batches = [padded_batch(cfg, 8, seed=s) for s in range(4)]
    cls = Lamb if optimizer == "lamb" else AdamW
    half = weight_dtype != "float32"

    def make(named):
        return cls(param_groups_by_name(named, 0.01), lr=LR[optimizer], weight_decay=0.01,
                   bias_correction=optimizer != "lamb", stochastic_rounding=half, seed=0)

    torch.manual_seed(0)
    session = TrainingSession(build_bert(cfg, seed=0).model(), "loss", make,
                              SessionOptions(weight_dtype=weight_dtype, seed=0))
    losses = [float(session.run(batches[step % 4])["loss"][0])
              for step in range(PRECISION_STEPS)]
    return losses, session.weights()


_FP32: dict[str, list[float]] = {}


def fp32_losses(optimizer: str) -> list[float]:
    if optimizer not in _FP32:
        _FP32[optimizer] = train_losses("float32", optimizer)[0]
    return _FP32[optimizer]


def tail(losses: list[float]) -> float:
    return float(np.mean(losses[-4:]))


@pytest.mark.parametrize("weight_dtype, optimizer", [
    ("float16", "lamb"), ("bfloat16", "lamb"), ("float16", "adamw"), ("bfloat16", "adamw")])
def test_half_weights_with_stochastic_rounding_train_like_fp32(weight_dtype: str,
                                                               optimizer: str) -> None:
    reference = fp32_losses(optimizer)
    assert tail(reference) < reference[0] - 0.8, "the FP32 run itself must learn"
    losses, weights = train_losses(weight_dtype, optimizer)
    assert {w.dtype for w in weights.values()} == {getattr(torch, weight_dtype)}
    assert all(bool(torch.isfinite(w).all()) for w in weights.values())
    assert all(np.isfinite(losses))
    assert tail(losses) < losses[0] - 0.8
    # tests/train/test_precision.py's bound, here at the end of a short run.
    assert abs(tail(losses) - tail(reference)) / tail(reference) < 0.02, (losses, reference)


# ----------------------------------------------------------- replicas, replicated tensor sharding

REPLICA_STEPS = 3
REPLICA_MODEL = {"model.num_layers": 1, "model.hidden_size": 32, "model.num_heads": 2,
                 "model.intermediate_size": 64, "model.vocab_size": 300,
                 "model.sequence_length": 32, "model.max_position_embeddings": 32,
                 "model.max_predictions_per_seq": 6, "optimizer.name": "lamb",
                 "optimizer.lr": 0.01, "optimizer.max_grad_norm": 1.0,
                 "optimizer.warmup_steps": 0, "optimizer.decay": "none",
                 "execution.micro_batch_size": 4, "execution.device": "cpu"}


def replica_config(replicas: int, accumulation: int, **values: object):
    merged = {**REPLICA_MODEL, "execution.replicas": replicas,
              "execution.gradient_accumulation": accumulation,
              **{k.replace("__", "."): v for k, v in values.items()}}
    return load_config("groupbert-mini", [f"{k}={json.dumps(v)}" for k, v in merged.items()])


def train_replica(cfg, rank: int, replicas=None) -> tuple[dict[str, np.ndarray], list[float]]:
    """REPLICA_STEPS optimizer steps on one global batch of 8 rows (so the loss falls); replica
    `rank` of n feeds its 8/n rows (one process with accumulation feeds all 8). The losses are
    this replica's own."""
    from popbert.train.factories import optimizer_factory

    torch.manual_seed(0)
    graph = build_bert(cfg.model, seed=0)
    session = TrainingSession(graph.model(), graph.loss, optimizer_factory(cfg),
                              SessionOptions.from_config(cfg, replicas), replicas=replicas)
    share = 8 // (replicas.size if replicas is not None else 1)
    losses = []
    batch = padded_batch(cfg.model, 8, seed=100)
    for _ in range(REPLICA_STEPS):
        mine = {k: v[rank * share:(rank + 1) * share] for k, v in batch.items()}
        losses.append(float(session.run(mine)["loss"].mean()))
    return {n: w.float().numpy() for n, w in session.weights().items()}, losses


def _replica_worker(rank: int, world: int, init_method: str, out: str) -> None:
    """Two gloo replicas: data parallel, sharded (RTS), sharded with BF16 weights (spawned:
    importable, no pytest state)."""
    import logging

    import torch.distributed as dist

    from popbert.distributed import Replicas

    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    replicas = Replicas.from_group(None, owns_process_group=True)
    runs = {"dp": {}, "rts": {"execution__replicated_tensor_sharding": True},
            "rts-bf16": {"execution__replicated_tensor_sharding": True,
                         "execution__weight_dtype": "bfloat16"}}
    for name, values in runs.items():
        weights, losses = train_replica(replica_config(world, 1, **values), rank, replicas)
        if rank == 0:
            np.savez(f"{out}/{name}.npz", **weights)
            Path(f"{out}/{name}.json").write_text(json.dumps(losses))
    replicas.shutdown()


@pytest.fixture(scope="module")
def replica_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch.multiprocessing as mp

    out = tmp_path_factory.mktemp("groupbert-replicas")
    mp.spawn(_replica_worker, args=(2, rendezvous(out), str(out)), nprocs=2, join=True)
    weights, losses = train_replica(replica_config(1, 2), 0)
    np.savez(out / "single.npz", **weights)
    (out / "single.json").write_text(json.dumps(losses))
    return out


def replica_weights(runs: Path, name: str) -> dict[str, np.ndarray]:
    with np.load(runs / f"{name}.npz") as data:
        return dict(data)


@pytest.mark.e2e
def test_replicas_and_sharded_optimizer_train_the_same_groupbert(replica_runs: Path) -> None:
    """2 replicas == 1 process x accumulation 2 (1e-5), RTS on == off (1e-6): the tolerances of
    tests/distributed/test_distributed.py (relative over all weights, 100x that per tensor)."""
    single = replica_weights(replica_runs, "single")
    dp = replica_weights(replica_runs, "dp")
    assert_same(dp, single, 1e-5, "GroupBERT: 2 replicas x 1 vs 1 x 2")
    assert_same(replica_weights(replica_runs, "rts"), dp, 1e-6, "GroupBERT: RTS on vs off")
    initial = {t.name: onnx.numpy_helper.to_array(t) for t in build_bert(
        replica_config(1, 2).model, seed=0).model().graph.initializer if t.name in single}
    # The runs trained: far from the initial weights.
    assert max(float(np.abs(single[n] - initial[n]).max()) for n in initial) > 1e-3
    # Each run's losses are replica 0's own rows (the runs log no global mean here).
    losses = {n: json.loads((replica_runs / f"{n}.json").read_text()) for n in ("dp", "rts")}
    np.testing.assert_allclose(losses["rts"], losses["dp"], rtol=1e-5)
    assert losses["dp"][-1] < losses["dp"][0] - 0.1, losses


@pytest.mark.e2e
def test_sharded_bf16_weights_train(replica_runs: Path) -> None:
    """RTS with BF16 weights and stochastic rounding: finite, and within 2% of FP32's loss."""
    weights = replica_weights(replica_runs, "rts-bf16")
    assert all(np.isfinite(w).all() for w in weights.values())
    losses = json.loads((replica_runs / "rts-bf16.json").read_text())
    reference = json.loads((replica_runs / "rts.json").read_text())
    assert losses[-1] < losses[0]
    assert abs(losses[-1] - reference[-1]) / reference[-1] < 0.02, (losses, reference)
    bf16 = {n: w.astype(np.float32) for n, w in weights.items()}
    assert any(not np.array_equal(bf16[n], replica_weights(replica_runs, "rts")[n])
               for n in bf16)


# ------------------------------------------------------------------------------ packed sequences


@pytest.fixture(scope="module")
def packed_sessions():
    """Unpacked and packed GroupBERT sessions with identical weights (std 0.2: sharp attention,
    so a leak between packed sequences shows far above the tolerance)."""
    cfg = config(num_layers=2, hidden_size=64, num_heads=4, intermediate_size=128,
                 max_predictions_per_seq=4, initializer_range=0.2)
    unpacked = sequences(cfg, 7, seed=3)
    packed, stats = pack_instance_arrays(unpacked, max_sequences_per_pack=K,
                                         max_predictions_per_pack=K * 4, seed=1)
    packed = {k: v.astype(np.int64) for k, v in packed.items()}
    assert stats.packs < stats.sequences and packed["sequence_index"].max() > 1
    packed_cfg = BertConfig(**{**cfg.__dict__, "max_predictions_per_seq": K * 4,
                               "packed": True, "max_sequences_per_pack": K})
    sgd = lambda params: torch.optim.SGD([p for _, p in params], lr=0.0)  # noqa: E731
    plain = TrainingSession(build_bert(cfg, seed=7).model(), "loss", sgd)
    pack = TrainingSession(build_bert(packed_cfg, seed=7).model(), "loss", sgd)
    ours, theirs = plain.weights(), pack.weights()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    return unpacked, packed, plain, pack


def gradients(session: TrainingSession, batch: dict[str, np.ndarray],
              weigh=lambda outputs: outputs["loss"]):
    """Outputs and the weight gradients of `weigh(outputs)`."""
    session.optimizer.zero_grad(set_to_none=True)
    outputs = session.forward(batch)
    weigh(outputs).backward()
    return ({k: v.detach() for k, v in outputs.items()},
            {n: p.grad.detach().clone() for n, p in session.named_parameters})


def test_packed_per_sequence_losses_and_summed_gradients(packed_sessions) -> None:
    """Each sequence's MLM and NSP losses read from the packed batch (every other label
    ignored) equal its unpacked losses (1e-5), and the packed batch's gradient equals the
    unpacked per-sequence gradients summed with the loss's weights: MLM is a mean over all N
    masked tokens (sequence s weighs n_s / N), NSP a mean over the B sequences (1 / B)."""
    unpacked, packed, plain, pack = packed_sessions
    rows = match_rows(unpacked, packed)
    count = len(unpacked["input_ids"])
    tokens = (unpacked["masked_lm_ids"] != 0).sum(axis=1)
    total = int(tokens.sum())
    summed: dict[str, torch.Tensor] = {}
    for src in range(count):
        single = {k: v[src:src + 1] for k, v in unpacked.items()}

        def weigh(o, share=float(tokens[src]) / total):
            return share * o["mlm_loss"] + o["nsp_loss"] / count

        out_u, grad_u = gradients(plain, single, weigh)
        out_p, _ = gradients(pack, only_sequence(packed, *rows[src]))
        for key in ("mlm_loss", "nsp_loss"):
            assert abs(float(out_u[key]) - float(out_p[key])) <= 1e-5, (src, key)
        for name, g in grad_u.items():
            summed[name] = summed.get(name, 0) + g
    out_p, grad_p = gradients(pack, packed)
    out_u, grad_u = gradients(plain, unpacked)
    for key in ("loss", "mlm_loss", "nsp_loss", "mlm_accuracy", "nsp_accuracy"):
        assert abs(float(out_u[key]) - float(out_p[key])) <= 1e-5, key
    assert_gradients_close(grad_p, summed)
    assert_gradients_close(grad_p, grad_u)
    # The conv weights get gradient (the comparison covers the convolution's packed path).
    assert float(grad_p["Layer0/Conv/Conv/W"].abs().max()) > 0


def test_negative_control_a_leaky_pack_changes_the_gradients(packed_sessions) -> None:
    """The comparison above can fail: one sequence index for the whole row (attention and the
    convolution read across sequences) moves the gradients far beyond 1e-4."""
    unpacked, packed, plain, pack = packed_sessions
    leaky = {**packed, "sequence_index": (packed["sequence_index"] > 0).astype(np.int64)}
    _, grad_p = gradients(pack, leaky)
    _, grad_u = gradients(plain, unpacked)
    with pytest.raises(AssertionError, match="gradient error"):
        assert_gradients_close(grad_p, grad_u)


# ----------------------------------------------------- phase 1 → phase 2, fine-tuning, exports

TINY = ["--config", "groupbert-mini", "--set", "model.num_layers=1",
        "--set", "model.hidden_size=32", "--set", "model.num_heads=2",
        "--set", "model.intermediate_size=64", "--set", "model.max_position_embeddings=64",
        "--set", "execution.micro_batch_size=8", "--set", "execution.device=cpu",
        "--set", "training.log_every=1"]
PHASE1 = [*TINY, "--set", "model.sequence_length=32", "--set", "model.max_predictions_per_seq=5",
          "--set", "training.steps=10", "--set", "optimizer.lr=0.01",
          "--set", "optimizer.warmup_steps=2"]
# A vanishing learning rate: after its steps, phase 2's weights are still phase 1's.
PHASE2 = [*TINY, "--set", "model.sequence_length=64", "--set", "model.max_predictions_per_seq=10",
          "--set", "training.steps=2", "--set", "optimizer.lr=1e-9",
          "--set", "optimizer.warmup_steps=0", "--set", "optimizer.decay=none",
          "--set", "optimizer.weight_decay=0.0"]


@pytest.fixture(scope="module")
def phase1(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("groupbert") / "phase1"
    assert main(["pretrain", *PHASE1, "--output-dir", str(run)]) == 0
    return run


@pytest.mark.e2e
def test_phase_two_continues_from_phase_one_at_a_longer_sequence(phase1: Path,
                                                                 tmp_path: Path) -> None:
    phase2 = tmp_path / "phase2"
    assert main(["pretrain", *PHASE2, "--init-from", str(phase1),
                 "--output-dir", str(phase2)]) == 0
    before, after = final_step_weights(phase1), final_step_weights(phase2)
    assert before.keys() == after.keys()
    assert {"Layer0/Conv/Conv/W", "Layer0/FFN2/Grouped/W", "FinalNorm/Gamma"} <= set(before)
    for name in before:  # every weight carried over (lr 1e-9)
        np.testing.assert_allclose(after[name], before[name], rtol=0, atol=1e-6, err_msg=name)
    cfg2 = load_config("groupbert-mini", [PHASE2[i + 1] for i in range(2, len(PHASE2), 2)])
    assert cfg2.model.architecture == "groupbert" and cfg2.model.sequence_length == 64
    fresh = {t.name: onnx.numpy_helper.to_array(t)
             for t in build_bert(cfg2.model, seed=cfg2.training.seed).model().graph.initializer}
    assert np.abs(after["Layer0/Conv/Conv/W"] - fresh["Layer0/Conv/Conv/W"]).max() > 0.01
    graph = onnx.load(str(phase2 / "model.onnx"), load_external_data=False)
    assert [d.dim_value for d in graph.graph.input[0].type.tensor_type.shape.dim][1] == 64
    optimizer = torch.load(phase2 / "checkpoints" / "step-000002" / "optimizer.pt",
                           weights_only=True)
    assert {float(s["step"]) for s in optimizer["state"].values() if "step" in s} == {2.0}
    second, first = run_records(phase2), run_records(phase1)
    assert [r["step"] for r in second] == [1, 2]
    assert all(np.isfinite(r["loss"]) for r in first + second)
    # What phase 1 learned carries over to the longer sequences.
    assert first[-1]["mlm_loss"] < first[0]["mlm_loss"] - 0.3, first
    assert second[0]["mlm_loss"] < first[0]["mlm_loss"] - 0.3, (first[0], second[0])


def task_inputs(task: str, checkpoint: Path, max_seq_length: int) -> dict[str, np.ndarray]:
    """Real windows of the fixtures, as `popbert finetune` encodes them."""
    from popbert.data.classification import encode_classification, read_classification_file
    from popbert.data.squad import WindowOptions, read_squad, squad_features
    from popbert.data.tokenization import WordPieceTokenizer, make_tokenizer, parse_vocab

    vocab_file = checkpoint / "vocab.txt"
    if task == "squad":
        vocab = parse_vocab(vocab_file.read_text(encoding="utf-8"))
        questions, _ = read_squad(SQUAD)
        options = WindowOptions(max_seq_length=max_seq_length, doc_stride=32,
                                max_query_length=16)
        arrays = squad_features(questions, make_tokenizer(vocab, lowercase=True), vocab,
                                options, training=False).arrays
    else:
        arrays = encode_classification(read_classification_file(SENTIMENT),
                                       WordPieceTokenizer(vocab_file), max_seq_length)
    return {k: np.asarray(arrays[k], np.int64) for k in ("input_ids", "segment_ids",
                                                         "input_mask")}


def check_export(run: Path, task: str, max_seq_length: int, tmp_path: Path) -> None:
    """`popbert export` of the fine-tuned run, run in ONNX Runtime on real windows, equals the
    torch session of the fine-tuned checkpoint's weights (1e-4 of the largest output)."""
    from popbert.config import config_from_dict
    from popbert.export.inference import inference_config, ort_outputs
    from popbert.io.checkpoint import load_checkpoint
    from popbert.runtime.session import InferenceSession

    model = tmp_path / f"{task}.onnx"
    assert main(["export", "--checkpoint", str(run), "--task", task, "--output",
                 str(model)]) == 0
    exported = onnx.load(str(model))
    assert "Conv" in {n.op_type for n in exported.graph.node}
    batch = task_inputs(task, run, max_seq_length)
    assert batch["input_mask"].min() == 0  # padded windows: the zeroed padding is exercised
    theirs = ort_outputs(model, batch)

    restored = load_checkpoint(run, weights_only=True)
    cfg = config_from_dict(restored.config).model
    assert cfg.architecture == "groupbert"
    graph = build_bert(inference_config(cfg), task=task, with_loss=False, zeros=True).model()
    session = InferenceSession(graph)
    session.load_weights(restored.weights)
    ours = {k: v.float().numpy() for k, v in session.run(batch).items()}
    assert set(theirs) <= set(ours) and theirs
    for name, value in theirs.items():
        scale = float(np.abs(ours[name]).max())
        np.testing.assert_allclose(value, ours[name], rtol=0, atol=1e-4 * scale, err_msg=name)


@pytest.mark.e2e
def test_squad_fine_tuning_from_a_groupbert_checkpoint(phase1: Path, tmp_path: Path) -> None:
    run = tmp_path / "squad"
    assert main(["finetune", "squad", "--checkpoint", str(phase1), "--train", str(SQUAD),
                 "--predict", str(SQUAD), "--output-dir", str(run), "--max-seq-length", "64",
                 "--doc-stride", "32", "--max-query-length", "16", "--epochs", "3",
                 "--batch-size", "8", "--lr", "3e-3", "--warmup-proportion", "0",
                 "--log-every", "1"]) == 0
    cfg = load_config(run / "config.yaml").model
    assert cfg.architecture == "groupbert" and cfg.task.name == "squad"
    assert cfg.hidden_dropout == 0.1  # GroupBERT fine-tunes with dropout
    losses = [r["loss"] for r in run_records(run)]
    assert len(losses) == 9 and all(np.isfinite(losses))
    assert np.mean(losses[-3:]) < np.mean(losses[:3]), losses
    predictions = json.loads((run / "predictions.json").read_text())
    assert len(predictions) == 5
    # The encoder started from the pre-training checkpoint, not from scratch.
    tuned, pretrained = final_step_weights(run), final_step_weights(phase1)
    moved = np.abs(tuned["Layer0/Conv/Conv/W"] - pretrained["Layer0/Conv/Conv/W"]).max()
    assert 0 < moved < 0.05 * np.abs(pretrained["Layer0/Conv/Conv/W"]).max() + 0.05
    check_export(run, "squad", 64, tmp_path)


@pytest.mark.e2e
def test_classification_fine_tuning_from_a_groupbert_checkpoint(phase1: Path,
                                                                tmp_path: Path) -> None:
    run = tmp_path / "sst"
    assert main(["finetune", "classify", "--checkpoint", str(phase1), "--train",
                 str(SENTIMENT), "--output-dir", str(run), "--max-seq-length", "32",
                 "--epochs", "24", "--batch-size", "8", "--lr", "3e-3",
                 "--warmup-proportion", "0", "--dropout", "0", "--log-every", "1"]) == 0
    cfg = load_config(run / "config.yaml").model
    assert cfg.architecture == "groupbert" and cfg.task.name == "classification"
    assert cfg.task.labels == ["0", "1"] and cfg.hidden_dropout == 0.0  # --dropout 0
    losses = [r["loss"] for r in run_records(run)]
    # PreNorm from a barely pre-trained encoder: the [CLS] vector hardly depends on the text at
    # first (the loss sits at ln 2 for ~10 steps, where BERT's post-norm starts moving at once),
    # then the 16 sentences are learnt.
    assert len(losses) == 48 and all(np.isfinite(losses))
    assert np.mean(losses[-3:]) < 0.3 < 0.6 < np.mean(losses[:3]), losses
    results = json.loads((run / "eval_results.json").read_text())
    assert results == {"accuracy": 1.0, "f1": 1.0, "examples": 16}, results
    check_export(run, "classification", 32, tmp_path)


# ------------------------------------------------------------------------------------ popbert plan


def groupbert_parameters(m) -> int:
    """GroupBERT pre-training parameters from the paper's description (issue 12)."""
    h, i, v, g = m.hidden_size, m.intermediate_size, m.vocab_size, m.groupbert.ffn_groups
    norm = 2 * h
    kernel = m.groupbert.conv_group_size * m.groupbert.conv_kernel_size
    conv = norm + (h * 2 * h + 2 * h) + (h * kernel + h) + norm + (h * h + h)
    ffn = norm + (h * i + i) + (i * h // g + h) + (h * h + h)
    attention = norm + (h * 3 * h + 3 * h) + (h * h + h)
    embeddings = (v + m.max_position_embeddings + m.type_vocab_size) * h + norm
    heads = (h * h + h) + (2 * h + 2) + (h * h + h) + norm + v  # pool, NSP, MLM transform, bias
    return embeddings + m.num_layers * (conv + 2 * ffn + attention) + norm + heads


def test_plan_of_a_groupbert_preset(capsys: pytest.CaptureFixture[str]) -> None:
    from popbert.graph.annotations import trainable_initializers
    from popbert.plan.flops import training_flops_per_sequence

    cfg = load_config("groupbert-mini")
    assert main(["plan", "--config", "groupbert-mini", "--json", "--device", "h100"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["model"]["architecture"] == "groupbert"
    graph = build_bert(cfg.model, zeros=True, batch_size=cfg.execution.micro_batch_size).model()
    sizes = {t.name: int(np.prod(t.dims)) for t in graph.graph.initializer}
    assert result["totals"]["parameters"] == sum(sizes[n] for n in trainable_initializers(graph))
    assert result["totals"]["parameters"] == groupbert_parameters(cfg.model) == 7_398_402
    assert result["training_flops_per_sequence"] == training_flops_per_sequence(graph)
    assert result["fits"] is True

    # Pipelined over 3 IPUs (embeddings | 2 layers | 2 layers): one row per stage, the
    # per-stage parameters are the layers', the sums are the totals.
    assert main(["plan", "--config", "groupbert-mini", "--json", "--set",
                 "model.layers_per_ipu=[0,2,2]", "--set", "execution.pipeline=true"]) == 0
    piped = json.loads(capsys.readouterr().out)
    stages = piped["stages"]
    assert [(s["ipu"], s["stage"]) for s in stages] == [(0, 0), (1, 1), (2, 2), (0, 3)]
    m = cfg.model
    layer = (groupbert_parameters(m) - groupbert_parameters(
        type(m)(**{**m.__dict__, "num_layers": 0}))) // m.num_layers
    assert stages[1]["parameters"] == 2 * layer
    assert stages[2]["parameters"] == 2 * layer + 2 * m.hidden_size  # + the final LayerNorm
    for key in ("parameters", "weight_bytes", "training_flops_per_sequence"):
        assert sum(s[key] for s in stages) == piped["totals"][key], key
    assert len(piped["devices"]) == 3
