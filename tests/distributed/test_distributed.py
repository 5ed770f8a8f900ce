"""Data-parallel replicas and replicated tensor sharding on CPU: gloo, FP32, several processes.

One job of four processes (torch.multiprocessing, gloo) runs every scenario through the real main
job, `run_pretraining`, in process groups of 1, 2 or 4 replicas: the same global batch
(micro 4 x replicas x accumulation = 16) and the same data order, 10 steps of LAMB with
gradient clipping. The tests below compare what the scenarios wrote. Then a `torchrun` run of
`popbert pretrain`, a replica killed mid-run, and the start-up checks.

"Relative" below is ||a - b|| / ||b|| over all weights. Per tensor, sharded and unsharded runs
agree to ~1e-5 of the tensor's largest value: LAMB's norms of a tensor split between shards are
sums of partial norms (rounded differently), and Adam's normalisation amplifies such last-bit
differences in elements whose gradients are near eps (biases). A real bug (a wrong shard offset,
a missing 1/N, a skipped weight decay) moves weights by orders of magnitude more.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy
from replica_helpers import assert_same, free_port, relative, rendezvous

STEPS = 10
SMALL = {
    "model.num_layers": 2, "model.hidden_size": 64, "model.num_heads": 2,
    "model.intermediate_size": 128, "model.sequence_length": 64,
    "model.max_position_embeddings": 64, "model.max_predictions_per_seq": 10,
    "model.hidden_dropout": 0.0, "model.attention_dropout": 0.0,
    "optimizer.name": "lamb", "optimizer.warmup_steps": 2, "optimizer.max_grad_norm": 1.0,
    "execution.micro_batch_size": 4, "execution.device": "cpu", "execution.threads": 1,
    "training.steps": STEPS, "training.log_every": 5,
}


def overrides(**values: object) -> list[str]:
    merged = {**SMALL, **{k.replace("__", "."): v for k, v in values.items()}}
    return [f"{k}={json.dumps(v)}" for k, v in merged.items()]


def config(replicas: int, accumulation: int, **values: object):
    from popbert.config import load_config

    return load_config("tiny", overrides(**{"execution__replicas": replicas,
                                            "execution__gradient_accumulation": accumulation,
                                            **values}))


def _worker(rank: int, world: int, init_method: str, out: str) -> None:
    """Every scenario, in one 4-process job (spawned: must be importable, no pytest state)."""
    import logging

    import torch
    import torch.distributed as dist

    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    from memory_helpers import gradient_shard_bytes, optimizer_state_bytes
    from trainer_helpers import run_pretraining

    from popbert.distributed import Replicas

    every = Replicas.from_group(None, owns_process_group=True)
    pair = dist.new_group([0, 1])
    other_pair = dist.new_group([2, 3])
    mine = Replicas.from_group(pair if rank < 2 else other_pair)
    rts = {"execution__replicated_tensor_sharding": True}
    if rank < 2:
        run_pretraining(config(2, 2), f"{out}/dp2", replicas=mine)
        run_pretraining(config(2, 2, training__checkpoint_every=5, **rts), f"{out}/rts2",
                        replicas=mine)
        # The same under execution.compile, with tests/runtime/test_compile.py's aot_eager backend.
        import functools

        eager_compile = torch.compile
        torch.compile = functools.partial(eager_compile, backend="aot_eager")
        run_pretraining(config(2, 2, execution__compile=True, **rts), f"{out}/rts2-compiled",
                        replicas=mine)
        torch.compile = eager_compile
    else:  # meanwhile: a 4-stage pipeline (embeddings | layer 0 | layer 1 | heads) x 2 replicas
        run_pretraining(config(2, 2, model__layers_per_ipu=[0, 1, 1], execution__pipeline=True),
                        f"{out}/pipe2", replicas=mine)
        if rank == 2:  # and the 1-process reference
            run_pretraining(config(1, 4), f"{out}/single")
    dist.barrier()
    run_pretraining(config(4, 1), f"{out}/dp4", replicas=every)
    run_pretraining(config(4, 1, **rts), f"{out}/rts4", replicas=every)
    # The 2-replica sharded checkpoint of step 5 resumes on 1 process (unsharded) and on 4.
    checkpoint = Path(out) / "rts2" / "checkpoints" / "step-000005"
    if rank == 0:
        run_pretraining(config(1, 4), f"{out}/resume1", resume=checkpoint)
    dist.barrier()
    run_pretraining(config(4, 1, **rts), f"{out}/resume4", resume=checkpoint, replicas=every)

    _toy_optimizers(rank, every, Path(out))

    # Optimizer state each replica holds, sharded over 4 and not.
    from popbert.builders.bert import build_bert
    from popbert.runtime.options import SessionOptions
    from popbert.runtime.session import TrainingSession
    from popbert.train.factories import optimizer_factory

    sizes = {}
    for sharded in (False, True):
        cfg = config(4, 1, execution__replicated_tensor_sharding=sharded)
        graph = build_bert(cfg.model, seed=0)
        session = TrainingSession(graph.model(), graph.loss, optimizer_factory(cfg),
                                  SessionOptions.from_config(cfg, every), replicas=every)
        from bert_helpers import padded_batch

        session.run(padded_batch(cfg.model, batch_size=4, seed=rank))
        sizes[str(sharded)] = optimizer_state_bytes(session.optimizer)
        if sharded:
            sizes["gradient_shard"] = gradient_shard_bytes(session.optimizer)
            sizes["numel"] = sum(p.numel() for _, p in session.named_parameters)
    (Path(out) / f"state-bytes-{rank}.json").write_text(json.dumps(sizes))
    every.shutdown()  # barrier, then tear down


def _toy_optimizers(rank: int, replicas, out: Path) -> None:
    """Odd-sized tensors (split between shards, unaligned): broadcast, then 3 LAMB steps with
    each replica's own gradients, data parallel vs sharded; the gathered sharded state."""
    import torch

    from popbert.distributed import GradientBuffer, ShardedOptimizer, broadcast_parameters
    from popbert.optimizers import Lamb, param_groups_by_name

    shapes = {"a/W": (3, 5), "a/B": (7,), "b/W": (2, 17), "b/Gamma": (33,), "c/B": (1,)}

    def make():
        torch.manual_seed(0)
        named = [(n, torch.nn.Parameter(torch.randn(s))) for n, s in shapes.items()]
        with torch.no_grad():
            for _, p in named:
                p.add_(rank)  # different on every replica until the broadcast
        broadcast_parameters([p for _, p in named], replicas)
        lamb = Lamb(param_groups_by_name(named, 0.1), lr=0.05, max_grad_norm=1.0, seed=0)
        return named, lamb

    def grads(step):
        g = torch.Generator().manual_seed(100 * step + rank)
        return [torch.randn(s, generator=g) for s in shapes.values()]

    torch.manual_seed(0)
    initial = [torch.randn(s) for s in shapes.values()]
    plain, lamb = make()
    broadcast_ok = all(torch.equal(p.detach(), i) for (_, p), i in zip(plain, initial))
    buffer = GradientBuffer([p for _, p in plain], replicas)
    sharded_named, base = make()
    sharded = ShardedOptimizer(base, replicas)
    for step in range(3):
        buffer.zero_()
        for (_, p), g in zip(plain, grads(step)):
            p.grad.copy_(g)
        buffer.all_reduce_mean_()
        lamb.step()
        sharded.zero_grad()
        for (_, p), g in zip(sharded_named, grads(step)):
            p.grad.copy_(g)
        sharded.accumulate()
        sharded.step()
    weight_error = max(float((a.detach() - b.detach()).abs().max() / b.detach().abs().max())
                       for (_, a), (_, b) in zip(sharded_named, plain))
    ours, theirs = sharded.state_dict(), lamb.state_dict()
    state_error = max(float((ours["state"][i][k] - theirs["state"][i][k]).abs().max()
                            / theirs["state"][i][k].abs().max())
                      for i in theirs["state"] for k in ("exp_avg", "exp_avg_sq"))
    steps_equal = all(ours["state"][i]["step"] == 3 for i in theirs["state"])
    (out / f"toy-{rank}.json").write_text(json.dumps({
        "broadcast_ok": broadcast_ok, "weight_error": weight_error,
        "state_error": state_error, "steps_equal": steps_equal,
        "pieces": len(sharded.shards[0].pieces)}))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch.multiprocessing as mp

    from popbert.data.pretraining import load_training_data

    load_training_data(config(1, 4))  # the instance cache, once, before the replicas read it
    out = tmp_path_factory.mktemp("replicas")
    started = time.perf_counter()
    mp.spawn(_worker, args=(4, rendezvous(out), str(out)), nprocs=4, join=True)
    print(f"\n4-process scenarios: {time.perf_counter() - started:.1f} s")
    return out


