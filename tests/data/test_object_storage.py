"""Pre-training data on object storage: a real S3-compatible server (moto's, its own process on
127.0.0.1, credentials enforced: `tests/s3_server.py`).

Shards read from `s3://` train to the same losses and weights as the same shards on local disk,
bit for bit; a run SIGKILLed and resumed from `s3://` ends as an uninterrupted one; a connection
dropped mid-shard is retried and the download resumes; the cache stays within its limit; a
missing bucket, refused credentials and an unwritable cache are one line with exit status 2;
credentials given in `data.storage_options` appear in no file the run writes.
"""

from __future__ import annotations

import io
import json
import logging
from pathlib import Path

import numpy as np
import pytest
from checkpoint_helpers import kill_after_checkpoint
from s3_server import Relay, s3_server
from s3fs import S3FileSystem
from safetensors.numpy import load_file

from popbert.cli.main import main
from popbert.data import read_shard, storage
from popbert.data.tokenization import bundled_corpus_path, bundled_vocab_path
from popbert.hf.checkpoint import checkpoint_vocab

pytestmark = pytest.mark.e2e

BUCKET = "corpus"
SEQ, PRED = 64, 10
TINY = ["--set", "model.num_layers=1", "--set", "model.hidden_size=32",
        "--set", "model.num_heads=2", "--set", "model.intermediate_size=64",
        "--set", f"model.sequence_length={SEQ}", "--set", f"model.max_predictions_per_seq={PRED}",
        "--set", "execution.micro_batch_size=8", "--set", "training.log_every=1",
        "--set", "optimizer.warmup_steps=2", "--set", "model.hidden_dropout=0.1"]


@pytest.fixture(scope="module")
def server():
    with s3_server() as s:
        yield s


