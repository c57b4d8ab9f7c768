"""The wire: message kinds, the msgpack codec and its checks, endpoints, keys and the
sockets every process opens (PROTOCOL.md). No MLX here; a run's config and files are in
`runtime`."""

from protocol.endpoints import make_endpoints, read_endpoints, write_endpoints
from protocol.messages import decode
from protocol.wire import (
    CREDIT,
    END,
    HEARTBEAT,
    HELLO,
    INCOMPATIBLE,
    OBSERVATION,
    PARTIAL,
    PROTOCOL_VERSION,
    READY,
    RESET,
    ROLLOUT,
    SCORE,
    SCORE_REPLY,
    STEP,
    STOP,
    WEIGHTS,
    Message,
    ProtocolError,
    encode,
    is_data_cursor,
    newer_weights,
)

__all__ = [
    "CREDIT",
    "END",
    "HEARTBEAT",
    "HELLO",
    "INCOMPATIBLE",
    "OBSERVATION",
    "PARTIAL",
    "PROTOCOL_VERSION",
    "READY",
    "RESET",
    "ROLLOUT",
    "SCORE",
    "SCORE_REPLY",
    "STEP",
    "STOP",
    "WEIGHTS",
    "Message",
    "ProtocolError",
    "decode",
    "encode",
    "is_data_cursor",
    "make_endpoints",
    "newer_weights",
    "read_endpoints",
    "write_endpoints",
]
