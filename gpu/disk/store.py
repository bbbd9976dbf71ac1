"""The disk tier's bytes: one file per KV block under ``DIR/<fingerprint>/``, checked on read.

The KV manager decides what is written, read and deleted (``actors/kv/disk_tier.py``); this is
the executor's side, called from worker threads:

- ``fingerprint(model_dir, ...)``: what a block's bytes depend on besides its tokens: the model
  directory's files (weights, config: their contents' hash), the KV dtype, block size and
  layout, and what computed it (the compute dtype, the device kind). Another model, dtype,
  block size or device gets another subdirectory, so it never hits.
- ``DiskStore.open``: the subdirectory, locked for this process (``flock``): a second instance
  on the same directory and model is refused with a message saying so (two writers would race
  on the LRU and the bound); a process that dies releases the lock.
- ``write(key, payload)``: a header (magic, fingerprint, key, length, xxh3-128 of the payload),
  then the payload, into a temporary file renamed into place: a reader sees a whole file or
  none. ``read(key)`` checks all of it and raises ``BadBlock`` (the file is deleted) on any
  mismatch: a flipped byte, a truncated file, a file of another model or key.
- ``keys()``: the files there, least recently used first (reads touch a file's mtime).

Payloads are the block's K and V for every layer (``PagedKVCache.read_block``).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import struct
from collections.abc import Iterable
from pathlib import Path

import xxhash

MAGIC = b"MINIRTKV1\0"
_HEADER = struct.Struct("<10s16s16sQ16s")  # magic, fingerprint, key, payload length, checksum
SUFFIX = ".kv"


Payload = bytes | bytearray | memoryview  # a block's bytes (``read`` gives a writable view)


class BadBlock(Exception):
    """A block file that is missing or fails its check (``reason`` says which)."""

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(f"block {key}: {reason}")
        self.key = key
        self.reason = reason


class DiskTierInUse(RuntimeError):
    """Another live process holds this disk tier."""


def fingerprint(
    model_dir: Path, kv_dtype: str, block_size: int, layout: Iterable[int], computed_by: str
) -> str:
    """128-bit hex digest of what a block's KV depends on besides its tokens; ``computed_by``
    names what computes it beyond the weights (``gpu/disk/jobs.py``: the compute dtype, the
    device kind and the model path, ``--model-impl``), since the same weights in another dtype write other values."""
    h = xxhash.xxh3_128()
    for f in sorted(p for p in Path(model_dir).rglob("*") if p.is_file()):
        h.update(str(f.relative_to(model_dir)).encode() + b"\0")
        with open(f, "rb") as fh:
            while chunk := fh.read(1 << 23):
                h.update(chunk)
    h.update(f"|{kv_dtype}|{block_size}|{','.join(map(str, layout))}|{computed_by}".encode())
    return h.hexdigest()


class DiskStore:
    def __init__(self, root: Path, fp: str, lock_fd: int) -> None:
        self.root = root
        self.fingerprint = fp
        self._fp = bytes.fromhex(fp)
        self._lock_fd = lock_fd

    @classmethod
    def open(cls, base: str | Path, fp: str) -> DiskStore:
        root = Path(base) / fp
        root.mkdir(parents=True, exist_ok=True)
        fd = os.open(root / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise DiskTierInUse(
                f"--kv-disk-dir {base}: this model's disk tier ({root}) is in use by another "
                f"minirt instance (pid {holder}); give each instance its own directory"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        for tmp in root.glob("*.tmp"):  # a write cut off by a crash
            tmp.unlink(missing_ok=True)
        return cls(root, fp, fd)

    def close(self) -> None:
        if self._lock_fd >= 0:
            os.close(self._lock_fd)  # releases the lock
            self._lock_fd = -1

    def path(self, key: str) -> Path:
        return self.root / (key + SUFFIX)

    def keys(self) -> list[str]:
        """The block files here, least recently used (by mtime) first."""
        found = []
        with os.scandir(self.root) as it:
            for e in it:
                if e.name.endswith(SUFFIX) and e.is_file():
                    found.append((e.stat().st_mtime_ns, e.name[: -len(SUFFIX)]))
        return [k for _, k in sorted(found)]

    @staticmethod
    def file_bytes(payload_bytes: int) -> int:
        """The size of a block file whose payload is ``payload_bytes``: what the tier's byte
        bound counts."""
        return _HEADER.size + payload_bytes

    def write(self, key: str, payload: bytes | memoryview) -> int:
        """Write ``payload`` as block ``key``; returns the file's size."""
        digest = xxhash.xxh3_128_digest(payload)
        head = _HEADER.pack(MAGIC, self._fp, bytes.fromhex(key), len(payload), digest)
        final = self.path(key)
        tmp = final.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            f.write(head)
            f.write(payload)
        os.replace(tmp, final)
        return len(head) + len(payload)

    def read(self, key: str, size: int) -> memoryview:
        """The payload of block ``key`` (``size`` bytes, a writable view: no copy), checked;
        ``BadBlock`` (and the file deleted) if it is missing, short, long, of another model or
        key, or corrupt."""
        p = self.path(key)
        data = bytearray(_HEADER.size + size + 1)  # one byte more: a longer file shows
        try:
            with open(p, "rb", buffering=0) as f:
                n = f.readinto(data)
        except FileNotFoundError:
            raise BadBlock(key, "missing") from None
        del data[n:]
        reason = self._check(key, data, size)
        if reason:
            p.unlink(missing_ok=True)
            raise BadBlock(key, reason)
        with contextlib.suppress(OSError):
            os.utime(p)  # recently used, for the next start's LRU order
        return memoryview(data)[_HEADER.size :]

    def _check(self, key: str, data: bytearray, size: int) -> str:
        if len(data) < _HEADER.size:
            return "truncated header"
        magic, fp, k, n, digest = _HEADER.unpack_from(data)
        if magic != MAGIC:
            return "not a block file"
        if fp != self._fp or k != bytes.fromhex(key):
            return "another model's or key's block"
        if n != size or len(data) - _HEADER.size != n:
            return f"length {len(data) - _HEADER.size}, expected {size}"
        if xxhash.xxh3_128_digest(memoryview(data)[_HEADER.size :]) != digest:
            return "checksum mismatch"
        return ""

    def delete(self, keys: Iterable[str]) -> None:
        for k in keys:
            self.path(k).unlink(missing_ok=True)
