"""`popbert.data.storage` without a server: fsspec's own in-memory filesystem (`memory://`)
stands in for a bucket, so the URL handling, the shard cache's naming and eviction and the
config keys are checked in milliseconds (the real S3 server: test_object_storage.py)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import fsspec
import numpy as np
import pytest

from popbert.cli.main import main
from popbert.config import ConfigError, load_config
from popbert.config.sections import without_secrets
from popbert.data import DataError, read_shard, storage, write_shard
from popbert.data.corpus import expand_input_files


@pytest.fixture
def bucket():
    fs = fsspec.filesystem("memory")
    fs.mkdir("/bucket")
    yield fs
    fs.rm("/bucket", recursive=True)


def test_urls_stay_text_and_file_urls_are_paths(tmp_path):
    assert storage.location("s3://b/k/part-1.h5") == "s3://b/k/part-1.h5"
    assert storage.location(f"file://{tmp_path}/x.h5") == tmp_path / "x.h5"
    assert storage.location("rel/x.h5") == Path("rel/x.h5")
    assert storage.join("s3://b/k/", "part-1.h5") == "s3://b/k/part-1.h5"
    assert storage.join(tmp_path, "a") == tmp_path / "a"
    assert storage.name_of("s3://b/k/part-1.h5") == "part-1.h5"
    assert not storage.is_url("file:///x") and storage.is_url("gs://b/x")


def test_input_files_glob_urls_and_file_urls(bucket, tmp_path):
    for name in ("b.txt", "a.txt", "c.json"):
        bucket.pipe(f"/bucket/corpus/{name}", b"one sentence.\n")
    (tmp_path / "local.txt").write_text("x\n")
    files = expand_input_files(["memory://bucket/corpus/*.txt", f"file://{tmp_path}/local.txt"])
    # fsspec names memory paths from its root (memory:///...); for s3 it is s3://bucket/...
    assert files == ["memory:///bucket/corpus/a.txt", "memory:///bucket/corpus/b.txt",
                     tmp_path / "local.txt"]
    with pytest.raises(DataError, match="no input files match"):
        expand_input_files("memory://bucket/corpus/*.h5")
    with pytest.raises(DataError, match="not found"):
        expand_input_files("memory://bucket/corpus/missing.txt")
    with pytest.raises(DataError, match="no storage handles nosuch://"):
        expand_input_files("nosuch://bucket/x.txt")


def shard(rows: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"input_ids": rng.integers(5, 90, (rows, 16)), "input_mask": np.ones((rows, 16)),
            "segment_ids": np.zeros((rows, 16)), "masked_lm_positions": np.ones((rows, 2)),
            "masked_lm_ids": rng.integers(5, 90, (rows, 2)),
            "next_sentence_labels": np.zeros(rows)}


def test_shards_written_to_and_read_from_a_url(bucket, tmp_path, monkeypatch):
    monkeypatch.setenv("POPBERT_CACHE_DIR", str(tmp_path / "cache"))
    storage.configure()
    arrays = shard(40, 0)
    write_shard("memory://bucket/shards/part-00000.h5", arrays)
    assert bucket.ls("/bucket/shards", detail=False) == ["/bucket/shards/part-00000.h5"]
    back = read_shard("memory://bucket/shards/part-00000.h5")
    assert np.array_equal(back["input_ids"], arrays["input_ids"])
    assert not list((tmp_path / "cache" / "spool").iterdir())  # published, nothing left


def test_the_cache_refetches_a_changed_object_and_evicts_the_least_recently_used(bucket,
                                                                                  tmp_path):
    for i in range(3):
        bucket.pipe(f"/bucket/s/{i}.h5", bytes([i]) * 1000)
    cache = storage.ShardCache(tmp_path / "cache", limit=2500)
    first = cache.fetch("memory://bucket/s/0.h5")
    cache.release(first)
    os.utime(first, (time.time() - 60, time.time() - 60))  # used long ago
    second = cache.fetch("memory://bucket/s/1.h5")
    cache.release(second)
    third = cache.fetch("memory://bucket/s/2.h5")  # pinned: not read yet
    assert not first.exists() and second.exists() and third.exists()
    assert sum(p.stat().st_size for p in (tmp_path / "cache").iterdir()) <= 2500
    bucket.pipe("/bucket/s/1.h5", b"changed" * 300)  # another size (and creation time)
    again = cache.fetch("memory://bucket/s/1.h5")
    assert again != second and again.read_bytes() == b"changed" * 300
    assert third.exists()  # still pinned: never evicted before it is read


def test_an_unwritable_cache_is_one_line_naming_it(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(DataError, match="the shard cache cannot be written.*data.cache_dir"):
        storage.ShardCache(blocker / "cache", 10)


@pytest.mark.parametrize("text, size", [("20GB", 20 * 10**9), ("512MiB", 512 << 20),
                                        ("1.5e9", 1_500_000_000), (3000, 3000)])
def test_cache_limit_takes_sizes(text, size):
    assert load_config("tiny", [f"data.cache_limit={text}"]).data.cache_limit == size


@pytest.mark.parametrize("text", ["lots", "-1GB", "0", "true"])
def test_a_bad_cache_limit_is_one_line_naming_the_key(text):
    with pytest.raises(ConfigError, match="data.cache_limit: expected a size"):
        load_config("tiny", [f"data.cache_limit={text}"])


def test_credentials_are_left_out_of_what_a_config_writes():
    options = {"key": "AKIA", "secret": "s3cr3t", "endpoint_url": "http://x",
               "client_kwargs": {"aws_session_token": "t", "region_name": "eu"},
               "account_key": "k", "sas_token": "s", "anon": False}
    assert without_secrets(options) == {"endpoint_url": "http://x",
                                        "client_kwargs": {"region_name": "eu"}, "anon": False}
    cfg = load_config("tiny", ["data.storage_options={key: AKIA, secret: s3cr3t, "
                               "endpoint_url: 'http://x'}"])
    assert cfg.data.storage_options["secret"] == "s3cr3t"  # used by the run
    assert cfg.to_dict()["data"]["storage_options"] == {"endpoint_url": "http://x"}


def _botocore(name: str) -> Exception:
    """One of botocore's own errors, as s3fs lets it through."""
    from botocore import exceptions

    if name == "ParamValidationError":
        return exceptions.ParamValidationError(report='Invalid bucket name "bu*ck"')
    if name == "EndpointConnectionError":
        return exceptions.EndpointConnectionError(endpoint_url="http://127.0.0.1:9")
    return getattr(exceptions, name)()


