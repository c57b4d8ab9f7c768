"""The wire format shared by the actors, the learner and the workers (no MLX here)."""

from protocol.endpoints import make_endpoints, read_endpoints, write_endpoints
from protocol.wire import (
    CREDIT,
    END,
    HEARTBEAT,
    HELLO,
    INCOMPATIBLE,
    OBSERVATION,
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
    decode,
    encode,
    is_data_cursor,
    newer_weights,
)

__all__ = [
    "CREDIT", "END", "HEARTBEAT", "HELLO", "INCOMPATIBLE", "OBSERVATION", "PROTOCOL_VERSION", "READY",
    "RESET", "ROLLOUT", "SCORE", "SCORE_REPLY", "STEP", "STOP", "WEIGHTS", "Message", "ProtocolError",
    "decode", "encode", "is_data_cursor", "make_endpoints", "newer_weights", "read_endpoints",
    "write_endpoints",
]
