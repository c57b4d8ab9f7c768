"""A stranger flooding one TCP endpoint, for tests/test_flood.py: idle connections that
never say a word, then frames far over any limit, one per connection, in each of ZMTP's
greetings (3.x with CURVE and with NULL, 2.0, and 1.0's length-prefixed frames). Standard
library only: no key, no libzmq, nothing of this project.

    python tests/flood.py HOST PORT --idle 2500 --oversized 50 --hold 30

Prints `idle N`, then `oversized N sent M MB` and `holding`, and keeps every connection
open until --hold seconds pass or its stdin closes.
"""

from __future__ import annotations

import argparse
import resource
import select
import socket
import sys
import time

SIGNATURE = b"\xff" + b"\0" * 8 + b"\x7f"
CLAIMED = 256 << 20  # what each oversized frame says it holds


def zmtp3(mechanism: bytes, flags: bytes) -> bytes:
    """A 3.0 greeting (signature, version, mechanism, as-server, filler), then the header
    of a long frame: a command (CURVE's HELLO would be one) or a message."""
    return (
        SIGNATURE
        + b"\x03\x00"
        + mechanism.ljust(20, b"\0")
        + b"\0"
        + b"\0" * 31
        + flags
        + CLAIMED.to_bytes(8, "big")
    )


GREETINGS = [
    zmtp3(b"CURVE", b"\x06"),
    zmtp3(b"NULL", b"\x02"),
    SIGNATURE + b"\x01\x05" + b"\x02" + CLAIMED.to_bytes(8, "big"),  # 2.0: revision 1, a DEALER
    b"\xff" + CLAIMED.to_bytes(8, "big") + b"\0",  # 1.0: a frame of that length
]


def oversized(host: str, port: int, greeting: bytes, body_mb: int) -> int:
    """Send `greeting` and up to `body_mb` MB of the frame it announces; the bytes that
    went out before the other end closed the connection."""
    sent = 0
    try:
        conn = socket.create_connection((host, port), timeout=5)
        conn.sendall(greeting)
        chunk = b"\x01" * (1 << 20)
        for _ in range(body_mb):
            conn.sendall(chunk)
            sent += len(chunk)
    except OSError:
        return sent
    conn.close()
    return sent


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("host")
    parser.add_argument("port", type=int)
    parser.add_argument("--idle", type=int, default=2500)
    parser.add_argument("--oversized", type=int, default=50)
    parser.add_argument("--body-mb", type=int, default=4)
    parser.add_argument("--hold", type=float, default=30.0)
    args = parser.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    for target in (hard, 10240):  # macOS: its per-process maximum, whatever `hard` says
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            break
        except (ValueError, OSError):
            continue
    idle = []
    for _ in range(args.idle):
        try:
            idle.append(socket.create_connection((args.host, args.port), timeout=10))
        except OSError as e:
            print(f"connect failed: {e}", flush=True)
    print(f"idle {len(idle)}", flush=True)
    sent = sum(
        oversized(args.host, args.port, GREETINGS[i % len(GREETINGS)], args.body_mb)
        for i in range(args.oversized)
    )
    print(f"oversized {args.oversized} sent {sent / (1 << 20):.1f} MB", flush=True)
    print("holding", flush=True)
    deadline = time.monotonic() + args.hold
    while time.monotonic() < deadline:
        if select.select([sys.stdin], [], [], 0.2)[0] and not sys.stdin.read(1):
            break  # the test closed our stdin: done


if __name__ == "__main__":
    main()
