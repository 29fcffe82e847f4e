"""The one rule for names: cache names, sequence ids, tenants, session ids and
shared-memory buffer names are 1-128 ASCII characters of [A-Za-z0-9._-].

Names end up in file names (/dev/shm), LMDB keys, metric labels, logs and
error messages, so they are ASCII and short; str.isalnum() would let in any
Unicode letter or digit ("caché٣"). Labels (a cache's model_id, which holds
'/' as in "meta-llama/Llama-3-8B") are free text up to 256 characters with
no control characters.
"""
from __future__ import annotations

import re

from kvstore.errors import InvalidArgument, quote

NAME_MAX = 128
NAME_RULE = f"1-{NAME_MAX} characters of [A-Za-z0-9._-]"
LABEL_MAX = 256
_NAME = re.compile(r"[A-Za-z0-9._-]+", re.ASCII)


def is_name(value: object) -> bool:
    return isinstance(value, str) and 0 < len(value) <= NAME_MAX and _NAME.fullmatch(value) is not None


def check_name(field: str, value: object) -> str:
    """value, if it is a name; InvalidArgument naming `field` otherwise."""
    if not is_name(value):
        raise InvalidArgument(field, f"must be {NAME_RULE}, got {quote(value)}")
    return value


def check_label(field: str, value: object) -> str:
    """value, if it is a label: 1-256 characters, none of them a control
    character (C0, DEL, C1: they would corrupt logs and terminals)."""
    if not isinstance(value, str) or not 0 < len(value) <= LABEL_MAX:
        raise InvalidArgument(field, f"must be 1-{LABEL_MAX} characters, got {quote(value)}")
    bad = next((c for c in value if ord(c) < 0x20 or 0x7F <= ord(c) < 0xA0), None)
    if bad is not None:
        raise InvalidArgument(field, f"contains the control character U+{ord(bad):04X}: {quote(value)}")
    return value
