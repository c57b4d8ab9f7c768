"""Runs a user's agent program (`agent.command`) so that it dies with the actor.

`python -m actor.agent_shim FD -- COMMAND...`: the actor starts this in a process group
of its own, handing it the read end of a pipe whose write end only the actor holds. The
program runs as our child, in our group, with our standard streams. When the pipe reads
end-of-file (the actor is gone, by any signal or crash, on macOS as on Linux) the whole
group is killed. The exit code is the program's.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading


def main(argv: list[str]) -> int:
    fd, sep, *command = argv
    if sep != "--" or not command:
        print("usage: python -m actor.agent_shim FD -- COMMAND...", file=sys.stderr)
        return 2

    def watch() -> None:
        while True:
            try:
                if not os.read(int(fd), 1):
                    break
            except InterruptedError:
                continue
            except OSError:
                break
        os.killpg(0, signal.SIGKILL)  # the actor is gone: the program and we go too

    threading.Thread(target=watch, daemon=True).start()
    try:
        proc = subprocess.Popen(command)
    except OSError as e:
        print(f"agent.command {command[0]!r} cannot start: {e}", file=sys.stderr)
        return 127
    return proc.wait()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
