"""SIGINT in the kernel: a ``KeyboardInterrupt`` inside user code, never inside the agent.

The supervisor interrupts a run by sending SIGINT to the kernel's process group. Raised at
the wrong moment (while a frame is half written to the control socket, or between cells)
a ``KeyboardInterrupt`` would corrupt the protocol or kill the kernel. So the agent owns
SIGINT: between cells it is swallowed; while a cell runs it is Python's own C handler
(``default_int_handler``, so no agent frame shows in the traceback); inside a critical
section of a cell (sending a ``display`` message) it is deferred to the section's end.
A handler the user installs lasts until the end of that cell.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

__all__ = ["InterruptGate"]


class InterruptGate:
    def __init__(self) -> None:
        self._deferred = False

    def install(self) -> None:
        signal.signal(signal.SIGINT, self._between_cells)

    def _between_cells(self, signum: int, frame: FrameType | None) -> None:
        """The run is over already (or not started): nothing to stop."""

    def _defer(self, signum: int, frame: FrameType | None) -> None:
        self._deferred = True

    @contextmanager
    def armed(self) -> Iterator[None]:
        """Around user code: SIGINT raises ``KeyboardInterrupt`` in it."""
        self._deferred = False
        signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, self._between_cells)

    @contextmanager
    def critical(self) -> Iterator[None]:
        """Around agent work inside a cell that must not be cut in half."""
        if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
            yield  # between cells, or the user's own handler: nothing would raise here
            return
        signal.signal(signal.SIGINT, self._defer)
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, signal.default_int_handler)
        if self._deferred:
            self._deferred = False
            raise KeyboardInterrupt
