"""Data on object storage: fsspec URLs wherever popbert reads or writes data, and the shard cache.

A data path with a scheme (`s3://`, `gs://`, `az://`, `http(s)://`, ...) goes through fsspec;
`file://` and plain paths are local. Credentials and endpoints come from the storage's own
configuration (for S3 the `AWS_*` environment variables, `AWS_ENDPOINT_URL` included, or
`~/.aws`), or from `data.storage_options` (`configure`), which is passed to every filesystem;
the run's config leaves its secrets out of everything it writes (`popbert.config`).

Object stores have no rename, so nothing is written in place: a file is made locally and
published as one object (`publish`: a PUT, which the store makes visible whole or not at all).
Shards are read through `ShardCache`, a bounded local directory of whole files: the loader's
read-ahead thread fetches the next shards into it while the current one trains. Every remote
operation is retried with backoff when the connection fails (`with_retries`; a download resumes
where it stopped), and what still fails is one `DataError` line naming the URL.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import IO, Any, TypeVar

from popbert.data.errors import DataError
from popbert.errors import one_line

log = logging.getLogger(__name__)

T = TypeVar("T")

#: A data path: a local `Path`, or an fsspec URL kept as text (`Path` would turn `s3://b/k`
#: into `s3:/b/k`).
Location = Path | str

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)://")
LOCAL_SCHEMES = ("file", "local")

#: Attempts of one remote operation, and the first pause between them (doubling, at most 8 s):
#: about half a minute in all, enough for a restarted server or a dropped connection.
ATTEMPTS = 6
FIRST_PAUSE_S = 0.5
#: Bytes read per request when downloading a shard; a dropped download resumes from the last one.
CHUNK_BYTES = 8 << 20
#: Read-ahead of a remote HDF5 file opened for its metadata: its few small reads then cost one
#: or two requests instead of the whole (possibly GB-sized) file.
METADATA_BLOCK_BYTES = 256 << 10
#: `data.cache_limit`'s default: room for many shards, little of a training machine's disk.
DEFAULT_CACHE_LIMIT = 20 * 10**9

_options: dict[str, Any] = {}
_cache: ShardCache | None = None
_cache_root: Path | None = None  # None: default_cache_dir() / "shards"
_cache_limit: int = DEFAULT_CACHE_LIMIT
_lock = threading.Lock()

# ---------------------------------------------------------------------------------- URLs
def scheme(path: str | os.PathLike) -> str | None:
    """The URL scheme of a path (`s3`), None for a plain path."""
    match = _SCHEME.match(os.fspath(path))
    return match.group(1).lower() if match else None


def is_url(path: str | os.PathLike) -> bool:
    """Whether `path` names remote storage (a scheme other than `file://`)."""
    found = scheme(path)
    return found is not None and found not in LOCAL_SCHEMES


def location(path: str | os.PathLike) -> Location:
    """A URL stays text; `file://x` and plain paths become a `Path`."""
    text = os.fspath(path)
    if is_url(text):
        return text
    if scheme(text) in LOCAL_SCHEMES:
        return Path(text.split("://", 1)[1])
    return Path(text)


def join(base: Location, *names: str) -> Location:
    """`base / name` for a local path or a URL."""
    if isinstance(base, Path):
        return base.joinpath(*names)
    return "/".join([base.rstrip("/"), *names])


def name_of(path: Location) -> str:
    """The last component of a path or URL."""
    return path.name if isinstance(path, Path) else path.rstrip("/").rsplit("/", 1)[-1]


# ---------------------------------------------------------------------------------- options
def configure(options: Mapping[str, Any] | None = None, cache_dir: str | os.PathLike | None
              = None, cache_limit: int | None = None) -> None:
    """Set the storage options every filesystem gets and where the shard cache lives, for the
    whole process (the loader's read-ahead thread and the run share them). The cache directory
    is made on first use (`shard_cache`)."""
    global _cache, _cache_root, _cache_limit
    with _lock:
        _options.clear()
        _options.update(dict(options or {}))
        _cache_root = Path(cache_dir) if cache_dir is not None else None
        _cache_limit = cache_limit if cache_limit is not None else DEFAULT_CACHE_LIMIT
        _cache = None


def _fresh(url: str) -> tuple[Any, str]:
    """`filesystem(url)` with its listings of `url` forgotten: fsspec caches directory listings
    per process, and other processes (a stage's workers) write parts behind its back."""
    import glob as globlib

    fs, inner = filesystem(url)
    parts = inner.split("/")
    plain = next((i for i, part in enumerate(parts) if globlib.has_magic(part)), len(parts))
    fs.invalidate_cache("/".join(parts[:plain]))  # that path, and the directories above it
    return fs, inner


def filesystem(url: str) -> tuple[Any, str]:
    """(fsspec filesystem, path within it) for a URL, built with the configured options."""
    import fsspec

    check_bucket(url)
    try:
        return fsspec.core.url_to_fs(url, **_options)
    except ImportError as exc:
        raise DataError(f"{url}: reading {scheme(url)}:// needs a package that is not "
                        f"installed ({one_line(exc, 200)})") from None
    except ValueError as exc:
        raise DataError(f"{url}: no storage handles {scheme(url)}:// "
                        f"({one_line(exc, 200)})") from None
    except TypeError as exc:  # an option the backend does not take
        raise DataError(f"{url}: data.storage_options do not suit {scheme(url)}:// "
                        f"({one_line(exc, 200)})") from None


#: Schemes whose URL's first component is a bucket (or container), named, never a pattern.
BUCKET_SCHEMES = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "oss"})


