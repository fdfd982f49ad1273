"""Credentials out of URIs before they reach a log, an error or the UI: the one place that knows how.

A tracking server's URI may carry ``user:password@`` or a secret query parameter (``?token=``,
``sslpassword=``, ``access_key=``...), from an Airflow connection's host or extra, and so may the
messages of the libraries that use it. :func:`redact_uris` rewrites every URI in a text with both
blanked; :func:`secret_query_key` is the rule for which query parameters hold a secret (also what
a job file's ``tracking.uri`` may not carry).
"""

from __future__ import annotations

import re
from urllib.parse import SplitResult, parse_qsl, quote, urlsplit

MASK = "***"
# Whole words of a query parameter's name (split at '_', '-', '.') that name a secret.
SECRET_WORDS = frozenset(
    {"token", "password", "passwd", "pwd", "secret", "key", "apikey", "sig", "signature", "credential", "auth"}
)
# Endings of a run-together name: sslpassword, authtoken, clientsecret, accesskey.
SECRET_ENDINGS = ("password", "passwd", "token", "secret", "key")
# scheme://... up to whitespace, a quote or a bracket that closes it in prose or a repr.
_URI = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>()\[\]{}]+")
# A query parameter anywhere, also in a URL without scheme and host (urllib3 says "with url: /?token=...").
_PARAMETER = re.compile(r"(?<=[?&;])([A-Za-z0-9_.\-]+)=([^&;#\s'\"<>()]*)")


def secret_query_key(key: str) -> bool:
    """Whether a query parameter named ``key`` holds a credential (``auth_token``, ``sslpassword``, ``key``)."""
    lowered = key.lower()
    words = re.split(r"[_.\-]+", lowered)
    return any(w in SECRET_WORDS for w in words) or lowered.endswith(SECRET_ENDINGS)


def redact_uri(uri: str) -> str:
    """``uri`` with its user info and its secret query values replaced by ``***``."""
    try:
        parts = urlsplit(uri)
    except ValueError:  # e.g. an unbalanced '[' in the host: keep nothing after the scheme
        return uri.partition("://")[0] + "://" + MASK
    netloc = parts.netloc
    if "@" in netloc:
        netloc = MASK + "@" + netloc.rpartition("@")[2]
    query = parts.query
    if query:
        pairs = parse_qsl(query, keep_blank_values=True)
        if any(secret_query_key(k) for k, _ in pairs):
            query = "&".join(
                f"{quote(k, safe='')}={MASK if secret_query_key(k) else quote(v, safe='')}" for k, v in pairs
            )
    if (netloc, query) == (parts.netloc, parts.query):
        return uri
    return SplitResult(parts.scheme, netloc, parts.path, query, parts.fragment).geturl()


def redact_uris(text: str) -> str:
    """``text`` (a message, an exception's words) with every URI in it redacted (:func:`redact_uri`),
    and every secret query parameter, also of a URL without scheme (``/path?token=...``)."""
    text = _URI.sub(lambda found: redact_uri(found.group(0)), text)
    return _PARAMETER.sub(lambda p: f"{p.group(1)}={MASK}" if secret_query_key(p.group(1)) else p.group(0), text)
