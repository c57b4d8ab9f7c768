"""`python -m protocol`: every message's tables, as PROTOCOL.md holds them (from
protocol/messages.py); `python -m protocol --write PROTOCOL.md` refreshes that file's."""

import sys
from pathlib import Path

from protocol.messages import fill, reference

if sys.argv[1:2] == ["--write"]:
    path = Path(sys.argv[2])
    path.write_text(fill(path.read_text()))
else:
    sys.stdout.write(reference() + "\n")
