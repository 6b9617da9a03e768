"""API key format and hashing: pure functions, no Redis.

A key's plaintext is `sy-<key_id>-<secret>`: `key_id` (8 hex characters) finds the record,
`secret` (256 random bits, url-safe base64) proves possession. Only a per-key random salt and
HMAC-SHA256(salt, plaintext) are stored; the secret's entropy makes a slow KDF unnecessary.
"""

import hashlib
import hmac
import re
import secrets
from dataclasses import dataclass

KEY_ID_HEX_CHARS = 8
_PLAINTEXT_RE = re.compile(r"^sy-([0-9a-f]{8})-([A-Za-z0-9_-]{32,128})$")


@dataclass(frozen=True)
class ParsedKey:
    key_id: str
    plaintext: str


def new_key_id() -> str:
    return secrets.token_hex(KEY_ID_HEX_CHARS // 2)


def new_secret() -> str:
    return secrets.token_urlsafe(32)


def new_salt() -> str:
    return secrets.token_hex(16)


def format_key(key_id: str, secret: str) -> str:
    return f"sy-{key_id}-{secret}"


def visible_prefix(key_id: str) -> str:
    """The part of a key that may be shown after creation, e.g. "sy-ab12cd34"."""
    return f"sy-{key_id}"


def parse_key(plaintext: object) -> ParsedKey | None:
    """The key id of a well-formed plaintext; None when it is malformed."""
    if not isinstance(plaintext, str):
        return None
    m = _PLAINTEXT_RE.fullmatch(plaintext)
    return ParsedKey(m.group(1), plaintext) if m else None


def hash_key(salt: str, plaintext: str) -> str:
    """Hex HMAC-SHA256 of the whole plaintext, keyed by the record's salt."""
    return hmac.new(bytes.fromhex(salt), plaintext.encode(), hashlib.sha256).hexdigest()


def key_matches(salt: str, stored_hash: str, plaintext: str) -> bool:
    """Constant-time comparison of the plaintext's hash with the stored one."""
    return hmac.compare_digest(hash_key(salt, plaintext), stored_hash)


def is_expired(expires_at: float | None, now: float) -> bool:
    """A key expires at `expires_at` (unix seconds) exactly; None never expires."""
    return expires_at is not None and now >= expires_at
