"""Reading text files: one reader, so that bytes which are not UTF-8 are the same one line
wherever they turn up (a config, a vocabulary, a corpus, SQuAD, classification rows, metrics).

The line names the file, the offset of the first bad byte and the byte itself, and says what
the file was expected to hold: `FILE: not UTF-8 text (byte 0xff at offset 123); expected ...`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from popbert.errors import FileError, PopbertError


def undecodable(error: UnicodeDecodeError, offset: int = 0) -> str:
    """The words for `error` (raised decoding bytes that start at `offset` in their file)."""
    bad = error.object[error.start:error.start + 1].hex()
    return f"not UTF-8 text (byte 0x{bad} at offset {offset + error.start})"


def decode(raw: bytes, path: str | os.PathLike, expected: str, *, offset: int = 0,
           error: type[PopbertError] = FileError) -> str:
    """`raw` (the bytes of `path` from `offset`) as text; bytes that are not UTF-8 are one
    `error` line."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error(f"{path}: {undecodable(exc, offset)}; expected {expected}") from None


def read_text(path: str | os.PathLike, expected: str, *,
              error: type[PopbertError] = FileError) -> str:
    """The text of `path` (a UTF-8 byte-order mark dropped, line ends as universal newlines
    make them); a missing or unreadable file or bytes that are not UTF-8 are one `error` line
    naming it and saying what it should hold (`expected`)."""
    try:
        raw = Path(path).read_bytes()
    except FileNotFoundError:
        raise error(f"{path}: not found; expected {expected}") from None
    except IsADirectoryError:
        raise error(f"{path}: a directory, not a file; expected {expected}") from None
    except OSError as exc:
        raise error(f"{path}: cannot read ({exc.strerror}); expected {expected}") from None
    text = decode(raw.removeprefix(b"\xef\xbb\xbf"), path, expected, error=error,
                  offset=3 if raw.startswith(b"\xef\xbb\xbf") else 0)
    return text.replace("\r\n", "\n").replace("\r", "\n")


def read_json(path: str | os.PathLike, expected: str, *,
              error: type[PopbertError] = FileError) -> Any:
    """The JSON value in `path`; unreadable, undecodable or not JSON is one `error` line."""
    text = read_text(path, expected, error=error)
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise error(f"{path}: not JSON ({exc.msg} at line {exc.lineno}); expected "
                    f"{expected}") from None


__all__ = ["decode", "read_json", "read_text", "undecodable"]
