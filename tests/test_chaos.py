"""The chaos command, short, in its episodes scenario (multi-turn episodes, two external
env workers, two external reward workers): one SIGKILL of each kind, then its checks
(docs/faults.md, "Chaos"). The actors scenario has a file of its own, so that the suite runs the
two side by side."""

from __future__ import annotations

import pytest

from tests.helpers import check_chaos

pytestmark = pytest.mark.slow  # real processes end to end: left out of the fast subset


def test_chaos_loses_nothing_and_stalls_nothing_with_one_kill_of_each_kind(tmp_path):
    check_chaos(tmp_path, "episodes")