def weights(run: Path, step: int = STEPS) -> dict[str, np.ndarray]:
    return safetensors.numpy.load_file(str(run / "checkpoints" / f"step-{step:06d}" /
                                           "weights.safetensors"))


@pytest.mark.e2e
def test_replica_layouts_train_the_same_weights(runs: Path) -> None:
    """1 process x accumulation 4 == 2 replicas x 2 == 4 replicas x 1 (same global batch)."""
    single = weights(runs / "single")
    assert_same(weights(runs / "dp2"), single, 1e-5, "2 replicas x 2 vs 1 x 4")
    assert_same(weights(runs / "dp4"), single, 1e-5, "4 replicas x 1 vs 1 x 4")
    # Training moved the weights (steps 5 -> 10): these are not untouched initial weights.
    assert relative(single, weights(runs / "rts2", 5))[0] > 1e-4


@pytest.mark.e2e
def test_sharded_and_unsharded_optimizers_agree(runs: Path) -> None:
    assert_same(weights(runs / "rts2"), weights(runs / "dp2"), 1e-6, "RTS on vs off, 2 replicas")
    assert_same(weights(runs / "rts4"), weights(runs / "dp4"), 1e-6, "RTS on vs off, 4 replicas")


@pytest.mark.e2e
def test_compiled_replicas_with_sharding_train_like_eager(runs: Path) -> None:
    """execution.compile under torchrun-style replicas with replicated tensor sharding."""
    assert_same(weights(runs / "rts2-compiled"), weights(runs / "rts2"), 1e-6,
                "compiled vs eager, RTS, 2 replicas")