def check_bucket(url: str) -> None:
    """Refuse a bucket (container) name holding a glob character: stores list keys, not
    buckets, so `s3://logs-*/x` can only fail, and no retry makes it pass."""
    import glob as globlib

    found = scheme(url)
    if found not in BUCKET_SCHEMES:
        return
    bucket = url.split("://", 1)[1].split("/", 1)[0]
    if not bucket:
        raise DataError(f"{url}: no bucket named ({found}://BUCKET/KEY expected)")
    if globlib.has_magic(bucket):
        raise DataError(f"{url}: the bucket name {bucket!r} holds a glob character (* ? [); "
                        f"only the key after it may be a pattern")


def full_url(fs: Any, path: str) -> str:
    """A filesystem path as a URL again (`fs.glob` returns paths without the scheme)."""
    return fs.unstrip_protocol(path)


# ---------------------------------------------------------------------------------- retries
#: Exception class names (anywhere in an error's class hierarchy) that mean the connection or
#: the server failed for now: botocore's, aiohttp's, requests', Azure's and fsspec's, matched
#: by name so that none of those optional packages is imported to classify an error.
_TRANSIENT_NAMES = frozenset({
    "ConnectionError", "ConnectionClosedError", "EndpointConnectionError",
    "ConnectTimeoutError", "ReadTimeoutError", "ClientConnectionError", "ClientPayloadError",
    "ServerDisconnectedError", "ServerTimeoutError", "IncompleteRead", "FSTimeoutError",
    "ResponseStreamingError", "ServiceRequestError", "ServiceResponseError", "ProtocolError",
    "Timeout", "TimeoutError", "ChunkedEncodingError"})
#: errno values of an OSError that a later attempt can pass: the server's 5xx (s3fs says EIO),
#: a busy or unreachable peer.
_TRANSIENT_ERRNOS = frozenset({errno.EIO, errno.EAGAIN, errno.EBUSY, errno.ETIMEDOUT,
                               errno.ECONNRESET, errno.ECONNREFUSED, errno.ECONNABORTED,
                               errno.EHOSTUNREACH, errno.ENETUNREACH, errno.ENETDOWN,
                               errno.EPIPE})
#: Class names of refused or missing credentials (botocore's `NoCredentialsError`, ...).
_CREDENTIAL_NAMES = frozenset({"NoCredentialsError", "PartialCredentialsError",
                               "CredentialRetrievalError", "ClientAuthenticationError",
                               "DefaultCredentialsError", "RefreshError"})


def transient(exc: BaseException) -> bool:
    """Whether `exc` can pass on a retry: a dropped or refused connection, a timeout, a server
    error. A malformed URL, a missing bucket or object and refused or missing credentials
    cannot, and are never retried."""
    if isinstance(exc, (FileNotFoundError, PermissionError, IsADirectoryError,
                        NotADirectoryError, DataError)):
        return False
    names = {cls.__name__ for cls in type(exc).__mro__}
    if names & _CREDENTIAL_NAMES:
        return False
    if isinstance(exc, (ConnectionError, TimeoutError)) or names & _TRANSIENT_NAMES:
        return True
    return isinstance(exc, OSError) and exc.errno in _TRANSIENT_ERRNOS


