"""BlockPool: allocation, sharing and freeing with reference counts; misuse raises."""

from __future__ import annotations

import pytest

from actors.kv import BlockPool, KVError, KVInvariantError


def test_allocate_hands_out_distinct_blocks_with_ref_one() -> None:
    pool = BlockPool(8)
    blocks = pool.allocate(5)
    assert len(set(blocks)) == 5
    assert all(pool.ref(b) == 1 for b in blocks)
    assert pool.num_free == 3
    pool.check()


def test_allocate_more_than_free_raises_and_takes_nothing() -> None:
    pool = BlockPool(4)
    pool.allocate(3)
    with pytest.raises(KVError, match="1 free"):
        pool.allocate(2)
    assert pool.num_free == 1
    assert pool.allocate(0) == []
    pool.check()


def test_block_returns_to_free_list_only_at_zero() -> None:
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    assert pool.share(b) == 2
    assert pool.free(b) == 1
    assert pool.num_free == 1
    assert pool.free(b) == 0
    assert pool.num_free == 2
    pool.check()
    # the freed block can be allocated again
    assert b in pool.allocate(2)


def test_double_free_raises() -> None:
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    pool.free(b)
    with pytest.raises(KVError, match="double free"):
        pool.free(b)
    pool.check()


@pytest.mark.parametrize("bad", [-1, 4, 100])
def test_unknown_block_raises(bad: int) -> None:
    pool = BlockPool(4)
    with pytest.raises(KVError, match="unknown block"):
        pool.free(bad)
    with pytest.raises(KVError, match="unknown block"):
        pool.share(bad)
    with pytest.raises(KVError, match="unknown block"):
        pool.ref(bad)


def test_share_free_block_raises() -> None:
    pool = BlockPool(4)
    with pytest.raises(KVError, match="free"):
        pool.share(0)
    with pytest.raises(KVError, match="free"):
        pool.share_many([0])
    assert pool.ref(0) == 0
    pool.check()


def test_free_many_validates_before_changing() -> None:
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    with pytest.raises(KVError, match="double free"):
        pool.free_many([a, b, b])
    assert pool.ref(a) == 1 and pool.ref(b) == 1
    pool.share(b)
    assert pool.free_many([a, b]) == [a]
    assert pool.ref(b) == 1
    pool.check()


def test_share_many_validates_before_changing() -> None:
    pool = BlockPool(4)
    (a,) = pool.allocate(1)
    with pytest.raises(KVError):
        pool.share_many([a, 3])
    assert pool.ref(a) == 1


def test_check_detects_corruption() -> None:
    pool = BlockPool(4)
    (a,) = pool.allocate(1)
    pool._refs[a] = 0  # lost block: ref 0 but not on the free list
    with pytest.raises(KVInvariantError, match="not on the free list"):
        pool.check()
    pool2 = BlockPool(4)
    pool2._free.append(pool2._free[-1])
    with pytest.raises(KVInvariantError, match="twice"):
        pool2.check()


def test_empty_pool_rejected() -> None:
    with pytest.raises(KVError):
        BlockPool(0)
