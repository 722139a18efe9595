"""Sessions that start and end within a test: in a module of their own, where no session
shared by other tests is alive, so that nothing but the test's own can be left behind."""

from __future__ import annotations

import pytest

from notebook_launcher import Session, SessionError
from tests.conftest import rank_processes

ALL_REDUCE = "t = torch.ones(8) * (rank + 1)\ntorch.distributed.all_reduce(t)\nt.tolist()"


def test_close_leaves_nothing_behind(leak_check):
    session = Session(num_processes=2, hardware="cpu")
    session.execute(ALL_REDUCE)
    assert len(rank_processes()) == 2
    session.close()
    session.close()
    assert not session.alive
    with pytest.raises(
        SessionError, match=r"the session is closed; create a new Session \(or %distributed start\)"
    ):
        session.execute("1")


def test_a_backend_whose_ranks_take_no_commands_is_refused_before_any_rank_starts(monkeypatch):
    from notebook_launcher.launcher.backends.local import LocalBackend

    monkeypatch.setattr(LocalBackend, "supports_sessions", False)
    with pytest.raises(
        SessionError,
        match=r"the 'local' backend cannot keep ranks for a session: its ranks take no commands "
        r"between cells\. Use notebook_launcher\(\.\.\., backend='local'\)",
    ):
        Session(num_processes=2)
    assert rank_processes() == []
