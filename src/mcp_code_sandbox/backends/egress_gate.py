"""An optional capability: sandboxes that reach the server's egress proxies over a network.

A backend implements :class:`GatedEgress` when its sandboxes cannot see a Unix socket of
the server (kubernetes: pods on other nodes), so the egress proxies of the sandboxes
with network listen behind one TCP port of the server instead
(:class:`~mcp_code_sandbox.egress.gate.ProxyGate`), which the backend names
(:attr:`GatedEgress.egress_gate`) and opens to a sandbox (:meth:`GatedEgress.allow_egress`).
The session side (``sessions.egress``) then hands each run of such a sandbox its proxy's
URL and credential, and never puts them in the sandbox's spec.
"""

from __future__ import annotations

import abc

from mcp_code_sandbox.backends.base import Backend, Sandbox

__all__ = ["GatedEgress", "gated_egress_of"]


class GatedEgress(abc.ABC):
    """See the module docstring."""

    #: The server's address and port the gate listens on and the sandboxes dial (port 0:
    #: any free one); ``None``: not known here, so network by permission is not offered.
    egress_gate: tuple[str, int] | None

    @abc.abstractmethod
    async def allow_egress(self, sandbox: Sandbox) -> None:
        """Open the route from ``sandbox``, started without network, to the gate (a
        session that asks for network later, or one adopted from another server); one
        started with network has it already. Raises ``SandboxFailed``."""


def gated_egress_of(backend: Backend) -> GatedEgress | None:
    """``backend`` as a :class:`GatedEgress` whose gate is known, else ``None``."""
    if isinstance(backend, GatedEgress) and backend.egress_gate is not None:
        return backend
    return None