@pytest.mark.e2e
def test_sharded_optimizer_matches_data_parallel_on_odd_shapes(runs: Path) -> None:
    """Tensors of 15, 7, 34, 33 and 1 values over 4 shards: pieces, padding, 1/N, norms."""
    for rank in range(4):
        toy = json.loads((runs / f"toy-{rank}.json").read_text())
        print(f"replica {rank}: {toy['pieces']} pieces, weights within "
              f"{toy['weight_error']:.1e}, gathered state within {toy['state_error']:.1e}")
        assert toy["broadcast_ok"] and toy["steps_equal"]
        assert toy["weight_error"] <= 1e-6
        assert toy["state_error"] <= 1e-6
        assert toy["pieces"] >= 1


@pytest.mark.e2e
def test_sharded_optimizer_state_is_one_nth_per_replica(runs: Path) -> None:
    sizes = [json.loads((runs / f"state-bytes-{r}.json").read_text()) for r in range(4)]
    for rank, size in enumerate(sizes):
        unsharded, sharded = size["False"], size["True"]
        print(f"replica {rank}: optimizer state {unsharded} B unsharded, {sharded} B with RTS "
              f"({sharded / unsharded:.4f}), FP32 gradient shard {size['gradient_shard']} B")
        assert unsharded == 8 * size["numel"]  # two FP32 moments per weight
        assert sharded / unsharded == pytest.approx(0.25, abs=0.002)
        assert size["gradient_shard"] == sharded // 2


