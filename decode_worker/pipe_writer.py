"""Sending to a multiprocessing Connection from an event loop without ever blocking it.

Connection.send blocks while the pipe is full. The worker's event loop must not: the engine process may
itself be blocked writing step outputs the loop has not read yet, and both would wait for ever. PipeWriter
frames each object as Connection does (a 4-byte big-endian length, then the pickle), so the other end
reads it with Connection.recv, writes what the pipe takes now, and lets loop.add_writer send the rest."""
from __future__ import annotations

import asyncio
import os
import pickle
import struct
from multiprocessing.connection import Connection

_MAX_FRAME = 0x7FFFFFFF  # Connection's short header; longer messages use another one (never needed here)


class PipeWriter:
    """connection: the send end of a Pipe(duplex=False); it is set non-blocking and owned from now on."""

    def __init__(self, connection: Connection, loop: asyncio.AbstractEventLoop) -> None:
        self._connection = connection
        self._fd = connection.fileno()
        self._loop = loop
        self._pending = bytearray()
        self._armed = False  # add_writer is waiting for room in the pipe
        os.set_blocking(self._fd, False)

    @property
    def buffered(self) -> int:
        return len(self._pending)

    def send(self, obj: object) -> None:
        """Queues obj; raises BrokenPipeError / OSError if the reader is gone."""
        payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        if len(payload) > _MAX_FRAME:
            raise ValueError(f"message of {len(payload)} bytes is too large for the pipe")
        self._pending += struct.pack("!i", len(payload)) + payload
        self._flush()

    def _flush(self) -> None:
        try:
            while self._pending:
                written = os.write(self._fd, self._pending)
                del self._pending[:written]
        except BlockingIOError:
            pass
        finally:
            if self._pending and not self._armed:
                self._loop.add_writer(self._fd, self._on_writable)
                self._armed = True
            elif not self._pending and self._armed:
                self._loop.remove_writer(self._fd)
                self._armed = False

    def _on_writable(self) -> None:
        try:
            self._flush()
        except OSError:  # the reader is gone: the exit handler reports it
            self.close()

    def close(self) -> None:
        if self._armed:
            self._loop.remove_writer(self._fd)
            self._armed = False
        self._pending.clear()
        self._connection.close()
