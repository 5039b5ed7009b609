"""``sessions/lifecycle.py``: a session's phases move only as the table says."""

from __future__ import annotations

import pytest

from mcp_code_sandbox.errors import InternalError
from mcp_code_sandbox.sessions.lifecycle import CLOSED, Phase, transition

P = Phase


@pytest.mark.parametrize(
    ("start", "to"),
    [
        (P.RUNNING, P.PAUSING),
        (P.PAUSING, P.PAUSED),
        (P.PAUSING, P.RUNNING),
        (P.PAUSED, P.RESUMING),
        (P.RESUMING, P.RUNNING),
        (P.RESUMING, P.PAUSED),
        (P.RESUMING, P.PAUSING),
        (P.RUNNING, P.ENDING),
        (P.PAUSING, P.ENDING),
        (P.PAUSED, P.ENDING),
        (P.RESUMING, P.ENDING),
        (P.ENDING, P.ENDED),
        (P.RUNNING, P.HANDED_ON),  # a replica lets it go between two calls
        (P.PAUSED, P.HANDED_ON),
        (P.PAUSING, P.HANDED_ON),  # a replica shuts down mid-pause
        (P.RESUMING, P.HANDED_ON),
        (P.RUNNING, P.FORKING),  # a fork, just made, is filled
        (P.FORKING, P.RUNNING),
        (P.FORKING, P.ENDING),  # its copy refused, or it was closed meanwhile
        (P.FORKING, P.HANDED_ON),
    ],
)
def test_each_drawn_move_is_made(start: Phase, to: Phase) -> None:
    assert transition(start, to) is to


@pytest.mark.parametrize(
    ("start", "to"),
    [
        (P.RUNNING, P.PAUSED),  # a pause is always under way first
        (P.PAUSED, P.RUNNING),  # a resume is too
        (P.RUNNING, P.RUNNING),
        (P.PAUSING, P.PAUSING),
        (P.ENDING, P.RUNNING),  # a closed session never comes back
        (P.ENDED, P.ENDING),
        (P.RUNNING, P.ENDED),  # ended only by way of its end
        (P.ENDING, P.HANDED_ON),  # a closed session is nobody's to take over
        (P.ENDED, P.HANDED_ON),
        (P.PAUSED, P.FORKING),  # only a new session is filled as a fork
        (P.FORKING, P.PAUSING),  # a fork is never paused half-copied
    ],
)
def test_a_move_the_table_lacks_is_an_internal_error(start: Phase, to: Phase) -> None:
    with pytest.raises(InternalError, match=f"from {start.value} to {to.value}"):
        transition(start, to)


def test_only_ending_and_ended_are_closed() -> None:
    assert {p for p in Phase if p in CLOSED} == {P.ENDING, P.ENDED}


@pytest.mark.parametrize("to", list(Phase))
def test_nothing_leaves_handed_on(to: Phase) -> None:
    """This server forgot it: another replica holds it, and only that one moves it."""
    with pytest.raises(InternalError, match="from handed on to"):
        transition(P.HANDED_ON, to)