def _explain(url: str, exc: BaseException, what: str, attempts: int) -> DataError:
    """The one line for an operation that failed for good."""
    reason = one_line(exc, 300)
    names = {cls.__name__ for cls in type(exc).__mro__}
    if isinstance(exc, PermissionError) or names & _CREDENTIAL_NAMES:
        return DataError(f"{url}: access refused ({reason}); check the credentials (for S3 "
                         f"AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, or data.storage_options)")
    if isinstance(exc, FileNotFoundError):
        return DataError(f"{url}: not found ({reason})")
    if isinstance(exc, DataError):
        return exc
    if attempts > 1:
        return DataError(f"{url}: the storage failed after {attempts} attempts ({reason})")
    return DataError(f"{url}: {what} failed ({reason})")


def with_retries(operation: Callable[[], T], url: str, what: str = "reading") -> T:
    """`operation()`, retried with backoff while the failure is `transient` (the connection,
    a timeout, the server); anything else, or the last transient failure, is one `DataError`
    naming `url`."""
    pause = FIRST_PAUSE_S
    for attempt in range(1, ATTEMPTS + 1):
        try:
            return operation()
        except Exception as exc:
            if attempt == ATTEMPTS or not transient(exc):
                raise _explain(url, exc, what, attempt) from None
            log.warning("%s %s failed (%s); retrying in %.1f s (attempt %d of %d)", what, url,
                        one_line(exc, 200), pause, attempt + 1, ATTEMPTS)
            time.sleep(pause)
            pause = min(2 * pause, 8.0)
    raise AssertionError("unreachable")


# ---------------------------------------------------------------------------------- reading
def expand(pattern: str) -> list[str]:
    """The URLs a remote path or glob names, sorted: files only. None, or a directory (a
    prefix holding objects) among a glob's matches, is a `DataError` naming it."""
    fs, path = _fresh(pattern)
    import glob as globlib

    if globlib.has_magic(path):
        found = with_retries(lambda: fs.glob(path, detail=True), pattern, "listing")
        directories = sorted(p for p, info in found.items() if _is_dir(info))
        if directories:
            raise DataError(f"{pattern}: matches the directory {full_url(fs, directories[0])}; "
                            f"a glob must match files only")
        if not found:
            raise DataError(f"{pattern}: no input files match this pattern")
        return [full_url(fs, p) for p in sorted(found)]
    if not with_retries(lambda: fs.isfile(path), pattern, "checking"):
        exists = with_retries(lambda: fs.exists(path), pattern, "checking")
        found = "a directory, not a file" if exists else "input file not found"
        raise DataError(f"{pattern}: {found}")
    return [pattern]


def _is_dir(info: Mapping[str, Any]) -> bool:
    return info.get("type") == "directory"


def exists(path: Location) -> bool:
    """Whether a file exists at a local path or URL."""
    if isinstance(path, Path):
        return path.is_file()
    fs, inner = _fresh(path)
    return bool(with_retries(lambda: fs.isfile(inner), path, "checking"))


def list_parts(directory: Location, pattern: str, directories: bool = False
               ) -> list[Location]:
    """Files named `pattern` (a glob) in a local directory or under a URL prefix, sorted. A
    directory matching it is a `DataError` naming it (`directories=True`: listed too)."""
    if isinstance(directory, Path):
        found = sorted(directory.glob(pattern))
        stray = next((p for p in found if p.is_dir()), None) if not directories else None
        if stray is not None:
            raise DataError(f"{stray}: a directory where {directory} holds {pattern} files")
        return found
    fs, inner = _fresh(directory)
    listed = with_retries(lambda: fs.glob(f"{inner.rstrip('/')}/{pattern}", detail=True),
                          directory, "listing")
    stray = next((p for p, info in sorted(listed.items()) if _is_dir(info)), None)
    if stray is not None and not directories:
        raise DataError(f"{full_url(fs, stray)}: a directory where {directory} holds "
                        f"{pattern} files")
    return sorted(full_url(fs, p) for p in listed)


def size(path: Location) -> int:
    """Bytes in a local file or remote object."""
    if isinstance(path, Path):
        return path.stat().st_size
    fs, inner = _fresh(path)
    return int(with_retries(lambda: fs.size(inner), path, "checking"))


def is_directory(path: Location) -> bool:
    """Whether a local directory, or a URL prefix holding objects, is there."""
    if isinstance(path, Path):
        return path.is_dir()
    fs, inner = _fresh(path)
    return bool(with_retries(lambda: fs.isdir(inner), path, "checking"))


