"""Follow a run's event log for the dashboard: RUN_DIR/events/NAME.jsonl, and for a run of
several replicas RUN_DIR/REPLICA/events/NAME.jsonl (``minirt up --replicas``) or merged logs laid
out as RUN_DIR/events/REPLICA/NAME.jsonl; complete lines only, in bounded chunks.

Lines are passed on as raw text, never parsed here: the browser parses them, so a dashboard
costs the serving process a ``stat`` per file per poll and a copy of the new bytes. No sockets,
no async: the SSE route in ``dashboard.py`` drives it.
"""

from __future__ import annotations

import re
from pathlib import Path

# A config event (``kv.config``, ``scheduler.config``, ...) as events.py writes it: the page
# needs these (pool size, policy) even when they are older than the backlog window.
_CONFIG = re.compile(rb'"event": "[a-z_]+\.config"')
HEAD_BYTES = 64 * 1024


class LogTail:
    """Offsets into every event file of one run directory.

    ``backlog()`` returns the last ``backlog_bytes`` of each file (plus the config events from
    its head) and starts following from there; ``poll()`` returns what was appended since, at
    most ``chunk_bytes`` per file per call (a slow reader gets the rest on the next call, so
    memory stays bounded). A line still being written (no trailing newline) waits for the next
    poll; a file that shrank (a new run in the same directory) is read again from its start.
    """

    def __init__(
        self, run_dir: str | Path, backlog_bytes: int = 4 << 20, chunk_bytes: int = 1 << 20
    ) -> None:
        if backlog_bytes < 0:
            raise ValueError(f"backlog_bytes must be >= 0, got {backlog_bytes}")
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
        self.run_dir = Path(run_dir)
        self.backlog_bytes = backlog_bytes
        self.chunk_bytes = chunk_bytes
        self.offsets: dict[Path, int] = {}

    def sources(self) -> list[Path]:
        d = self.run_dir
        return (
            sorted(d.glob("events/*.jsonl"))
            + sorted(d.glob("events/*/*.jsonl"))
            + sorted(d.glob("*/events/*.jsonl"))
        )

    def source_name(self, path: Path) -> str:
        """``events/NAME.jsonl``, ``events/REPLICA/NAME.jsonl`` or ``REPLICA/events/NAME.jsonl``:
        the page reads the replica's name from it when the events do not carry one."""
        return path.relative_to(self.run_dir).as_posix()

    def backlog(self) -> list[tuple[str, list[str]]]:
        out = []
        for path in self.sources():
            try:
                with path.open("rb") as f:
                    size = f.seek(0, 2)
                    start = max(0, size - self.backlog_bytes)
                    head: list[bytes] = []
                    if start > 0:
                        f.seek(0)
                        head = [
                            ln
                            for ln in f.read(min(HEAD_BYTES, start)).split(b"\n")[:-1]
                            if _CONFIG.search(ln)
                        ]
                    f.seek(start)
                    data = f.read(size - start)
            except OSError:
                continue
            if start > 0:  # the window starts mid-line: drop that partial line
                cut = data.find(b"\n")
                data = data[cut + 1 :] if cut >= 0 else b""
                start = size - len(data)
            end = data.rfind(b"\n") + 1
            self.offsets[path] = start + end
            lines = head + data[:end].split(b"\n")[:-1]
            if lines:
                out.append((self.source_name(path), _decode(lines)))
        return out

    def poll(self) -> list[tuple[str, list[str]]]:
        out = []
        for path in self.sources():
            try:
                size = path.stat().st_size
                off = self.offsets.get(path, 0)
                if size < off:
                    off = 0
                if size == off:
                    continue
                with path.open("rb") as f:
                    f.seek(off)
                    data = f.read(min(self.chunk_bytes, size - off))
            except OSError:
                continue
            end = data.rfind(b"\n") + 1
            if end == 0 and len(data) == self.chunk_bytes:
                # one line longer than a whole chunk: skip it rather than stall this file
                self.offsets[path] = off + len(data)
                continue
            self.offsets[path] = off + end
            lines = [ln for ln in data[:end].split(b"\n")[:-1] if ln.strip()]
            if lines:
                out.append((self.source_name(path), _decode(lines)))
        return out


def _decode(lines: list[bytes]) -> list[str]:
    return [ln.decode("utf-8", errors="replace") for ln in lines if ln.strip()]