@pytest.fixture(scope="module")
def shards(tmp_path_factory, server) -> Path:
    """Instance shards of the bundled corpus (four parts) on local disk, and the same files
    under s3://corpus/shards/, with the vocabulary beside them."""
    root = tmp_path_factory.mktemp("local")
    documents = bundled_corpus_path().read_text(encoding="utf-8")[:240_000].split("\n\n")
    for i in range(3):
        share = documents[i * len(documents) // 3:(i + 1) * len(documents) // 3]
        (root / f"corpus-{i}.txt").write_text("\n\n".join(share), encoding="utf-8")
    out = root / "shards"
    assert main(["prepare-data", "instances", "--input", str(root / "corpus-*.txt"),
                 "--vocab", str(bundled_vocab_path()), "-o", str(out), "--workers", "1",
                 "--sequence-length", str(SEQ), "--max-predictions", str(PRED),
                 "--dupe-factor", "2", "--seed", "3"]) == 0
    fs = server.filesystem()
    fs.mkdir(BUCKET)
    for part in sorted(out.glob("part-*.h5")):
        fs.put_file(str(part), f"{BUCKET}/shards/{part.name}")
    fs.put_file(str(bundled_vocab_path()), f"{BUCKET}/vocab.txt")
    assert len(list(out.glob("part-*.h5"))) >= 3
    return out


@pytest.fixture
def aws(server, monkeypatch, tmp_path):
    """This process talks to the server through the standard AWS variables; its own cache."""
    for name, value in server.environment().items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("POPBERT_CACHE_DIR", str(tmp_path / "cache"))
    S3FileSystem.clear_instance_cache()  # its clients read the environment when made
    storage.configure()
    yield server
    storage.configure()
    S3FileSystem.clear_instance_cache()


def weights(run: Path, step: int) -> dict[str, np.ndarray]:
    return load_file(str(run / "checkpoints" / f"step-{step:06d}" / "weights.safetensors"))


def losses(run: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").open()
            if '"loss"' in line]


def assert_same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


WIKI = Path(__file__).parent.parent / "fixtures" / "wiki" / "enwiki-fixture-pages-articles.xml.bz2"
STAGES = {"extracted": "jsonl", "sentences": "txt", f"instances-s{SEQ}-p{PRED}": "h5",
          f"packed-s{SEQ}-p{PRED}": "h5"}


def test_prepare_data_to_s3_equals_local(aws, tmp_path):
    """The whole pipeline, dump read from s3:// and every stage written there (each reading
    the stage before from s3://) by two worker processes, gives one local worker's parts; a
    re-run skips them all."""
    fs = aws.filesystem()
    fs.mkdir("prep")
    fs.put_file(str(WIKI), f"prep/{WIKI.name}")
    args = ["--vocab", str(bundled_vocab_path()), "--part-size-mb", "0.02",
            "--sequence-length", str(SEQ), "--max-predictions", str(PRED), "--dupe-factor", "2",
            "--seed", "7"]
    local = tmp_path / "wiki"
    assert main(["prepare-data", "wikipedia", "--input", str(WIKI), "-o", str(local),
                 "--workers", "1", *args]) == 0
    assert main(["prepare-data", "wikipedia", "--input", f"s3://prep/{WIKI.name}",
                 "-o", "s3://prep/wiki", "--workers", "2", *args]) == 0
    for stage, suffix in STAGES.items():
        mine = sorted(local.joinpath(stage).glob(f"part-*.{suffix}"))
        theirs = sorted(fs.glob(f"prep/wiki/{stage}/part-*.{suffix}"))
        assert [p.name for p in mine] == [t.rsplit("/", 1)[1] for t in theirs] and mine, stage
        for a, b in zip(mine, theirs, strict=True):
            if suffix == "h5":
                x, y = read_shard(a), read_shard(f"s3://{b}")
                assert x.keys() == y.keys()
                assert all(np.array_equal(x[k], y[k]) for k in x), b
            else:
                assert a.read_bytes() == fs.cat_file(b), b
        assert fs.isfile(f"prep/wiki/{stage}/_SUCCESS.json")
    assert not [p for p in fs.find("prep/wiki") if ".tmp-" in p]
    before = {p: fs.info(p)["LastModified"] for p in fs.find("prep/wiki")}
    assert main(["prepare-data", "wikipedia", "--input", f"s3://prep/{WIKI.name}",
                 "-o", "s3://prep/wiki", "--workers", "2", *args]) == 0
    assert {p: fs.info(p)["LastModified"] for p in fs.find("prep/wiki")} == before


def test_pretraining_from_s3_equals_local_disk_bit_for_bit(shards, aws, tmp_path):
    steps = ["--set", "training.steps=12", "--set", "training.eval_every=6",
             "--set", "training.eval_batches=2"]
    local, remote = tmp_path / "local", tmp_path / "remote"
    assert main(["pretrain", *TINY, *steps, "-o", str(local),
                 "--set", f"data.input_files=['{shards}/part-0000[1-9].h5']",
                 "--set", f"data.validation_files=['{shards}/part-00000.h5']"]) == 0
    assert main(["pretrain", *TINY, *steps, "-o", str(remote),
                 "--set", f"data.input_files=['s3://{BUCKET}/shards/part-0000[1-9].h5']",
                 "--set", f"data.validation_files=['s3://{BUCKET}/shards/part-00000.h5']",
                 "--set", f"data.vocab_file=s3://{BUCKET}/vocab.txt"]) == 0
    assert losses(local) == losses(remote) and len(losses(local)) == 12
    evals = [[json.loads(line).get("val_loss") for line in (run / "metrics.jsonl").open()
              if "val_loss" in line] for run in (local, remote)]
    assert evals[0] == evals[1] and len(evals[0]) == 2
    assert_same_weights(weights(local, 12), weights(remote, 12))
    # What export and fine-tuning read as the checkpoint's vocabulary: the remote one's copy.
    vocab = checkpoint_vocab(remote, f"s3://{BUCKET}/vocab.txt")
    assert vocab is not None and vocab.read_bytes() == bundled_vocab_path().read_bytes()


def test_a_run_killed_and_resumed_from_s3_ends_bit_identical(shards, aws, tmp_path):
    data = ["--set", f"data.input_files=['s3://{BUCKET}/shards/part-*.h5']",
            "--set", "training.steps=16", "--set", "training.checkpoint_every=4"]
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    assert main(["pretrain", *TINY, *data, "-o", str(straight)]) == 0
    kill_after_checkpoint(["pretrain", *TINY, *data, "-o", str(killed)], killed, 4)
    assert main(["pretrain", "--resume", str(killed), "-o", str(killed)]) == 0
    assert_same_weights(weights(straight, 16), weights(killed, 16))


def test_a_connection_dropped_mid_shard_is_retried_and_resumes(shards, aws, monkeypatch):
    """The relay cuts every connection after 60 KB of a shard and refuses connections for a
    second (the server stopped and started): the download goes on from where it was."""
    port = int(aws.endpoint.rsplit(":", 1)[1])
    proxy = Relay(port, drop_after=60_000, down_s=1.0)
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        S3FileSystem.clear_instance_cache()  # its clients read the environment when made
        monkeypatch.setattr(storage, "CHUNK_BYTES", 16 << 10)
        monkeypatch.setattr(storage, "FIRST_PAUSE_S", 0.2)
        part = max(shards.glob("part-*.h5"), key=lambda p: p.stat().st_size)
        assert part.stat().st_size > 120_000
        arrays = read_shard(f"s3://{BUCKET}/shards/{part.name}")
        assert proxy.dropped.is_set()
    finally:
        proxy.close()
    expected = read_shard(part)
    assert all(np.array_equal(arrays[k], expected[k]) for k in expected)
    cached = list((storage.shard_cache().root).glob(f"*-{part.name}"))
    assert len(cached) == 1 and cached[0].read_bytes() == part.read_bytes()


class FlakyObject(io.BytesIO):
    """A remote file whose connection drops after `cut` bytes."""

    def __init__(self, data: bytes, cut: int | None):
        super().__init__(data)
        self.cut = cut

    def read(self, size: int = -1) -> bytes:
        if self.cut is not None and self.tell() + max(size, 0) > self.cut:
            raise ConnectionResetError("connection reset by peer")
        return super().read(size)


class FlakyFilesystem:
    """Stands in for an fsspec filesystem: the first `drops` opens fail mid-file."""

    def __init__(self, data: bytes, drops: int):
        self.data, self.drops, self.starts = data, drops, []

    def info(self, path: str) -> dict:
        return {"size": len(self.data), "ETag": "e1"}

    def open(self, path: str, mode: str = "rb", **kwargs) -> FlakyObject:
        cut = len(self.data) * (len(self.starts) + 1) // (self.drops + 2) if self.drops else None
        self.drops -= bool(self.drops)
        handle = FlakyObject(self.data, cut)
        real_seek = handle.seek

        def seek(offset: int, whence: int = 0) -> int:
            self.starts.append(offset)
            return real_seek(offset, whence)

        handle.seek = seek  # type: ignore[method-assign]
        return handle


def test_a_download_resumes_from_where_each_drop_left_it(tmp_path, monkeypatch, caplog):
    data = np.random.default_rng(0).bytes(100_000)
    fake = FlakyFilesystem(data, drops=2)
    monkeypatch.setattr(storage, "filesystem", lambda url: (fake, url))
    monkeypatch.setattr(storage, "CHUNK_BYTES", 4096)
    monkeypatch.setattr(storage, "FIRST_PAUSE_S", 0.0)
    cache = storage.ShardCache(tmp_path / "cache", 10**9)
    with caplog.at_level(logging.WARNING, logger="popbert.data.storage"):
        local = cache.fetch("s3://b/part-00000.h5")
    assert local.read_bytes() == data
    assert fake.starts[0] == 0 and 0 < fake.starts[1] < fake.starts[2] < len(data)
    assert caplog.text.count("retrying") == 2


def test_the_cache_stays_within_its_limit(shards, aws, tmp_path):
    sizes = sorted(p.stat().st_size for p in shards.glob("part-*.h5"))
    limit = sizes[-1] + sizes[-2]  # room for two shards: the one read and the one ahead
    cache = tmp_path / "bounded"
    assert main(["pretrain", *TINY, "-o", str(tmp_path / "run"), "--set", "training.steps=30",
                 "--set", f"data.input_files=['s3://{BUCKET}/shards/part-*.h5']",
                 "--set", f"data.cache_dir={cache}", "--set", f"data.cache_limit={limit}"]) == 0
    held = [p.stat().st_size for p in cache.iterdir() if not p.name.startswith(".")]
    assert held and sum(held) <= limit
    assert not [p for p in cache.iterdir() if ".tmp-" in p.name]


@pytest.mark.parametrize("case", ["no_bucket", "bad_secret", "cache_unwritable"])
def test_bad_storage_is_one_line_and_exit_2(case, shards, aws, monkeypatch, tmp_path, capsys):
    inputs = f"s3://{BUCKET}/shards/part-*.h5"
    extra: list[str] = []
    if case == "no_bucket":
        inputs = "s3://no-such-bucket/shards/part-*.h5"
        expected = "no-such-bucket"
    elif case == "bad_secret":
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
        expected = "access refused"
    else:
        blocker = tmp_path / "a-file"
        blocker.write_text("x")
        extra = ["--set", f"data.cache_dir={blocker}/cache"]
        expected = "data.cache_dir"
    monkeypatch.setattr(storage, "FIRST_PAUSE_S", 0.01)
    run = tmp_path / "run"
    assert main(["pretrain", *TINY, "-o", str(run), "--set", "training.steps=2",
                 "--set", f"data.input_files=['{inputs}']", *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and expected in err[0] and "Traceback" not in err[0], err
    assert not run.exists()


def test_credentials_in_storage_options_are_written_nowhere(shards, aws, monkeypatch, tmp_path,
                                                            caplog):
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(name)
    options = json.dumps({"key": aws.key_id, "secret": aws.secret,
                          "endpoint_url": aws.endpoint})
    run = tmp_path / "run"
    with caplog.at_level(logging.DEBUG):
        assert main(["pretrain", *TINY, "-o", str(run), "--set", "training.steps=4",
                     "--set", "training.checkpoint_every=2",
                     "--set", f"data.input_files=['s3://{BUCKET}/shards/part-*.h5']",
                     "--set", f"data.storage_options={options}"]) == 0
    written = [p for p in run.rglob("*") if p.is_file()]
    assert any(p.name == "config.yaml" for p in written) and len(written) > 8
    for path in written:
        data = path.read_bytes()
        assert aws.secret.encode() not in data and aws.key_id.encode() not in data, path
    assert aws.secret not in caplog.text and aws.key_id not in caplog.text
    assert aws.endpoint in (run / "config.yaml").read_text()  # not a secret: kept


@pytest.mark.parametrize("case", ["output_bucket", "input_bucket", "output_secret"])
def test_prepare_data_with_bad_storage_is_one_line_and_exit_2(case, aws, monkeypatch,
                                                              capsys):
    source, output, expected = str(WIKI), "s3://prep-out/wiki", "no-such-bucket"
    if case == "output_bucket":
        output = "s3://no-such-bucket/wiki"
    elif case == "input_bucket":
        source = "s3://no-such-bucket/dump.xml.bz2"
        aws.filesystem().mkdir("prep-out")
    else:
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
        expected = "access refused"
    monkeypatch.setattr(storage, "FIRST_PAUSE_S", 0.01)
    assert main(["prepare-data", "wikipedia", "--input", source, "-o", output,
                 "--vocab", str(bundled_vocab_path()), "--sequence-length", str(SEQ),
                 "--max-predictions", str(PRED)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and expected in err[0] and "Traceback" not in err[0], err


def test_dask_workers_without_the_storages_credentials_are_named_without_retries(aws,
                                                                                 tmp_path,
                                                                                 capsys):
    """This machine reaches the bucket; the worker has no credentials at all. The check
    before the first unit names that worker, on the first refusal: the line says the access
    was refused, not that the storage failed after its attempts, and the worker logged no
    retry."""
    from dask_cluster import DaskCluster

    aws.filesystem().mkdir("dask-out")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("One sentence here. Another one.\n\nA second document. Yes.\n")
    cluster = DaskCluster(tmp_path / "cluster")
    try:
        cluster.add_worker("bare", env={"AWS_ACCESS_KEY_ID": None, "AWS_SECRET_ACCESS_KEY": None,
                                        "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none"),
                                        "AWS_CONFIG_FILE": str(tmp_path / "none")})
        worker = cluster.worker_address("bare")
        assert main(["prepare-data", "sentences", "--input", str(corpus), "--format", "lines",
                     "-o", "s3://dask-out/sentences", "--dask", cluster.address,
                     "--dask-wait", "30"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "Traceback" not in err[0], err
        assert (f"--dask: the Dask worker {worker} cannot reach the output: s3://dask-out: "
                f"access refused (Unable to locate credentials)") in err[0]
        assert "attempts" not in err[0] and "retrying" not in cluster.log("bare")
        assert not aws.filesystem().ls("dask-out")  # nothing written
    finally:
        cluster.close()