@pytest.mark.e2e
def test_pipeline_times_replicas_matches_data_parallel(runs: Path) -> None:
    assert_same(weights(runs / "pipe2"), weights(runs / "dp2"), 1e-5,
                "4-stage pipeline x 2 replicas vs 2 replicas")
    records = [json.loads(line) for line in
               (runs / "pipe2" / "metrics.jsonl").read_text().splitlines()]
    reference = [json.loads(line) for line in
                 (runs / "dp2" / "metrics.jsonl").read_text().splitlines()]
    for ours, theirs in zip(records, reference, strict=True):
        assert ours["loss"] == pytest.approx(theirs["loss"], rel=1e-5)


@pytest.mark.e2e
def test_sharded_checkpoint_resumes_on_other_replica_counts(runs: Path) -> None:
    """Step 5 of the 2-replica RTS run, resumed unsharded on 1 process and sharded on 4,
    continues to the weights the 2-replica run reached."""
    straight = weights(runs / "rts2")
    assert_same(weights(runs / "resume1"), straight, 1e-5, "resumed on 1 process")
    assert_same(weights(runs / "resume4"), straight, 1e-5, "resumed on 4 replicas")
    metrics = [json.loads(line) for line in
               (runs / "resume4" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [10]


@pytest.mark.e2e
def test_only_replica_zero_writes_and_metrics_are_global(runs: Path) -> None:
    records = [json.loads(line) for line in
               (runs / "dp4" / "metrics.jsonl").read_text().splitlines()]
    single = [json.loads(line) for line in
              (runs / "single" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [5, 10]  # one writer
    for ours, theirs in zip(records, single, strict=True):  # averaged over the replicas
        assert ours["loss"] == pytest.approx(theirs["loss"], rel=1e-5)
        assert ours["mlm_accuracy"] == pytest.approx(theirs["mlm_accuracy"], abs=1e-6)
    for name in ("model.inference.onnx", "metrics.png", "config.yaml"):
        assert (runs / "dp4" / name).is_file()


# ---------------------------------------------------------------------------------------------
# The CLI under torchrun, a dead replica, start-up checks
# ---------------------------------------------------------------------------------------------


def cli_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", **extra)
    return env


@pytest.mark.e2e
def test_torchrun_popbert_pretrain_with_sharding(tmp_path: Path) -> None:
    torchrun = Path(sys.executable).with_name("torchrun")
    output = tmp_path / "run"
    command = [str(torchrun), "--nnodes", "1", "--nproc-per-node", "2", "--rdzv-backend",
               "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "-m", "popbert",
               "pretrain", "--output-dir", str(output)]
    for item in overrides(execution__replicas=2, execution__gradient_accumulation=2,
                          execution__replicated_tensor_sharding=True, training__steps=4,
                          training__log_every=2):
        command += ["--set", item]
    result = subprocess.run(command, capture_output=True, text=True, timeout=240,
                            env=cli_env())
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [2, 4]
    assert (output / "checkpoints" / "step-000004" / "optimizer.pt").is_file()
    assert (output / "model.inference.onnx").is_file()


@pytest.mark.e2e
@pytest.mark.parametrize("fate", ["killed", "hung"])
def test_a_dead_replica_stops_the_job_with_a_clear_message(tmp_path: Path, fate: str) -> None:
    """Replica 1 is SIGKILLed (or SIGSTOPped: hangs, its sockets stay open) mid-run: replica 0
    exits non-zero with one clear line naming replica 1 at once (or after
    $POPBERT_REPLICA_TIMEOUT), never hangs. "At once" is told from "by the timeout" without
    timing the machine: the killed case runs under a timeout of 600 s and must stop in half of
    it (a bound that only guards against a hang)."""
    timeout = 600 if fate == "killed" else 10
    output = tmp_path / "run"
    port = str(free_port())
    args = [sys.executable, "-m", "popbert", "pretrain", "--output-dir", str(output)]
    for item in overrides(execution__replicas=2, execution__gradient_accumulation=2,
                          training__steps=100000, training__checkpoint_every=2,
                          training__log_every=1000, optimizer__warmup_steps=0):
        args += ["--set", item]
    processes, logs = [], [tmp_path / f"replica-{rank}.log" for rank in range(2)]
    for rank in range(2):
        env = cli_env(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                      POPBERT_REPLICA_TIMEOUT=str(timeout))
        with logs[rank].open("w") as log:
            processes.append(subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL,
                                              stderr=log))
    survivor, victim = processes
    try:
        deadline = time.monotonic() + 180
        while not (output / "checkpoints" / "step-000002" / "state.json").exists():
            assert survivor.poll() is None and victim.poll() is None, logs[0].read_text()
            assert time.monotonic() < deadline, "the replicas never reached step 2"
            time.sleep(0.05)
        victim.send_signal(signal.SIGKILL if fate == "killed" else signal.SIGSTOP)
        killed = time.monotonic()
        try:
            survivor.wait(timeout=timeout / 2 if fate == "killed" else timeout + 90)
        except subprocess.TimeoutExpired:
            pytest.fail(f"replica 0 still ran {time.monotonic() - killed:.0f} s after replica "
                        f"1 was {fate} ($POPBERT_REPLICA_TIMEOUT {timeout} s)")
        stopped = time.monotonic() - killed
        print(f"replica 0 stopped {stopped:.1f} s after replica 1 was {fate}")
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
            process.wait()
    stderr = logs[0].read_text()
    assert survivor.returncode != 0
    lines = [line for line in stderr.splitlines() if line.startswith("popbert: error:")]
    assert len(lines) == 1, stderr[-2000:]
    assert "replica 0 of 2" in lines[0], lines[0]
    assert f"; replica 1 died or did not answer within {timeout} s" in lines[0], lines[0]
    assert "Traceback" not in stderr
    print(lines[0])


@pytest.mark.e2e
@pytest.mark.parametrize("missing", [1, 0])
def test_a_replica_that_never_joins_is_named_within_the_timeout(tmp_path: Path,
                                                               missing: int) -> None:
    """One of 2 replicas never starts (a node that is gone, or stopped before it joined): the
    other stops at init_process_group after $POPBERT_REPLICA_TIMEOUT with one line naming it
    (replica 0 missing: the store it would serve is missing too)."""
    timeout, present = 4, 1 - missing
    args = [sys.executable, "-m", "popbert", "pretrain", "--output-dir", str(tmp_path / "run")]
    for item in overrides(execution__replicas=2, execution__gradient_accumulation=2):
        args += ["--set", item]
    env = cli_env(RANK=str(present), LOCAL_RANK=str(present), WORLD_SIZE="2",
                  MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
                  POPBERT_REPLICA_TIMEOUT=str(timeout))
    started = time.monotonic()
    result = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)
    seconds = time.monotonic() - started
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.startswith("popbert: error:")]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
    print(f"replica {present} alone stopped after {seconds:.1f} s: {lines[0]}")
    assert f"replica {present} of 2 could not join the job" in lines[0]
    assert f"; replica {missing} did not join within {timeout} s" in lines[0]
    assert seconds >= timeout  # waited the timeout out (subprocess.run's guards a hang)
    assert not (tmp_path / "run").exists()


def test_replica_count_must_match_the_process_count(monkeypatch, capsys, tmp_path) -> None:
    from popbert.cli.main import main

    args = ["pretrain", "--output-dir", str(tmp_path / "unused")]
    for item in overrides(execution__replicas=4, execution__gradient_accumulation=1):
        args += ["--set", item]
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(args) == 2
    message = capsys.readouterr().err.strip()
    assert message.startswith("popbert: error:") and "\n" not in message
    assert "execution.replicas is 4" in message and "2 processes" in message
    assert "execution.gradient_accumulation=2" in message  # keeps the global batch of 16
    monkeypatch.delenv("WORLD_SIZE")
    assert main(args) == 2
    assert "torchrun --nproc-per-node 4" in capsys.readouterr().err
    assert not (tmp_path / "unused").exists()
