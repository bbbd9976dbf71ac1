"""KV manager library: block pool with ref counts, block-aligned radix prefix cache with LRU
eviction, admission / growth / preemption decisions (``BlockManager``), the reservation and victim
policies, and the actor's protocol-level core (``actors.kv.core.KVManagerCore``). Synchronous, no I/O,
no torch; ``actors.kv.actor`` is the only module with sockets."""

from actors.kv.block_manager import BlockManager, RequestState
from actors.kv.block_pool import BlockPool
from actors.kv.radix_cache import PrefixMatch, RadixCache, RadixNode
from actors.kv.results import Admitted, Extended, KVStats, Refused, Shortage
from actors.shared.errors import KVError, KVInvariantError
from actors.shared.reservation import ReserveMode, reserve_tokens
from actors.shared.victim import VictimPolicy, pick_victim

__all__ = [
    "Admitted",
    "BlockManager",
    "BlockPool",
    "Extended",
    "KVError",
    "KVInvariantError",
    "KVStats",
    "PrefixMatch",
    "RadixCache",
    "RadixNode",
    "Refused",
    "RequestState",
    "ReserveMode",
    "Shortage",
    "VictimPolicy",
    "pick_victim",
    "reserve_tokens",
]
