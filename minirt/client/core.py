"""What both clients share, with no socket: request errors, results, the ``generate`` message,
and ``ServerWatch`` (handshake, restart and silence detection)."""

from __future__ import annotations

import itertools
import os
import uuid
from array import array
from dataclasses import dataclass, field
from typing import Any

import msgspec

from actors.runtime.liveness import host_id
from messages import client as cm
from messages.codec import encode
from messages.common import (
    PROTOCOL_VERSION,
    ErrorCode,
    ErrorReply,
    Hello,
    Ping,
    Pong,
    SamplingParams,
)
from messages.tokenizer import ChatMessage, Generate, Tool

READY_TIMEOUT_S = 60.0  # how long a handshake waits for a runtime that does not serve yet
READY_POLL_S = 0.1
MAX_RESUMES = 5  # a stream resumed after this many lost connections fails instead
CLOSE_LINGER_MS = 500  # a closing client's frames already sent (a cancel) may still go out


class RequestError(RuntimeError):
    """The server refused or failed a request. ``code`` and ``field`` say why."""

    def __init__(self, reply: ErrorReply) -> None:
        where = f" ({reply.field})" if reply.field else ""
        super().__init__(f"{reply.code}{where}: {reply.message}")
        self.code = str(reply.code)
        self.field = reply.field
        self.message = reply.message
        self.request_id = reply.request_id


class ConnectionLost(RequestError):
    """The front door restarted or went silent while the request was open (``actor_dead``). A
    client with ``resume`` on catches it, waits for the service to serve again and resubmits the
    request with the tokens it already received (``Generate.resume_ids``)."""


@dataclass(frozen=True)
class Lost:
    """Internal to the trio client: the connection to the front door ``boot_id`` was lost."""

    reason: str
    boot_id: str


def resumed(req: Generate, received: list[int]) -> Generate:
    """``req`` again, continuing after the ``received`` token ids."""
    return msgspec.structs.replace(req, resume_ids=list(received))


@dataclass
class Result:
    request_id: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""
    usage: dict[str, int] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    logprobs: list[float] = field(default_factory=list)
    stop_reason: str | None = None
    preemptions: int = 0
    prompt_logprobs: list[float | None] = field(default_factory=list)  # params.prompt_logprobs
    embedding: list[float] = field(default_factory=list)  # params.pooling (--runner pooling)

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}

    def apply(self, msg: Any) -> bool:
        """Fold one server message of this request in; True when it ends the request. Raises
        ``RequestError`` for an error reply."""
        if isinstance(msg, cm.Delta):
            self.text += msg.text
            self.token_ids.extend(msg.token_ids)
            if msg.logprobs:
                self.logprobs.extend(msg.logprobs)
            return False
        if isinstance(msg, cm.PromptLogprobs):
            self.prompt_logprobs = list(msg.logprobs)
            return False
        if isinstance(msg, cm.Embedding):
            self.embedding = array("f", msg.data).tolist()  # (little-endian, as x86 and arm)
            return False
        if isinstance(msg, cm.Final):
            self.finish_reason = msg.finish_reason
            self.usage = msgspec.structs.asdict(msg.usage)
            self.timings = msgspec.structs.asdict(msg.timings)
            self.stop_reason = msg.stop_reason
            self.preemptions = msg.preemptions
            return True
        if isinstance(msg, ErrorReply):
            raise RequestError(msg)
        return False


def build_generate(
    prompt: str | None = None,
    *,
    messages: list[dict[str, Any]] | None = None,
    prompt_ids: list[int] | None = None,
    stop: list[str] | None = None,
    request_id: str | None = None,
    tools: list[dict[str, Any]] | None = None,
    tool_choice: str = "auto",
    parallel_tool_calls: bool = True,
    chat_template_kwargs: dict[str, Any] | None = None,
    cache_salt: str = "",
    lora: str = "",
    **params: Any,
) -> Generate:
    """A ``Generate`` message; ``params`` are ``SamplingParams`` fields (max_tokens, temperature...);
    ``tools`` are ``Tool`` maps (``name``, ``description``, ``parameters``); ``lora``: the LoRA
    adapter to run with, by name ("": the base model)."""
    return Generate(
        tools=[msgspec.convert(t, Tool) for t in tools or []],
        tool_choice=tool_choice,
        parallel_tool_calls=parallel_tool_calls,
        chat_template_kwargs=chat_template_kwargs or {},
        prompt=prompt,
        messages=[msgspec.convert(m, ChatMessage) for m in messages]
        if messages is not None
        else None,
        prompt_ids=prompt_ids,
        params=SamplingParams(**params),
        request_id=request_id or uuid.uuid4().hex,
        stop=stop or [],
        cache_salt=cache_salt,
        lora=lora,
    )


