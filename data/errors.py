"""The one exception type of popbert.data, so callers can catch bad data distinctly."""

from __future__ import annotations

from popbert.errors import PopbertError


class DataError(PopbertError, ValueError):
    """Data on disk does not match what the run expects (shape, vocabulary, format).

    Messages are one line and name the file and the mismatch, so a user can fix the config or
    regenerate the shard without reading a traceback.
    """
