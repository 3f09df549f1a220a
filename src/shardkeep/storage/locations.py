"""Where a location points: the one rule that tells a local path from a store URL.

A location is a local path (``/data/ckpt``, ``ckpt``), a ``file://`` URL, or a store URL
(``s3://bucket/prefix``: ``<protocol>://<path>``). The rule, the same in every module:

- text with ``://`` is a URL, whatever comes before it (a malformed one is refused by
  :func:`split_url`, never read as a local path);
- ``file://PATH`` is the local path ``PATH`` (made absolute), everywhere a location is taken:
  it is not a store URL (:func:`is_url` says ``False``) and :func:`local_path` gives its path;
- any other URL names an object store, opened through fsspec.
"""

from __future__ import annotations

import os

from shardkeep.errors import UnsafePathError, UnsupportedValueError

__all__ = ["FILE_PROTOCOL", "is_url", "local_path", "split_url"]

#: The protocol of a URL that names a local path.
FILE_PROTOCOL = "file"
_SEPARATOR = "://"


def is_url(location: str | os.PathLike[str]) -> bool:
    """Whether ``location`` names a store by URL (``s3://bucket/prefix``); ``False`` for a
    local path and for a ``file://`` URL, which is one."""
    protocol, separator, _ = os.fspath(location).partition(_SEPARATOR)
    return bool(separator) and protocol != FILE_PROTOCOL


def local_path(location: str | os.PathLike[str]) -> str | None:
    """The absolute local path ``location`` names (a path, or ``file://PATH``), or ``None``
    for a store URL."""
    text = os.fspath(location)
    protocol, separator, rest = text.partition(_SEPARATOR)
    if not separator:
        return os.path.abspath(text)
    if protocol == FILE_PROTOCOL:
        if not rest or "\x00" in rest:
            raise UnsupportedValueError(f"{text!r} names no local path (file:///absolute/path)")
        return os.path.abspath(rest)
    return None


def split_url(url: str) -> tuple[str, str]:
    """``"s3://bucket/prefix"`` -> ``("s3", "bucket/prefix")``, and ``"file://PATH"`` ->
    ``("file", <PATH made absolute>)``; refuses (``UnsupportedValueError``) what is not a URL
    and (``UnsafePathError``) an unsafe path component."""
    protocol, separator, rest = url.partition(_SEPARATOR)
    if not separator or not protocol or not protocol.replace("+", "").isalnum():
        raise UnsupportedValueError(f"{url!r} is not a storage URL like s3://bucket/prefix")
    if protocol == FILE_PROTOCOL:
        path = local_path(url)
        assert path is not None
        return protocol, path
    rest = rest.strip("/")
    if not rest:
        raise UnsupportedValueError(f"{url!r} names no bucket")
    for part in rest.split("/"):
        if part in ("", ".", "..") or "\x00" in part or "\\" in part:
            raise UnsafePathError(f"{url!r}: unsafe path component {part!r}")
    return protocol, rest
