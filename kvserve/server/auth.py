"""API keys -> tenants, and the per-tenant cache salt (derived here, never taken from the client).

A tenant's salt is HMAC-SHA-256(server secret, tenant). A client may send its own
`cache_salt`; it is only mixed in under the tenant's salt (HMAC(tenant salt,
client salt)), so it can split the tenant's cache further but never reach
another tenant's. Neither keys nor salts are ever logged.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass
from pathlib import Path

ANONYMOUS_TENANT = "anonymous"
DEFAULT_TENANT = "default"


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


@dataclass(frozen=True)
class ApiKeys:
    """Key digests -> tenant names; `open` when the server was started without keys."""

    tenants: dict[bytes, str]

    @property
    def open(self) -> bool:
        return not self.tenants

    def tenant(self, key: str | None) -> str | None:
        """The tenant of a bearer key; None if the key is missing or unknown."""
        if self.open:
            return ANONYMOUS_TENANT
        if not key:
            return None
        return self.tenants.get(_digest(key))  # looks up digests, not the keys themselves

    @classmethod
    def from_key(cls, key: str) -> ApiKeys:
        return cls({_digest(key): DEFAULT_TENANT})

    @classmethod
    def from_file(cls, path: str | Path) -> ApiKeys:
        """Lines `key tenant`; blank lines and `#` comments are ignored."""
        tenants: dict[bytes, str] = {}
        for lineno, line in enumerate(Path(path).read_text().splitlines(), 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            parts = line.split()
            if len(parts) != 2:
                raise ValueError(f"{path}:{lineno}: expected 'key tenant', got {len(parts)} fields")
            key, tenant = parts
            if _digest(key) in tenants:
                raise ValueError(f"{path}:{lineno}: duplicate key")
            tenants[_digest(key)] = tenant
        if not tenants:
            raise ValueError(f"{path}: no API keys")
        return cls(tenants)


def cache_salt(secret: bytes, tenant: str, client_salt: str | None = None) -> str:
    """The salt for the engine (hex): the tenant's, optionally split further by the client's."""
    salt = hmac.new(secret, tenant.encode(), hashlib.sha256).digest()
    if client_salt is not None:
        salt = hmac.new(salt, client_salt.encode(), hashlib.sha256).digest()
    return salt.hex()
