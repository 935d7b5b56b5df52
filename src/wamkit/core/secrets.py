"""Secrets in configs: what is written, logged or reported never holds one.

    redact({"server": {"token": "abc", "url": "http://u:p@host:8000"}})
    -> {"server": {"token": "***", "url": "http://host:8000"}}

A key is secret when its name, any case, is one of SECRET_KEYS or ends in `_` + one (`hf_token`, `client_secret`);
its value becomes REDACTED at any depth (policy_args, serve_args...). In every string, a URL's userinfo
(`user:password@`) is dropped. A redacted config is what a run records and compares (a token is not part of what
was evaluated), so redacting twice changes nothing.
"""

from __future__ import annotations

import re
from typing import Any

SECRET_KEYS = ("token", "api_key", "password", "secret")
REDACTED = "***"

_USERINFO = re.compile(r"(?<=://)[^/@\s,]*@")   # scheme://user:pass@host: the part the lookbehind skips is kept


def is_secret_key(key: Any) -> bool:
    k = str(key).lower()
    return any(k == s or k.endswith("_" + s) for s in SECRET_KEYS)


def strip_userinfo(text: str) -> str:
    """`text` with `user:password@` removed from every URL in it (a comma-separated list too)."""
    return _USERINFO.sub("", text)


def redact(value: Any) -> Any:
    """A copy of `value` (dicts, lists, strings, nested at any depth) with secret keys' values replaced by REDACTED
    and URL userinfo removed from strings; other values as they are."""
    if isinstance(value, dict):
        return {k: (REDACTED if is_secret_key(k) and isinstance(v, str) and v else redact(v))   # strings only: a
                for k, v in value.items()}                                                   # num_token=8 stays
    if isinstance(value, (list, tuple)):
        return [redact(v) for v in value]
    if isinstance(value, str):
        return strip_userinfo(value)
    return value
