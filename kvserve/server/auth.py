"""API keys -> tenants, and the per-tenant cache salt (derived here, never taken from the client).

A tenant's salt is HMAC-SHA-256(server secret, tenant). A client may send its own
`cache_salt`; it is only mixed in under the tenant's salt (HMAC(tenant salt,
client salt)), so it can split the tenant's cache further but never reach
another tenant's. Neither keys nor salts are ever logged.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from kvserve.config import EngineConfig

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


def server_cache_secret(explicit: str | None, config: EngineConfig) -> bytes:
    """The secret that keys every tenant's salt. Random at start unless a tier outlives the
    process: with the disk tier it is kept beside it (owner-only), so a restarted server
    derives the same salts and finds its blocks; with Redis, replicas on other machines
    must derive the same salts too, so it must be given (`--cache-secret`)."""
    if explicit:
        return explicit.encode()
    if config.kv_remote:
        raise ValueError(
            "--kv-remote needs --cache-secret (the same on every replica sharing the store), "
            "so that a tenant's cached prefixes are found again on every replica and after a restart"
        )
    if config.enable_prefix_caching and config.kv_disk_bytes():
        return _persistent_secret(config.kv_disk_path() / "cache_secret")
    return secrets.token_bytes(32)


def _persistent_secret(path: Path) -> bytes:
    try:
        return bytes.fromhex(path.read_text().strip())
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    secret = secrets.token_bytes(32)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:  # another replica on this directory made it first
        return bytes.fromhex(path.read_text().strip())
    with os.fdopen(fd, "w") as f:
        f.write(secret.hex())
    return secret
