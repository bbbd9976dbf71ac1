"""ExecutorCore: the executor actor's decisions as a pure, synchronous state machine.

Messages in, an outbox out; no sockets, no threads, the clock injected. The executor actor
(``gpu/actor.py``) drives it around the real ``ModelRunner``; the replay (``minirt/replay/execsim.py``)
drives the same core around a stand-in whose forward is the fitted step-time model. What it owns:

- **the flight ledger**: each running attempt (``Flight``): its attempt number, prompt, the
  tokens it produced, the growth it asked for;
- **runs**: ``x_run`` starts a request in the runner; a constrained one first needs its matcher,
  built from the front door's compiled grammar (``Run.grammar``) by the driver, off the step
  loop (``take_builds`` / ``GrammarBuilt``); a preemption or abort meanwhile is answered at once;
- **ends**: ``x_preempt`` / ``x_stop`` drop a request and tell the scheduler (``done``);
- **the burst wait**: with nothing running and the scheduler admitting more right behind the
  last run (``x_run.more``), the driver waits (bounded) for the rest before the first step
  (``gathers``, ``gathered``, ``burst_waited``);
- **publishing** a step (``planned``, ``stepped``): ``prefill_done`` for the prompts a step
  completes as soon as it is planned, then its tokens, the ends, and the KV growth one
  ``lookahead`` ahead of need (``gpu/publish.py``);
- **the disk tier** (``--kv-disk-dir``, ``gpu/disk/io.py``): runs whose prefix is read from
  disk first, the writes and deletes the KV manager asks for, done by the driver off the loop;
- **recovery** from a peer's crash (``gpu/recovery.py``): what runs here for a restarted
  scheduler (``held``), every block table for the KV manager's successor (``holding``).

The runner (``Runner``) is what holds the requests' state and runs the steps: ``ModelRunner``.
The executor trusts what it runs (the front door validated it): see ``gpu/requests.py``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

from actors.shared.grammar import Compiled, GrammarCache, GrammarError
from gpu.disk.io import DiskIO, DiskRead, DiskWritten
from gpu.lora.cache import AdapterCache, LoraLoaded
from gpu.publish import step_messages
from gpu.recovery import Recovery
from gpu.request_table import RequestTable
from gpu.requests import ExecutorInputError, StepResult
from gpu.spec.verify import spec_fields
from gpu.state import CoreState, Flight, Outgoing
from gpu.step.plan import burst_end
from gpu.structured.builds import GrammarBuilt, MatcherBuilds
from messages import executor as xm
from messages import kv
from messages.common import LoraRef
from messages.scheduler import PrefillDone, RequestDone
from messages.tokenizer import RequestAdmitted


class Runner(Protocol):
    """What the core drives: ``gpu.model_runner.ModelRunner``, or the replay's stand-in. ``requests``
    holds what runs; ``start`` adds a run to it (the executor builds its sampling state)."""

    requests: RequestTable

    def start(self, run: xm.Run, grammar: Compiled | None) -> None: ...


class ExecutorCore:
    def __init__(
        self,
        runner: Runner,
        lookahead_tokens: int,
        burst_wait_s: float,
        log: Any,
        clock: Callable[[], float] = time.monotonic,
        grammars: GrammarCache | None = None,
        draft_tokens: int = 0,
        disk: DiskIO | None = None,
        loras: AdapterCache | None = None,
    ) -> None:
        self.runner = runner
        self.state = CoreState(
            runner.requests,
            log,
            clock,
            MatcherBuilds(grammars) if grammars is not None else None,
            disk,
            loras,
        )
        self.loras = loras
        self.requests = runner.requests
        self.lookahead = lookahead_tokens
        self.draft_tokens = draft_tokens  # speculative decoding: drafts a step may verify
        self.burst_wait_s = burst_wait_s
        self.log = log
        self.clock = clock
        self.flight = self.state.flight
        self.builds = self.state.builds
        self.disk = self.state.disk
        self.prefill_s = 0.0  # recent prefill steps' seconds per token (what a load saves)
        self.more_coming = False  # the last run said another is being admitted behind it
        self.steps = 0
        self.recovery = Recovery(self.state)
        self.send = self.state.send
        self.building = self.state.building

    # ------------------------------------------------------------------ outbox
    @property
    def outbox(self) -> list[Outgoing]:
        return self.state.outbox

    def take_outbox(self) -> list[Outgoing]:
        out, self.state.outbox = self.state.outbox, []
        return out

    def take_builds(self) -> list[xm.Run]:
        """The constrained runs whose matcher the driver is to build
        (``gpu.structured.builds.build_grammar``) and hand back as ``GrammarBuilt``."""
        return self.builds.take() if self.builds is not None else []

    def take_loras(self) -> list[LoraRef]:
        """The LoRA adapters the driver is to load (``gpu.lora.cache.load_adapter``) and hand
        back as ``LoraLoaded``."""
        return self.loras.take() if self.loras is not None else []

    def take_disk(self) -> list[xm.Run | xm.DiskSave | xm.DiskDrop]:
        """The disk-tier work for the driver's worker threads (``gpu/disk/io.py``): runs whose
        files to read (answered with ``DiskRead``), saves (``DiskWritten``) and deletes."""
        return self.disk.take() if self.disk is not None else []

    # ------------------------------------------------------------------ inputs
    def apply(self, msg: Any) -> None:
        """A message from the inbox (``x_run``, ``x_extend``, ``x_preempt``, ``x_stop``) or a
        driver's ``GrammarBuilt``."""
        if isinstance(msg, xm.Run):
            self._run(msg)
            return
        if isinstance(msg, GrammarBuilt):
            if self.builds is not None and self.builds.done(msg):  # else dropped since
                self._built(msg.run, msg.result, msg.seconds, cache_hit=False)
            return
        if isinstance(msg, LoraLoaded):
            self._lora_loaded(msg)
            return
        if isinstance(msg, (DiskRead, DiskWritten, xm.DiskSave, xm.DiskDrop)):
            self._disk(msg)
            return
        if not isinstance(msg, xm.Extend) and self._stop_building(msg.request_id, msg.attempt):
            status = "preempted" if isinstance(msg, xm.Preempt) else "aborted"
            self.log.info("executor.compile_dropped", request_id=msg.request_id, status=status)
            self.send(
                "scheduler",
                RequestDone(request_id=msg.request_id, attempt=msg.attempt, status=status),
            )
            return
        fl = self.flight.get(msg.request_id)
        if fl is None or fl.attempt != msg.attempt:
            return  # the request already ended; the sender learns it from RequestDone
        if isinstance(msg, xm.Extend):
            self.requests.extend(msg.request_id, msg.blocks)
            self.log.debug("executor.extended", request_id=msg.request_id, blocks=msg.blocks)
        else:  # x_preempt or x_stop
            preempt = isinstance(msg, xm.Preempt)
            fl = self._end(msg.request_id, "preempted" if preempt else "aborted")
            what = {"request_id": msg.request_id, "attempt": fl.attempt}
            if preempt:
                self.log.info("executor.preempted", **what, output_tokens=len(fl.outputs))
            else:
                self.log.info(
                    "executor.aborted", **what, output_tokens=len(fl.outputs), reason=msg.reason
                )

    def _stop_building(self, rid: str, attempt: int | None = None) -> bool:
        loading = self.disk is not None and self.disk.drop(rid, attempt)
        loading = loading or (self.loras is not None and self.loras.drop(rid, attempt))
        return loading or (self.builds is not None and self.builds.drop(rid, attempt))

    def _disk(self, msg: DiskRead | DiskWritten | xm.DiskSave | xm.DiskDrop) -> None:
        if self.disk is None:
            return
        if isinstance(msg, (xm.DiskSave, xm.DiskDrop)):
            self.disk.queue(msg)
        elif isinstance(msg, DiskWritten):
            self.log.info(
                "executor.disk_written",
                save_id=msg.save.save_id,
                blocks=len(msg.save.keys) - len(msg.failed),
                failed=len(msg.failed),
                bytes=msg.nbytes,
                seconds=round(msg.seconds, 6),
            )
            done = kv.DiskSaved(save_id=msg.save.save_id, keys=msg.save.keys, failed=msg.failed)
            self.send("kv_manager", done)
        elif (run := self.disk.done(msg)) is not None:
            self.log.info(
                "executor.disk_loaded",
                request_id=msg.run.request_id,
                blocks=len(msg.payloads),
                bytes=sum(map(len, msg.payloads)),
                seconds=round(msg.seconds, 6),
                cached_tokens=run.cached_tokens,
            )
            if msg.payloads:  # what a block costs read here, against computed
                rates = kv.DiskRates(
                    load_s=msg.seconds / len(msg.payloads), prefill_s=self.prefill_s
                )
                self.send("kv_manager", rates)
            if msg.bad is not None:
                key, why = msg.bad
                self.log.warning(
                    "executor.disk_bad_block", request_id=msg.run.request_id, key=key, reason=why
                )
                self.send("kv_manager", kv.DiskDropped(keys=[key], reason=why))
                fewer = RequestAdmitted(
                    request_id=run.request_id,
                    cached_tokens=run.cached_tokens,
                    queue_s=0.0,
                    attempt=run.attempt,
                    recomputed=True,
                )
                self.send("tokenizer", fewer)
            self._go(run)

    def _run(self, msg: xm.Run) -> None:
        rid = msg.request_id
        self.more_coming = msg.more
        if rid in self.flight:  # a stale attempt still here: drop it first
            self.requests.abort(rid)
            self.flight.pop(rid)
        self._stop_building(rid)
        if msg.load_keys and self.disk is not None:
            self.disk.load(msg)  # started once its blocks are read (DiskRead)
            return
        self._go(msg)

    def _go(self, msg: xm.Run) -> None:
        """Start a run whose cached prefix is in its blocks: now, or once its adapter is
        resident and its matcher built."""
        waits = msg.params.lora is not None and self.loras is not None
        if waits and self.loras.start(msg) is None:  # type: ignore[union-attr]
            return  # started once its adapter is loaded (LoraLoaded)
        self._match(msg)

    def _lora_loaded(self, msg: LoraLoaded) -> None:
        assert self.loras is not None
        runs, failed = self.loras.done(msg)
        for run in runs:
            if failed is None:
                self._match(run)
            else:
                self._reject(run, ExecutorInputError(run.request_id, "lora", str(failed)))

    def _match(self, msg: xm.Run) -> None:
        """Start a run now, or once its matcher is built."""
        if msg.params.structured is None or self.builds is None:
            self._start(msg, None)
            return
        found = self.builds.start(msg)
        if found is not None:
            self._built(msg, found, 0.0, cache_hit=isinstance(found, Compiled))

    def _built(
        self, msg: xm.Run, result: Compiled | GrammarError, seconds: float, cache_hit: bool
    ) -> None:
        if isinstance(result, GrammarError):
            self._reject(msg, ExecutorInputError(msg.request_id, result.field, result.reason))
            return
        cache = self.builds.cache if self.builds is not None else None
        self.log.info(
            "executor.structured_compiled",
            request_id=msg.request_id,
            kind=result.constraint.kind,
            hash=result.constraint.digest,
            cache_hit=cache_hit,
            compile_s=round(result.compile_s, 6),
            wait_s=round(seconds, 6),
            cache_hits=cache.hits if cache else 0,
            cache_misses=cache.misses if cache else 0,
        )
        self._start(msg, result)

    def _reject(self, msg: xm.Run, e: ExecutorInputError) -> None:
        self.log.warning(
            "executor.rejected", request_id=msg.request_id, field=e.field, reason=e.reason
        )
        self.send(
            "scheduler",
            RequestDone(
                request_id=msg.request_id,
                attempt=msg.attempt,
                status="error",
                message=str(e),
                field=e.field,
            ),
        )

    def _start(self, msg: xm.Run, grammar: Compiled | None) -> None:
        rid = msg.request_id
        try:
            self.runner.start(msg, grammar)
        except ExecutorInputError as e:
            self._reject(msg, e)
            return
        self.flight[rid] = Flight(msg.attempt, msg.prompt_ids, msg.output_offset, self.clock())
        self.log.info(
            "executor.running",
            request_id=rid,
            attempt=msg.attempt,
            prompt_tokens=len(msg.prompt_ids),
            cached_tokens=msg.cached_tokens,
            blocks=len(msg.block_table),
            **({"lora": msg.params.lora.name} if msg.params.lora is not None else {}),
        )

    def _end(self, rid: str, status: str) -> Flight:
        """Drop the request (``status`` preempted or aborted) and tell the scheduler."""
        fl = self.flight.pop(rid)
        self.requests.abort(rid)
        self.send(
            "scheduler",
            RequestDone(request_id=rid, attempt=fl.attempt, status=status, output_ids=fl.outputs),
        )
        return fl

    # ------------------------------------------------------------------ the burst wait
    def gathers(self, was_idle: bool) -> bool:
        """Whether to wait for a burst before the first step: nothing was running before this
        round's messages, and the scheduler is admitting more right behind the last run."""
        return was_idle and self.more_coming and self.burst_wait_s > 0 and self.requests.has_work()

    def gathered(self) -> bool:
        """Whether the wait is over: nothing more is coming, or a full step's budget is held."""
        return not self.more_coming or self.requests.fills_a_step()

    def burst_waited(self, waited_s: float) -> None:
        self.log.info(
            "executor.burst_waited",
            waited_s=round(waited_s, 6),
            requests=self.requests.num_requests(),
            ended=burst_end(self.more_coming, self.requests.fills_a_step()),
        )
        self.more_coming = False

    # ------------------------------------------------------------------ steps
    def planned(self, rids: list[str]) -> None:
        """The step just planned completes these prompts: tell the scheduler now, while the
        forward runs, so that the requests it held back for their prefix are admitted in time
        for the next step (``PrefillDone``). Safe: whatever arrives during a step is applied
        after it, once the forward has written that KV (a forward that raises ends the
        process, and the KV manager then drops its cache)."""
        for rid in rids:
            fl = self.flight.get(rid)
            if fl is not None:
                self.send("scheduler", PrefillDone(request_id=rid, attempt=fl.attempt))

    def stepped(self, result: StepResult, step_s: float, control_s: float) -> None:
        """Publish ``result``; a counted step (one that ran requests) is logged."""
        for peer, msg in step_messages(
            result,
            self.flight,
            self.requests,
            self.lookahead,
            self.recovery.kv_down,
            self.log,
            self.clock,
            self.draft_tokens,
        ):
            self.send(peer, msg)
        if not result.num_requests:
            return
        if result.num_prefill_tokens >= 64:  # a prefill step: its cost per token
            rate = result.forward_s / (result.num_prefill_tokens + result.num_decode_tokens)
            self.prefill_s = rate if not self.prefill_s else 0.7 * self.prefill_s + 0.3 * rate
        self.steps += 1
        self.log.info(
            "executor.step",
            step=self.steps,
            requests=result.num_requests,
            prefill_tokens=result.num_prefill_tokens,
            decode_tokens=result.num_decode_tokens,
            skipped=len(result.skipped),
            constrained=result.num_constrained,
            mask_s=round(result.mask_s, 6),
            forward_s=round(result.forward_s, 6),
            step_s=round(step_s, 6),
            control_s=round(control_s, 6),
            decode_ctx=result.decode_ctx,
            prefill_ctx=result.prefill_ctx,
            **spec_fields(result.spec),
            **({} if result.prefill_cap is None else {"prefill_cap": result.prefill_cap}),
            **({"loras": result.loras} if result.loras else {}),
        )
        if result.refit is not None:  # the adaptive budget's model, refitted on its steps
            self.log.info("executor.step_model", step=self.steps, **result.refit.as_dict())
