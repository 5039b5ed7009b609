"""Checkpoints: an optional capability of a backend, pausing with a sandbox's memory.

A backend that can save a running sandbox's whole memory to disk and start it again from
there (Docker under gVisor, see :class:`.docker.backend.DockerBackend`) implements
:class:`Checkpoints` besides :class:`~.base.Backend`; one that cannot (bwrap) does not,
and the session manager asks with :func:`checkpoints_of` instead of calling methods that
only raise. Without it a paused session keeps its interpreter's variables instead (saved
by the agent into the workspace), or its files only.

A backend with the capability may still be unable to use it on this host (Docker under
runc, an engine without experimental features): :meth:`Checkpoints.cannot_checkpoint`
says why, and the session manager then pauses as if it had none.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from mcp_code_sandbox.backends.base import Backend, Sandbox, SandboxSpec

__all__ = ["NO_CHECKPOINTS", "Checkpoint", "Checkpoints", "checkpoints_of"]

#: Why a backend without the capability keeps no paused sandbox's memory.
NO_CHECKPOINTS = "this backend cannot checkpoint a sandbox's memory"


@dataclass(frozen=True)
class Checkpoint:
    """A paused sandbox's memory on disk (:meth:`Checkpoints.checkpoint`): what
    :meth:`Checkpoints.restore` needs, and what it costs. Kept in the session's record,
    so a later server resumes it too."""

    #: The backend's name for the stopped sandbox holding the image (a container id).
    backend_id: str
    #: Bytes the image takes on disk; ``None`` when the backend cannot read it.
    bytes: int | None = None


@runtime_checkable
class Checkpoints(Protocol):
    """The capability: a backend that can keep a paused sandbox's whole memory."""

    async def cannot_checkpoint(self) -> str | None:
        """Why this backend cannot keep a paused sandbox's memory here (``None``: it
        can, with :meth:`checkpoint`). Called by the session manager at start and before
        a pause until it has a final answer; asks the engine at most once (the answer is
        kept, unless the engine did not answer)."""
        ...

    def refuses_checkpoint(self, sandbox: Sandbox) -> str | None:
        """Why ``sandbox`` cannot be checkpointed though this backend can checkpoint
        (``None``: it can). Called by the session manager before it pauses a session
        (then it saves the variables instead), so that nothing is parked in vain."""
        ...

    async def checkpoint(self, sandbox: Sandbox) -> Checkpoint:
        """Stop ``sandbox`` with its whole memory saved to disk, freeing its RAM; what
        :meth:`restore` brings back. Called by the session manager to pause an idle
        session, after its agent let go of the channel (``park``). Raises
        ``SandboxFailed`` when it could not (the sandbox may still run then: the caller
        stops it)."""
        ...

    async def unpark(self, sandbox: Sandbox) -> Sandbox:
        """Take back a sandbox whose agent let go of its channel (``park``) when its
        checkpoint then failed: the same sandbox on a new channel, once its agent said
        ``ready`` (with ``reattached``). Called by the session manager, which then saves
        the variables instead. Raises ``SandboxFailed`` when it cannot (the caller then
        stops the sandbox and keeps the files)."""
        ...

    async def restore(self, checkpoint: Checkpoint, spec: SandboxSpec) -> Sandbox:
        """Start the sandbox ``checkpoint`` saved, as it was, once its agent said
        ``ready`` (with ``reattached``). Called by the session manager on the first call
        to a paused session. Raises ``SandboxFailed`` when it cannot (the caller then
        discards the checkpoint and starts a fresh sandbox)."""
        ...

    async def discard(self, checkpoint: Checkpoint) -> None:
        """Remove a checkpoint and what holds it, for good; a no-op when gone. Called by
        the session manager when a paused session expires or its restore failed, and by
        its recovery for a paused session it cannot keep. Never raises (logs what it
        could not free)."""
        ...


def checkpoints_of(backend: Backend) -> Checkpoints | None:
    """``backend`` as :class:`Checkpoints`, or ``None`` when it has no such capability.
    Called by the session manager (its sandboxes and its recovery)."""
    return backend if isinstance(backend, Checkpoints) else None
