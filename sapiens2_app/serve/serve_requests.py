"""The small pieces of a request that serve_http's Handler checks and reads before it answers, and the header values it
writes: the Host and Origin checks against DNS rebinding and cross-site forms, the Content-Length, the query string
and its numbers, a download's Content-Disposition, and the limits /api/health shows. Each is a function of strings
that raises ClientError (a status and one line) on what a client got wrong."""

from __future__ import annotations

import re
from urllib.parse import parse_qsl, quote, urlsplit

from sapiens2_app.serve.serve_uploads import MAX_IMAGES, MAX_PIXELS, ClientError

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
MAX_LENGTH_DIGITS = 15  # a Content-Length of up to a petabyte, far over any --max-upload-mb


def host_allowed(value: str | None, hosts: frozenset[str], port: int) -> bool:
    """Does a Host header (or an Origin's host:port) name this server: an accepted name, and its port?"""
    if not value:
        return False
    try:
        parts = urlsplit("//" + value)
        given_port = parts.port
    except ValueError:
        return False
    return parts.hostname in hosts and (given_port or 80) == port and parts.path == "" and not parts.username


def same_site(origin: str, hosts: frozenset[str], port: int) -> bool:
    """Is an Origin header this server's own page (http://HOST:PORT)? A cross-site form's is its site's."""
    return origin.startswith("http://") and host_allowed(origin[len("http://"):], hosts, port)


def content_length(text: str | None) -> int | None:
    """A Content-Length header's number of bytes; None when absent or not ASCII digits ("²" passes str.isdigit and
    then int() refuses it; int() refuses more than 4300 digits too). Only HTTP's spaces and tabs around it are
    ignored: str.strip() takes control characters such as \x1d too, which int() does not."""
    value = None if text is None else text.strip(" \t")
    if value is None or not re.fullmatch(rf"[0-9]{{1,{MAX_LENGTH_DIGITS}}}", value):
        return None
    return int(value)


def query_args(query: str, defaults: dict[str, str]) -> dict[str, str]:
    """A URL's query as {name: value}: only the names in `defaults` (missing ones take their default), each once."""
    try:
        pairs = parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query), max_num_fields=len(defaults))
    except ValueError:
        raise ClientError(400, f"malformed query string (expected at most {', '.join(defaults)})") from None
    names = [name for name, _ in pairs]
    if unknown := [name for name in names if name not in defaults or names.count(name) > 1]:
        raise ClientError(400, f"query parameter {unknown[0][:40]!r}: unknown or repeated (expected "
                               f"{', '.join(defaults)})")
    return {**defaults, **dict(pairs)}


def whole_number(args: dict[str, str], name: str) -> int:
    text = args[name]
    if not re.fullmatch(r"-?[0-9]{1,6}", text):
        raise ClientError(400, f"{name}={text[:20]!r}: expected a whole number")
    return int(text)


def disposition(kind: str, name: str) -> str:
    """Content-Disposition with the name as ASCII (others as _) and in full as RFC 5987 UTF-8."""
    ascii_name = re.sub(r'[^A-Za-z0-9._ -]', "_", name)
    return f"{kind}; filename=\"{ascii_name}\"; filename*=UTF-8''{quote(name, safe='')}"


def limits_json(max_upload_mb: int, keep_jobs: int) -> dict:
    return {"max_upload_mb": max_upload_mb, "max_images": MAX_IMAGES, "max_megapixels": MAX_PIXELS / 1e6,
            "keep_jobs": keep_jobs}
