"""An optional capability: sandboxes that are their sessions' registry, shared by servers.

A backend implements :class:`SharedSandboxes` when a session's sandbox records the
session (owner, id, key, when it was made and last active) where every server sees it,
and any server can reach its agent (kubernetes: a session's pod, its labels and
annotations, its agent listening on the pod network). The session manager then:

- adopts, for a call for a session it does not hold, the sandbox another server made
  (or this one, before a restart): :meth:`find`, then ``reattach``;
- lets go of a session whose sandbox another server reached since (:meth:`handed_on`),
  rather than ending it when it looks idle here: the other server serves it now;
- notes each call's activity on the sandbox (:meth:`touch`), so that whichever server
  reaps idle sessions judges by the last call anywhere.

Semantics: the agent of such a sandbox keeps its state across connections and serves the
newest server that connected, once idle; a server whose connection it let go dials again
at its next request.

Where a session's workspace outlives its sandbox (:attr:`SharedSandboxes.keeps_workspaces`:
kubernetes with a StorageClass), a session is paused by stopping its sandbox, and the
kept workspace is then its record: :meth:`~SharedSandboxes.find` and
:meth:`~SharedSandboxes.sessions` return it, not running, with how it was paused
(:meth:`~SharedSandboxes.kept` writes that), and the backend's ``create`` for the
session's key starts the sandbox on it (a resume). Ending the session deletes it
(:meth:`~SharedSandboxes.forget`).
"""

from __future__ import annotations

import abc
from typing import Any

from mcp_code_sandbox.backends.base import Leftover, Sandbox

__all__ = ["SharedSandboxes"]


class SharedSandboxes(abc.ABC):
    """See the module docstring."""

    #: A session's workspace outlives its stopped sandbox, so its sessions may be paused.
    keeps_workspaces: bool = False

    @abc.abstractmethod
    async def kept(self, key: str, paused: dict[str, Any]) -> None:
        """Record on the kept workspace of the session filed under ``key`` how it was
        paused (JSON), for whichever server resumes it. Raises what the registry answers
        (the session is paused all the same, its record says less). Only called when
        :attr:`keeps_workspaces`."""

    @abc.abstractmethod
    def ending(self, key: str) -> None:
        """The session filed under ``key`` ends: a stop of its sandbox from now on deletes
        its kept workspace rather than keeping it. Only called when
        :attr:`keeps_workspaces`."""

    @abc.abstractmethod
    async def forget(self, key: str) -> None:
        """Delete the kept workspace of the session filed under ``key`` (it ended), if
        there is one. Raises when it could not be deleted. Only called when
        :attr:`keeps_workspaces`."""

    @abc.abstractmethod
    async def follow(self) -> None:
        """Start following the sandboxes (for :meth:`sessions`), if not yet. Raises
        ``BackendUnavailable`` when their registry cannot be read now."""

    @abc.abstractmethod
    async def find(self, key: str) -> Leftover | None:
        """The running sandbox of the session filed under ``key``, whoever made it;
        ``None`` when there is none. Its ``owner`` and ``session_id`` are the sandbox's
        record: the caller checks them against the call's."""

    @abc.abstractmethod
    def sessions(self, owner: str | None) -> list[Leftover]:
        """The running sandboxes of sessions (``owner``'s, or everyone's), as this server
        last saw them: from memory, no I/O (the list may lag by a moment)."""

    @abc.abstractmethod
    def handed_on(self, sandbox: Sandbox) -> bool:
        """Another server reached ``sandbox``'s agent since this one last did, and the
        sandbox still runs. Cheap (no I/O)."""

    @abc.abstractmethod
    async def touch(self, sandbox: Sandbox) -> None:
        """Note that a call just used ``sandbox`` (bounded: at most one write now and then
        per sandbox). Never raises."""