@contextlib.contextmanager
def open_input(path: Location, mode: str = "rb", **kwargs: Any) -> Iterator[IO]:
    """A local file or remote object opened for reading (text with `mode="r"` and `encoding`)."""
    if isinstance(path, Path) or not is_url(path):
        with open(Path(path), mode, **kwargs) as f:
            yield f
        return
    fs, inner = filesystem(path)
    raw = with_retries(lambda: fs.open(inner, "rb", block_size=CHUNK_BYTES), path, "opening")
    with raw:
        if "b" in mode:
            yield raw
        else:
            with io.TextIOWrapper(raw, **kwargs) as text:
                yield text


def open_metadata(url: str) -> IO[bytes]:
    """A remote file opened for a few small random reads (an HDF5 file's metadata): small
    blocks, so reading a shard's shapes does not download the shard."""
    fs, inner = filesystem(url)
    return with_retries(lambda: fs.open(inner, "rb", block_size=METADATA_BLOCK_BYTES,
                                        cache_type="readahead"), url, "opening")


def read_bytes(path: Location) -> bytes:
    """The whole content of a (small) local file or remote object."""
    if isinstance(path, Path):
        return path.read_bytes()
    fs, inner = filesystem(path)
    return with_retries(lambda: fs.cat_file(inner), path)


def local_file(path: Location) -> Path:
    """A local path to read: itself, or a remote object's copy in the shard cache."""
    if isinstance(path, Path) or not is_url(path):
        return Path(location(path))
    return shard_cache().fetch(path)


# ---------------------------------------------------------------------------------- writing
def publish(local: Path, destination: Location) -> None:
    """Make the finished local file `local` appear whole at `destination`: a local rename after
    fsync, or one PUT of the object (retried; the store shows it whole or not at all).
    `local` is gone afterwards either way."""
    if isinstance(destination, Path):
        from popbert.atomic import reported

        try:
            with reported(destination):  # a full disk: one line naming the output
                with open(local, "rb") as f:
                    os.fsync(f.fileno())
                os.replace(local, destination)
        finally:
            with contextlib.suppress(FileNotFoundError):
                local.unlink()
        return
    fs, inner = filesystem(destination)
    try:
        with_retries(lambda: fs.put_file(os.fspath(local), inner), destination, "writing")
    finally:
        with contextlib.suppress(FileNotFoundError):
            local.unlink()


def write_bytes(destination: Location, data: bytes) -> None:
    """Write a small file whole (a record, a vocabulary): local atomically, remote as one PUT."""
    if isinstance(destination, Path):
        from popbert.atomic import atomic_write_bytes

        atomic_write_bytes(destination, data)
        return
    fs, inner = filesystem(destination)
    with_retries(lambda: fs.pipe_file(inner, data), destination, "writing")


def remove(path: Location) -> None:
    """Delete a file or object; a missing one is fine."""
    if isinstance(path, Path):
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        return
    fs, inner = filesystem(path)
    with contextlib.suppress(FileNotFoundError):
        with_retries(lambda: fs.rm_file(inner), path, "deleting")


def check_reachable(url: str) -> None:
    """Fail now, in one line, when a URL's bucket (or container) is missing or refuses the
    credentials, rather than when the first result is written."""
    fs, inner = filesystem(url)
    bucket = inner.strip("/").split("/", 1)[0]
    with_retries(lambda: fs.ls(bucket), full_url(fs, bucket), "checking")


def temp_path(destination: Location) -> Path:
    """A local temporary name to make `destination` under before `publish`: a hidden sibling
    (never matching a stage's `part-*` globs), or for a URL a file in the local spool."""
    if isinstance(destination, Path):
        return destination.with_name(f".{destination.name}.tmp-{os.getpid()}")
    return spool_dir() / f".{name_of(destination)}.tmp-{os.getpid()}"


def spool_dir() -> Path:
    """Local scratch for files made before they are published to object storage."""
    path = default_cache_dir() / "spool"
    path.mkdir(parents=True, exist_ok=True)
    return path