def ends_stream(msg: Any) -> bool:
    """True for a request's last message; raises ``RequestError`` for an error reply."""
    if isinstance(msg, ErrorReply):
        raise RequestError(msg)
    return isinstance(msg, cm.Final)


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` (on this host) exists and has not exited (a zombie has)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


class ServerWatch:
    """What both clients know of the server, without a socket: the handshake's answer, and
    whether the process that welcomed us restarted (a ``Pong`` with another boot id) or went
    silent. Silence counts only while a request is open; the client then pings every
    ``probe_s``, and ``dead_s`` seconds without any message lose the open requests (the clients
    then resume them, or fail them with ``resume=False``). A front door that dies is restarted
    by its supervisor within seconds and answers with a new boot id, which the client notices at
    its next ping; ``dead_s`` is for a server gone for good, so it is long: a slow, starved or
    paused server (a busy machine, a CPU quota, a debugger) is not a dead one."""

    def __init__(self, probe_s: float = 1.0, dead_s: float = 60.0, exit_s: float = 3.0) -> None:
        self.probe_s = probe_s
        self.dead_s = dead_s
        self.exit_s = exit_s  # silent this long on the same host: is its process still there?
        self.welcome: cm.Welcome | None = None
        self.last_rx = 0.0
        self.open = 0  # requests waiting for the server
        self._nonce = itertools.count(1)

    @staticmethod
    def hello() -> bytes:
        return encode(Hello(actor="client", version=PROTOCOL_VERSION, pid=os.getpid()))

    def welcomed(self, msg: Any) -> bool:
        """Check the answer to ``hello()``: raises unless the server welcomed us; True when the
        runtime serves, False while it does not yet (say ``hello`` again a little later)."""
        if isinstance(msg, ErrorReply):
            raise RequestError(msg)
        if not isinstance(msg, cm.Welcome) or not msg.ok:
            raise RuntimeError(f"server refused the handshake: {getattr(msg, 'reason', msg)}")
        self.welcome = msg
        return msg.ready

    def not_ready(self, waited: float) -> TimeoutError:
        why = self.welcome.reason if self.welcome else "no answer to hello"
        return TimeoutError(f"the runtime is not ready after {waited:.0f}s: {why}")

    def opened(self, now: float) -> None:
        """A request starts: silence counts from now if no other request was open."""
        if self.open == 0:
            self.last_rx = max(self.last_rx, now)
        self.open += 1

    def closed(self) -> None:
        self.open = max(0, self.open - 1)

    def heard(self, msg: Any, now: float) -> str | None:
        """Record a message from the server; when it is a ``Pong`` from another process than the
        one that welcomed us, returns why every open request is lost."""
        self.last_rx = now
        boot = self.welcome.boot_id if self.welcome else ""
        if isinstance(msg, Pong) and boot and msg.boot_id and msg.boot_id != boot:
            return "tokenizer service restarted; request lost"
        return None

    def silence(self, now: float) -> str | None:
        """Why the open requests are lost when the server has been silent too long, else None:
        on this host, silent ``exit_s`` with its process gone; anywhere, silent ``dead_s``."""
        silent = now - self.last_rx
        if not self.open or silent <= self.exit_s:
            return None
        w = self.welcome
        if w is not None and w.pid and w.host and w.host == host_id() and not pid_alive(w.pid):
            return f"tokenizer service exited (pid {w.pid}, silent {silent:.1f}s)"
        if silent > self.dead_s:
            return f"tokenizer service stopped answering ({silent:.1f}s)"
        return None

    def ping(self) -> bytes:
        return encode(Ping(nonce=next(self._nonce)))

    @property
    def boot_id(self) -> str:
        return self.welcome.boot_id if self.welcome else ""

    @staticmethod
    def lost(reason: str, request_id: str | None = None) -> ErrorReply:
        return ErrorReply(code=ErrorCode.ACTOR_DEAD, message=reason, request_id=request_id)
