"""The chaos command, short, in its actors scenario (two actors, the second remote, two
external reward workers): one SIGKILL of each kind, then its checks (docs/faults.md, "Chaos")."""

from __future__ import annotations

import pytest

from tests.helpers import check_chaos

pytestmark = pytest.mark.slow  # real processes end to end: left out of the fast subset


def test_chaos_loses_nothing_and_stalls_nothing_with_one_kill_of_each_kind(tmp_path):
    check_chaos(tmp_path, "actors")
