"""The transport seam (transport/base.py): the one place that knows how frames move
between processes. ZeroMQ (transport/zeromq.py) is what a run uses; transport/fake.py is
an in-process stand-in for tests."""

from transport.base import SEND_TIMEOUT_MS, Again, Socket, Transport, TransportError, Watch

__all__ = ["SEND_TIMEOUT_MS", "Again", "Socket", "Transport", "TransportError", "Watch", "default"]


def default() -> Transport:
    """The transport a run uses: ZeroMQ."""
    from transport.zeromq import ZeroMQ

    return ZeroMQ()
