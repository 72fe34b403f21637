"""A digest of a checkpoint's weights: two engines share stored KV only if their weights agree.

SHA-256 over the config and every weights file, in name order. Hashing runs at about a
gigabyte a second, so the result is remembered in the kvserve cache, keyed by each
file's path, size and modification time.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from kvserve.config import cache_root

_WEIGHTS = ("config.json", "*.safetensors", "*.bin", "*.gguf")


def _files(model_dir: Path) -> list[Path]:
    return sorted({f for pattern in _WEIGHTS for f in model_dir.glob(pattern)})


def model_fingerprint(model_dir: Path) -> str:
    files = _files(model_dir)
    stamp = json.dumps([[str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns] for f in files])
    memo = cache_root() / "fingerprints" / (hashlib.sha256(stamp.encode()).hexdigest() + ".txt")
    if memo.exists():
        return memo.read_text().strip()
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode() + b"\0")
        with f.open("rb") as fh:
            while chunk := fh.read(1 << 24):
                h.update(chunk)
    digest = h.hexdigest()
    memo.parent.mkdir(parents=True, exist_ok=True)
    memo.write_text(digest)
    return digest
