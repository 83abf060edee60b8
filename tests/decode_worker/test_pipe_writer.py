"""PipeWriter: sending more than a pipe holds never blocks the event loop, and the reader (Connection.recv)
gets every message, whole and in order."""
from __future__ import annotations

import asyncio
from multiprocessing import Pipe

from decode_worker.pipe_writer import PipeWriter
from tests.services.helpers import eventually


async def test_a_full_pipe_does_not_block_and_keeps_order():
    """40 messages of 10 kB (several times a pipe's 64 kB) are queued at once; what did not fit waits in the
    writer, and a reader that starts later receives all 40 in order."""
    reader, end = Pipe(duplex=False)
    writer = PipeWriter(end, asyncio.get_running_loop())
    try:
        for index in range(40):
            writer.send((index, b"x" * 10_000))
        assert writer.buffered > 0  # returned at once: the rest waits for room in the pipe
        received = await asyncio.to_thread(lambda: [reader.recv() for _ in range(40)])
        assert [message[0] for message in received] == list(range(40))
        assert all(message[1] == b"x" * 10_000 for message in received)
        await eventually(lambda: writer.buffered == 0, "the writer's queue drained")
    finally:
        writer.close()
        reader.close()
