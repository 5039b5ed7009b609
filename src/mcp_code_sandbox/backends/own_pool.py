"""An optional capability: a backend that keeps warm sandboxes of its own.

A backend implements :class:`OwnPool` when it keeps a pool of warm sandboxes beyond this
server, which its ``create`` claims from (kubernetes: anonymous pods that every replica
claims from, refilled by one replica at a time). The session manager's own warm pool
(:mod:`mcp_code_sandbox.sessions.pool`) then starts nothing, and shows the backend's
pool instead (:meth:`OwnPool.pool_counts`) in ``list_runtimes``, ``/readyz`` and
``/ui``. Such a pool keeps its size: it does not follow demand.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

__all__ = ["OwnPool", "PoolCounts"]


@dataclass(frozen=True)
class PoolCounts:
    """A backend's own warm pool as this server sees it now."""

    #: The warm sandboxes it keeps (``SANDBOX_POOL_SIZE``).
    size: int
    #: Ready to be claimed, and started but not ready yet.
    ready: int
    starting: int


class OwnPool(abc.ABC):
    """See the module docstring."""

    @abc.abstractmethod
    def pool_counts(self) -> PoolCounts:
        """Its warm sandboxes now. Cheap and read-only: what the backend already knows,
        never a call out."""
