"""Stored responses (``store: true``): one JSON file per response under a directory of the run
(pure: files and a log, no event loop).

A record holds the response object as it was answered and the conversation a next turn
continues (``previous_response_id``): the chat messages it ran on (its instructions left out)
and its output as one assistant message. Each file is written whole under a temporary name and
renamed into place, so a crash leaves either the old state or the new one. The index (id ->
file, size, oldest first) lives in memory and is rebuilt from the directory's file names when
the store opens (the names begin with the time they were stored), so the store survives a
restart of the HTTP server. It keeps at most ``max_count`` records and ``max_bytes`` bytes of
them: the oldest are dropped first, each logged as ``http.response_dropped``.

Records belong to the API key that made them: the store keeps a SHA-256 of the key, and a key
that is not the owner's finds nothing (as if the response did not exist).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_NAME = re.compile(r"^(\d{20})-(resp_[A-Za-z0-9_]+)\.json$")
ID = re.compile(r"^resp_[A-Za-z0-9_]{1,64}$")


def owner_of(api_key: str) -> str:
    return hashlib.sha256(api_key.encode()).hexdigest()


@dataclass
class _Entry:
    name: str
    size: int


class ResponseStore:
    def __init__(self, root: str | os.PathLike[str], max_count: int, max_bytes: int, log: Any):
        self.root = Path(root)
        self.max_count = max_count
        self.max_bytes = max_bytes
        self.log = log
        self.index: OrderedDict[str, _Entry] = OrderedDict()
        self.bytes = 0
        self._last_ns = 0
        self._load()

    def _load(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        for path in sorted(self.root.iterdir()):
            if path.name.endswith(".tmp"):  # a write a crash interrupted
                path.unlink(missing_ok=True)
                continue
            m = _NAME.match(path.name)
            if m is None:
                continue
            size = path.stat().st_size
            self.index[m.group(2)] = _Entry(path.name, size)
            self.bytes += size
            self._last_ns = max(self._last_ns, int(m.group(1)))
        self._bound()

    def __len__(self) -> int:
        return len(self.index)

    def __contains__(self, rid: object) -> bool:
        return rid in self.index

    def put(self, rid: str, api_key: str, record: dict[str, Any]) -> None:
        """Store ``record`` as ``rid``, owned by ``api_key``; drop the oldest past the bounds."""
        if not ID.match(rid):
            raise ValueError(f"not a response id: {rid!r}")
        if rid in self.index:
            self._remove(rid)
        data = json.dumps({"owner": owner_of(api_key), **record}, separators=(",", ":")).encode()
        self._last_ns = max(time.time_ns(), self._last_ns + 1)
        name = f"{self._last_ns:020d}-{rid}.json"
        tmp = self.root / f"{name}.tmp"
        tmp.write_bytes(data)
        os.replace(tmp, self.root / name)
        self.index[rid] = _Entry(name, len(data))
        self.bytes += len(data)
        self._bound()

    def get(self, rid: str, api_key: str) -> dict[str, Any] | None:
        """The record stored as ``rid`` if ``api_key`` owns it, else None."""
        entry = self.index.get(rid)
        if entry is None:
            return None
        try:
            record = json.loads((self.root / entry.name).read_bytes())
        except (OSError, ValueError):  # removed or damaged behind our back: forget it
            self._remove(rid)
            return None
        if not isinstance(record, dict):
            return None
        owner = str(record.pop("owner", ""))
        if not hmac.compare_digest(owner, owner_of(api_key)):
            return None
        return record

    def delete(self, rid: str, api_key: str) -> bool:
        """Remove ``rid`` if ``api_key`` owns it; whether it did."""
        if self.get(rid, api_key) is None:
            return False
        self._remove(rid)
        return True

    def _remove(self, rid: str) -> None:
        entry = self.index.pop(rid)
        self.bytes -= entry.size
        (self.root / entry.name).unlink(missing_ok=True)

    def _bound(self) -> None:
        while self.index and (len(self.index) > self.max_count or self.bytes > self.max_bytes):
            oldest = next(iter(self.index))
            reason = "max_count" if len(self.index) > self.max_count else "max_bytes"
            self._remove(oldest)
            self.log.info(
                "http.response_dropped",
                id=oldest,
                reason=reason,
                kept=len(self.index),
                bytes=self.bytes,
            )
