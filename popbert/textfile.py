"""Reading text files: one reader, so that bytes which are not UTF-8 are the same one line
wherever they turn up (a config, a vocabulary, a corpus, SQuAD, classification rows, metrics).

The line names the file, the offset of the first bad byte and the byte itself, and says what
the file was expected to hold: `FILE: not UTF-8 text (byte 0xff at offset 123); expected ...`.
"""

from __future__ import annotations

import json
import os
import re
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
    """The JSON value in `path`; unreadable, undecodable or not JSON is one `error` line, as is
    a string that is not Unicode (`lone_surrogate`)."""
    text = read_text(path, expected, error=error)
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise error(f"{path}: not JSON ({exc.msg} at line {exc.lineno}); expected "
                    f"{expected}") from None
    bad = lone_surrogate(text, value)
    if bad is not None:
        raise error(f"{path}: {bad}; expected {expected}") from None
    return value


# A JSON escape of a UTF-16 surrogate (\ud800-\udfff): the only way JSON text decoded from
# UTF-8 can hold one.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def unicode_problem(text: str) -> str | None:
    """What makes `text` not Unicode (a lone UTF-16 surrogate, which no tokenizer reads and
    UTF-8 cannot encode), or None."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return f"a lone surrogate \\u{ord(text[exc.start]):04x} at character {exc.start}"
    return None


def lone_surrogate(text: str, value: Any) -> str | None:
    """What is wrong with a string of `value`, the JSON parsed from `text`: a `\\ud800` escape
    of half a surrogate pair decodes to a string that is not Unicode (`unicode_problem`), which
    JSON allows and no tokenizer reads. None if every string is text (the escape-free common
    case costs one regex search of `text`)."""
    if not _SURROGATE_ESCAPE.search(text):
        return None
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            problem = unicode_problem(item)
            if problem is not None:
                return f"a JSON string is not Unicode text ({problem})"
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return None


__all__ = ["decode", "lone_surrogate", "read_json", "read_text", "undecodable",
           "unicode_problem"]
