"""The stored responses of /v1/responses (``response_store``), on their own: atomic files, the
bounds (oldest dropped first, each drop logged), the index rebuilt from the directory after a
restart, and records that only the key that made them can see."""

from __future__ import annotations

import json
from typing import Any

import pytest

from minirt.http.responses.store import ResponseStore, owner_of


class Log:
    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []

    def info(self, event: str, **fields: Any) -> None:
        self.events.append((event, fields))


def record(n: int, pad: int = 0) -> dict[str, Any]:
    return {
        "response": {"id": f"resp_{n}", "object": "response", "output": [], "pad": "x" * pad},
        "messages": [{"role": "user", "content": f"hello {n}"}],
        "output": {"role": "assistant", "content": f"answer {n}"},
    }


def test_put_get_delete_and_nothing_left_behind(tmp_path):
    store = ResponseStore(tmp_path / "responses", 10, 1 << 20, Log())
    store.put("resp_1", "k", record(1))
    got = store.get("resp_1", "k")
    assert got == record(1)
    [path] = (tmp_path / "responses").iterdir()
    assert path.name.endswith("-resp_1.json")  # written whole, renamed into place: no .tmp left
    on_disk = json.loads(path.read_text())
    assert on_disk["owner"] == owner_of("k") != "k"  # the key itself is never written
    assert store.get("resp_2", "k") is None
    assert store.delete("resp_1", "k") and not store.delete("resp_1", "k")
    assert store.get("resp_1", "k") is None
    assert list((tmp_path / "responses").iterdir()) == []
    with pytest.raises(ValueError):
        store.put("../etc/passwd", "k", record(3))


def test_a_record_belongs_to_the_key_that_made_it(tmp_path):
    store = ResponseStore(tmp_path, 10, 1 << 20, Log())
    store.put("resp_a", "alice", record(1))
    assert store.get("resp_a", "bob") is None
    assert store.get("resp_a", "") is None
    assert not store.delete("resp_a", "bob")
    assert store.get("resp_a", "alice") == record(1)


def test_the_oldest_are_dropped_first_past_the_count(tmp_path):
    log = Log()
    store = ResponseStore(tmp_path, 3, 1 << 20, log)
    for n in range(5):
        store.put(f"resp_{n}", "k", record(n))
    assert [rid for rid in store.index] == ["resp_2", "resp_3", "resp_4"]
    assert [f["id"] for e, f in log.events if e == "http.response_dropped"] == ["resp_0", "resp_1"]
    assert {f["reason"] for _, f in log.events} == {"max_count"}
    assert len(list(tmp_path.iterdir())) == 3


def test_the_oldest_are_dropped_first_past_the_bytes(tmp_path):
    log = Log()
    one = len(json.dumps({"owner": owner_of("k"), **record(0, 1000)}, separators=(",", ":")))
    store = ResponseStore(tmp_path, 100, 2 * one + one // 2, log)
    for n in range(4):
        store.put(f"resp_{n}", "k", record(n, 1000))
    assert list(store.index) == ["resp_2", "resp_3"]
    assert store.bytes == sum(p.stat().st_size for p in tmp_path.iterdir())
    assert [(f["id"], f["reason"]) for _, f in log.events] == [
        ("resp_0", "max_bytes"),
        ("resp_1", "max_bytes"),
    ]
    # a record larger than the whole budget is not kept at all
    store.put("resp_big", "k", record(9, 10 * one))
    assert "resp_big" not in store and store.get("resp_big", "k") is None


def test_a_new_store_over_the_same_directory_finds_them_in_order(tmp_path):
    first = ResponseStore(tmp_path, 10, 1 << 20, Log())
    for n in range(4):
        first.put(f"resp_{n}", "k", record(n))
    first.delete("resp_1", "k")
    (tmp_path / "0000-resp_x.json.tmp").write_text("{")  # a write a crash interrupted
    (tmp_path / "notes.txt").write_text("not ours")
    log = Log()
    again = ResponseStore(tmp_path, 10, 1 << 20, log)
    assert list(again.index) == ["resp_0", "resp_2", "resp_3"]
    assert again.get("resp_2", "k") == record(2)
    assert again.get("resp_2", "other") is None
    assert again.bytes == first.bytes
    assert not (tmp_path / "0000-resp_x.json.tmp").exists()
    assert (tmp_path / "notes.txt").exists()
    # new records still come after the old ones, and smaller bounds apply at once
    again.put("resp_9", "k", record(9))
    smaller = ResponseStore(tmp_path, 2, 1 << 20, log)
    assert list(smaller.index) == ["resp_3", "resp_9"]
    assert [f["id"] for _, f in log.events] == ["resp_0", "resp_2"]


def test_a_file_removed_behind_its_back_is_forgotten(tmp_path):
    store = ResponseStore(tmp_path, 10, 1 << 20, Log())
    store.put("resp_1", "k", record(1))
    for p in tmp_path.iterdir():
        p.unlink()
    assert store.get("resp_1", "k") is None
    assert "resp_1" not in store and store.bytes == 0
