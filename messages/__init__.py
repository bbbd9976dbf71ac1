"""The minirt wire protocol: typed msgspec structs, one module per receiver, msgpack on the wire.

- ``common``: version, handshake (Hello/HelloAck), health (Ping/Pong), errors, SamplingParams
- ``client``: what clients receive from the tokenizer service
- ``tokenizer``: what the tokenizer service accepts (clients, scheduler, executor)
- ``scheduler``: what the scheduler accepts (tokenizer, KV manager, executor)
- ``kv``: what the KV manager accepts (scheduler, executor, queries)
- ``executor``: what the executor accepts (scheduler, KV manager)
- ``codec``: ``encode`` and typed ``Decoder``
"""

from messages.common import PROTOCOL_VERSION

__all__ = ["PROTOCOL_VERSION"]