@pytest.mark.parametrize("error, attempts, said", [
    (lambda: ConnectionResetError("reset by peer"), storage.ATTEMPTS, "after 6 attempts"),
    (lambda: TimeoutError("timed out"), storage.ATTEMPTS, "after 6 attempts"),
    (lambda: OSError(5, "InternalError: please retry"), storage.ATTEMPTS, "after 6 attempts"),
    (lambda: _botocore("EndpointConnectionError"), storage.ATTEMPTS, "after 6 attempts"),
    (lambda: _botocore("NoCredentialsError"), 1, "access refused (Unable to locate credentials)"),
    (lambda: _botocore("ParamValidationError"), 1, "reading failed (Parameter validation"),
    (lambda: PermissionError("Access Denied"), 1, "access refused"),
    (lambda: FileNotFoundError("The specified bucket does not exist"), 1, "not found"),
    (lambda: ValueError("Cannot traverse all of S3"), 1, "reading failed (Cannot traverse"),
], ids=["reset", "timeout", "server-error", "endpoint", "no-credentials", "bad-name",
        "refused", "no-bucket", "malformed"])
def test_only_what_can_pass_on_a_retry_is_retried(error, attempts, said, monkeypatch, caplog):
    monkeypatch.setattr(storage, "FIRST_PAUSE_S", 0.0)
    calls = []

    def operation():
        calls.append(1)
        raise error()

    with pytest.raises(DataError) as raised:
        storage.with_retries(operation, "s3://bucket/key")
    assert len(calls) == attempts
    assert caplog.text.count("retrying in") == attempts - 1
    message = str(raised.value)
    assert message.startswith("s3://bucket/key: ") and said in message and "\n" not in message


@pytest.mark.parametrize("url", ["s3://bu*ck/key", "s3://logs-?/x/part-*.h5", "gs://[ab]/x",
                                 "s3:///key"])
def test_a_malformed_bucket_is_refused_before_any_request(url, monkeypatch):
    def no_request(*args, **kwargs):
        raise AssertionError("a filesystem was made for a malformed bucket")

    monkeypatch.setattr(fsspec.core, "url_to_fs", no_request)
    for operation in (storage.expand, storage.check_reachable, storage.exists):
        with pytest.raises(DataError, match="bucket"):
            operation(url)


def test_a_key_may_be_a_pattern_and_memory_urls_have_no_bucket(bucket):
    storage.check_bucket("s3://bucket/logs-*/part-?.h5")
    storage.check_bucket("memory://any*/thing")  # not a bucket store: its paths may glob


@pytest.mark.parametrize("flag, value", [("--input", "s3://bu*ck/x/*.txt"),
                                         ("--output-dir", "s3://bu*ck/out")])
def test_a_glob_in_a_bucket_name_is_one_line_naming_the_flag(flag, value, tmp_path, capsys):
    text = tmp_path / "a.txt"
    text.write_text("One sentence. Another one.\n")
    given = {"--input": str(text), "--output-dir": str(tmp_path / "out"), flag: value}
    assert main(["prepare-data", "sentences", "--format", "lines", *given_args(given)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "retrying" not in err[0], err
    assert f"{flag}: {value}: the bucket name 'bu*ck' holds a glob character" in err[0]
    assert not (tmp_path / "out").exists()


def given_args(flags: dict[str, str]) -> list[str]:
    return [item for pair in flags.items() for item in pair]
