"""Random admit / cache / decode / finish / release / evict sequences over a tiny pool.

12 blocks of 4 tokens over a vocabulary of 3, so prefixes collide all the time. A shadow map
(block -> token ids written into it) is kept here, independently of the library; every reused
or cached block must hold exactly the tokens of its position. ``check()`` runs after each step.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from actors.kv import Admitted, BlockManager, Extended, Refused, Shortage

BS = 4
NUM_BLOCKS = 12
VOCAB = 3
BASES = [
    [0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 1, 2, 0],
    [0, 1, 2, 0, 1, 2, 0, 1, 1, 1, 1, 1, 2, 2, 2, 2],
    [2, 2, 2, 2, 0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2],
]
tokens = st.integers(0, VOCAB - 1)
prompts = st.one_of(
    st.lists(tokens, min_size=1, max_size=14),
    st.builds(
        lambda base, n, tail: base[:n] + tail,
        st.sampled_from(BASES),
        st.integers(1, 16),
        st.lists(tokens, max_size=5),
    ),
)


@dataclass
class Req:
    written: list[int]  # tokens whose KV exists, in order
    max_tokens: int


def state(m: BlockManager) -> tuple[object, ...]:
    nodes = []
    stack = [m.cache.root]
    while stack:
        n = stack.pop()
        nodes.append((n.block, n.key, n.lock, n.last_access))
        stack.extend(n.children.values())
    reqs = {rid: (list(r.blocks), r.lock) for rid, r in m.requests.items()}
    return (m.pool.refs_snapshot(), sorted(m.pool._free), sorted(nodes), reqs, m.stats())


class KVMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.m = BlockManager(NUM_BLOCKS, BS)
        self.shadow: dict[int, list[int | None]] = {}
        self.reqs: dict[str, Req] = {}
        self.histories: list[list[int]] = []
        self.next_id = 0

    @initialize(mode=st.sampled_from(["full", "on_demand"]), lookahead=st.integers(0, 2))
    def setup(self, mode: str, lookahead: int) -> None:
        self.m = BlockManager(NUM_BLOCKS, BS, mode=mode, lookahead_blocks=lookahead)  # type: ignore[arg-type]

    # ---- helpers -------------------------------------------------------------------------

    def fresh(self, blocks: list[int]) -> None:
        for b in blocks:
            assert self.m.pool.ref(b) == 1 and not self.m.cache.contains(b), b
            self.shadow[b] = [None] * BS  # newly allocated: garbage until written

    def write(self, rid: str, new_tokens: list[int]) -> None:
        """Model the executor writing KV for ``new_tokens`` after the request's written ones."""
        req = self.reqs[rid]
        table = self.m.block_table(rid)
        for tok in new_tokens:
            pos = len(req.written)
            b = table[pos // BS]
            # a block being written is exclusively this request's and never cached
            assert self.m.pool.ref(b) == 1 and not self.m.cache.contains(b), (rid, pos, b)
            self.shadow[b][pos % BS] = tok
            req.written.append(tok)

    def pick(self, data: st.DataObject) -> str:
        return data.draw(st.sampled_from(sorted(self.reqs)), label="request")

    def drop(self, rid: str, freed: list[int], table: list[int]) -> None:
        del self.reqs[rid]
        assert len(set(freed)) == len(freed) and set(freed) <= set(table)
        for b in freed:
            assert self.m.pool.ref(b) == 0
        for b in set(table) - set(freed):
            assert self.m.pool.ref(b) > 0

    def do_admit(self, prompt: list[int], max_tokens: int) -> None:
        m = self.m
        rid = f"r{self.next_id}"
        self.next_id += 1
        reserve = m.reserve_for(len(prompt), max_tokens)
        peek = m.peek_match(prompt)
        can = m.can_admit(prompt, reserve)
        before = state(m)
        res = m.admit(rid, prompt, reserve)
        if isinstance(res, Refused):
            assert not can
            assert res.blocks_needed > res.blocks_free + res.blocks_evictable
            assert state(m) == before, "refusal changed state"
            return
        assert isinstance(res, Admitted) and can
        cached = res.cached_tokens
        assert cached == peek and cached % BS == 0 and cached < len(prompt)
        assert len(res.block_table) == -(-reserve // BS)
        assert res.block_table == res.block_table[: cached // BS] + res.new_blocks
        for i, b in enumerate(res.block_table[: cached // BS]):
            assert self.shadow[b] == prompt[i * BS : (i + 1) * BS], "wrong reuse"
        for b in res.evicted_blocks:
            assert b in res.new_blocks or m.pool.ref(b) == 0
        self.fresh(res.new_blocks)
        self.reqs[rid] = Req(list(prompt[:cached]), max_tokens)
        self.write(rid, prompt[cached:])

    # ---- rules ---------------------------------------------------------------------------

    @rule(prompt=prompts, max_tokens=st.integers(0, 8))
    def admit(self, prompt: list[int], max_tokens: int) -> None:
        self.do_admit(prompt, max_tokens)

    @precondition(lambda self: bool(self.histories))
    @rule(data=st.data(), tail=st.lists(tokens, min_size=1, max_size=4))
    def admit_follow_up(self, data: st.DataObject, tail: list[int]) -> None:
        history = data.draw(st.sampled_from(self.histories), label="history")
        self.do_admit(history + tail, 4)

    @precondition(lambda self: bool(self.reqs))
    @rule(data=st.data())
    def cache_prefix(self, data: st.DataObject) -> None:
        rid = self.pick(data)
        self.m.cache_prefix(rid, self.reqs[rid].written)

    @precondition(lambda self: bool(self.reqs))
    @rule(data=st.data(), new=st.lists(tokens, min_size=1, max_size=6))
    def decode(self, data: st.DataObject, new: list[int]) -> None:
        m = self.m
        rid = self.pick(data)
        req = self.reqs[rid]
        old = m.block_table(rid)
        target = len(req.written) + len(new)
        want = m.reserve_for(target, max(0, req.max_tokens - len(new)))
        before = state(m)
        res = m.extend(rid, want)
        if isinstance(res, Shortage):
            assert res.blocks_needed > res.blocks_free + res.blocks_evictable
            assert state(m) == before, "shortage changed state"
            victim = m.pick_victim(exclude={rid})
            if victim is None:
                return
            table = m.block_table(victim)
            self.drop(victim, m.release(victim), table)
            res = m.extend(rid, want)
            if isinstance(res, Shortage):
                return
        assert isinstance(res, Extended)
        assert m.block_table(rid) == old + res.new_blocks
        assert len(old + res.new_blocks) == max(len(old), -(-want // BS))
        self.fresh(res.new_blocks)
        self.write(rid, new)
        req.max_tokens = max(0, req.max_tokens - len(new))

    @precondition(lambda self: bool(self.reqs))
    @rule(data=st.data(), whole=st.booleans())
    def finish(self, data: st.DataObject, whole: bool) -> None:
        rid = self.pick(data)
        written = self.reqs[rid].written
        n = len(written) if whole else data.draw(st.integers(0, len(written)), label="n")
        table = self.m.block_table(rid)
        self.drop(rid, self.m.finish(rid, written[:n]), table)
        if n:
            self.histories.append(written[:n])

    @precondition(lambda self: bool(self.reqs))
    @rule(data=st.data(), cache=st.booleans())
    def release(self, data: st.DataObject, cache: bool) -> None:
        rid = self.pick(data)
        table = self.m.block_table(rid)
        written = self.reqs[rid].written
        self.drop(rid, self.m.release(rid, cache=cache, token_ids=written), table)

    @precondition(lambda self: bool(self.reqs))
    @rule(
        policy=st.sampled_from(["newest", "priority"]),
        prios=st.dictionaries(st.sampled_from([f"r{i}" for i in range(40)]), st.integers(0, 3)),
    )
    def preempt(self, policy: str, prios: dict[str, int]) -> None:
        m = self.m
        victim = m.pick_victim(policy, prios)  # type: ignore[arg-type]
        assert victim is not None
        if policy == "newest":
            assert victim == max(m.requests, key=lambda r: m.requests[r].seq)
        else:
            lowest = min(prios.get(r, 0) for r in m.requests)
            assert prios.get(victim, 0) == lowest
        table = m.block_table(victim)
        self.drop(victim, m.release(victim), table)

    @rule(n=st.integers(0, NUM_BLOCKS))
    def evict(self, n: int) -> None:
        m = self.m
        evictable = m.cache.evictable
        evicted = m.evict(n)
        assert len(evicted) == min(n, evictable)
        for b in evicted:
            assert m.pool.ref(b) == 0

    @rule(prompt=prompts)
    def peek(self, prompt: list[int]) -> None:
        before = state(self.m)
        got = self.m.peek_match(prompt)
        assert state(self.m) == before
        assert got % BS == 0 and (got < len(prompt) or got == 0)

    # ---- invariants ----------------------------------------------------------------------

    @invariant()
    def consistent(self) -> None:
        m = self.m
        m.check()
        s = m.stats()
        assert s.free + s.cached_only + s.in_use == NUM_BLOCKS
        assert set(m.requests) == set(self.reqs)
        # every cached block holds exactly the tokens of its tree edge
        stack = [m.cache.root]
        while stack:
            node = stack.pop()
            for child in node.children.values():
                assert tuple(self.shadow[child.block]) == child.key, "cached wrong tokens"
                stack.append(child)


KVMachine.TestCase.settings = settings(
    max_examples=2000,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestKVStateful = KVMachine.TestCase