# ---------------------------------------------------------------------------------- the cache
def default_cache_dir() -> Path:
    """`$POPBERT_CACHE_DIR`, else `$XDG_CACHE_HOME/popbert`, else `~/.cache/popbert`."""
    if os.environ.get("POPBERT_CACHE_DIR"):
        return Path(os.environ["POPBERT_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "popbert"


class ShardCache:
    """Whole remote files in a local directory holding at most about `limit` bytes.

    A file is named by a hash of its URL, size and ETag (or modification time), so a changed
    object is fetched again and never read stale. It is downloaded under a temporary name in
    `CHUNK_BYTES` reads, resuming where a dropped connection stopped, and renamed when whole,
    so a kill leaves no partial file under a cache name. After each fetch the least recently
    used files go until the cache fits its limit; files this process fetched and has not read
    yet stay (`pinned`). Processes may share the directory: each publishes by rename, and a
    file evicted by another between fetch and open is fetched again."""

    def __init__(self, root: Path, limit: int):
        self.root = Path(root)
        self.limit = int(limit)
        self._pinned: dict[Path, int] = {}
        self._guard = threading.Lock()
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            probe = self.root / f".probe-{os.getpid()}-{threading.get_ident()}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as exc:
            raise DataError(f"{self.root}: the shard cache cannot be written "
                            f"({one_line(exc, 200)}); set data.cache_dir to a writable "
                            f"directory") from None

    def _target(self, url: str, info: Mapping[str, Any]) -> Path:
        tag = next((info[k] for k in ("ETag", "etag", "mtime", "LastModified", "last_modified",
                                      "created") if info.get(k)), "")
        key = hashlib.sha256(f"{url}\0{info.get('size')}\0{tag}".encode()).hexdigest()[:24]
        return self.root / f"{key}-{name_of(url)}"

    def fetch(self, url: str) -> Path:
        """The local copy of `url`, downloaded unless already cached."""
        fs, inner = filesystem(url)
        info = with_retries(lambda: fs.info(inner), url)
        size = int(info.get("size") or 0)
        target = self._target(url, info)
        if target.is_file() and target.stat().st_size == size:
            os.utime(target)  # recently used: evicted last
        else:
            self._download(fs, inner, url, target, size)
        with self._guard:
            self._pinned[target] = self._pinned.get(target, 0) + 1
        self._evict()
        return target

    @contextlib.contextmanager
    def opened(self, url: str) -> Iterator[Path]:
        """The local copy of `url`, kept while the block runs."""
        path = self.fetch(url)
        try:
            yield path
        finally:
            self.release(path)

    def release(self, path: Path) -> None:
        """The caller has read `path`: it may be evicted now."""
        with self._guard:
            left = self._pinned.get(path, 0) - 1
            if left > 0:
                self._pinned[path] = left
            else:
                self._pinned.pop(path, None)

    def _download(self, fs: Any, inner: str, url: str, target: Path, size: int) -> None:
        tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}-{threading.get_ident()}")
        done = 0

        def copy() -> None:
            nonlocal done
            with fs.open(inner, "rb", block_size=CHUNK_BYTES, cache_type="none") as src, \
                    open(tmp, "r+b" if done else "wb") as dst:
                src.seek(done)
                dst.seek(done)
                while done < size:
                    chunk = src.read(min(CHUNK_BYTES, size - done))
                    if not chunk:
                        raise ConnectionError(f"the object ended at byte {done} of {size}")
                    dst.write(chunk)
                    done += len(chunk)
                dst.flush()
                os.fsync(dst.fileno())

        try:
            with_retries(copy, url)
            os.replace(tmp, target)
        finally:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
        log.debug("fetched %s (%d bytes) into %s", url, size, target)

    def _evict(self) -> None:
        with self._guard:
            pinned = set(self._pinned)
        files = []
        for entry in os.scandir(self.root):
            if entry.name.startswith(".") or not entry.is_file():
                continue
            stat = entry.stat()
            files.append((stat.st_mtime, stat.st_size, Path(entry.path)))
        total = sum(size for _, size, _ in files)
        for _, size, path in sorted(files):
            if total <= self.limit:
                break
            if path in pinned:
                continue
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
                total -= size


def shard_cache() -> ShardCache:
    """The process's shard cache (`configure`; by default `default_cache_dir()/shards`), made
    on first use: a directory that cannot be written is a `DataError` naming it."""
    global _cache
    with _lock:
        if _cache is None:
            _cache = ShardCache(_cache_root or default_cache_dir() / "shards", _cache_limit)
        return _cache


__all__ = ["ATTEMPTS", "BUCKET_SCHEMES", "CHUNK_BYTES", "DEFAULT_CACHE_LIMIT", "Location",
           "ShardCache", "check_bucket", "check_reachable", "configure", "default_cache_dir",
           "exists", "expand", "filesystem", "is_directory", "is_url", "join", "list_parts",
           "local_file", "location", "name_of", "open_input", "open_metadata", "publish",
           "read_bytes", "remove", "scheme", "shard_cache", "size", "spool_dir", "temp_path",
           "transient", "with_retries", "write_bytes"]
