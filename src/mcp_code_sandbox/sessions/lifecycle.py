"""A session's lifecycle: one :class:`Phase` per session, moved by :func:`transition` alone.

The phases, and what makes each true::

    RUNNING   registered and not paused: a sandbox, or none yet (files only, or one
              that died); counts against the running-session limits (``room``)
    PAUSING   a pause is under way, its lock held; its record says ``pausing``
    PAUSED    its sandbox is put away (``Session.paused`` says how); no RAM
    RESUMING  a call is bringing it back; it counts as running from here (``room``)
    FORKING   a new session being filled as a fork of another (``forking``), its lock
              held; its record says ``forking``, so a server that dies meanwhile
              leaves a half copy the next one removes
    ENDING    closed or expired: calls fail with ``session_not_found``, no sandbox
              starts for it any more, and its end frees what it holds
    ENDED     everything it held is freed
    HANDED_ON another replica holds it now (``replicas``): this server forgot it, and a
              call that waited for it here looks it up again

The moves, each with who makes it::

    RUNNING  -> PAUSING   a pause begins (the reaper, room for another, shutdown)
    PAUSING  -> PAUSED    the pause is complete
    PAUSING  -> RUNNING   the pause failed or was cut short (its next pause tries again)
    PAUSED   -> RESUMING  a call that runs code resumes it
    RESUMING -> RUNNING   resumed
    RESUMING -> PAUSED    the resume failed: still paused, its next call tries again
    RESUMING -> PAUSING   shutdown, not waiting for the call, once the resume let go of
                          the pause (its new sandbox is paused for the next server)
    RUNNING  -> FORKING   a fork, just made, begins copying its source into it
    FORKING  -> RUNNING   its files are copied (and its variables loaded, or not)
    any of the above -> ENDING   close, expiry, shutdown (also mid-pause or mid-resume)
    ENDING   -> ENDED     its end freed everything (else it stays ENDING and is retried)
    RUNNING, PAUSED -> HANDED_ON   a replica lets it go to another, between two calls
    PAUSING, RESUMING, FORKING -> HANDED_ON   a replica shuts down, not waiting for the
                                   call (the next holder finds it as its record says)

Whether its workspace is mounted is another axis (``Session.workspace_made``): a
session of any phase may be mounted or not (a paused one is mounted for a file call).
"""

from __future__ import annotations

import enum

from mcp_code_sandbox.errors import InternalError

__all__ = ["CLOSED", "Phase", "transition"]


class Phase(enum.Enum):
    RUNNING = "running"
    PAUSING = "pausing"
    PAUSED = "paused"
    RESUMING = "resuming"
    FORKING = "forking"
    ENDING = "ending"
    ENDED = "ended"
    HANDED_ON = "handed on"


#: The phases of a closed session: no call may use it again.
CLOSED = frozenset({Phase.ENDING, Phase.ENDED})

_MOVES: dict[Phase, frozenset[Phase]] = {
    Phase.RUNNING: frozenset({Phase.PAUSING, Phase.FORKING, Phase.ENDING, Phase.HANDED_ON}),
    Phase.PAUSING: frozenset({Phase.PAUSED, Phase.RUNNING, Phase.ENDING, Phase.HANDED_ON}),
    Phase.PAUSED: frozenset({Phase.RESUMING, Phase.ENDING, Phase.HANDED_ON}),
    Phase.RESUMING: frozenset(
        {Phase.RUNNING, Phase.PAUSED, Phase.PAUSING, Phase.ENDING, Phase.HANDED_ON}
    ),
    Phase.FORKING: frozenset({Phase.RUNNING, Phase.ENDING, Phase.HANDED_ON}),
    Phase.ENDING: frozenset({Phase.ENDED}),
    Phase.ENDED: frozenset(),
    Phase.HANDED_ON: frozenset(),
}


def transition(phase: Phase, to: Phase) -> Phase:
    """``to``, when the table in the module docstring has the move from ``phase``; else
    ``InternalError`` (a bug of ours, never a client's doing). Every change of a
    session's phase is ``session.phase = transition(session.phase, to)``."""
    if to not in _MOVES[phase]:
        raise InternalError(f"a session cannot go from {phase.value} to {to.value}")
    return to
