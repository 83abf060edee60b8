"""The decode engine in its own process, seen from the worker: the EnginePort (engine_api.py) of every decode
worker.

The worker starts decode_worker/engine_process.py (forked while the worker is single-threaded on the CPU,
else spawned; it dies with the worker, and its TP followers with it) over two pipes: commands out (never
blocking the loop: pipe_writer.py), and one message per engine step or command back, read by the event
loop itself (add_reader): no thread of this process touches the engine, so nothing here takes the GIL from
its step loop. Reservations are answered by the engine process's command thread (never behind a step). If
the engine process dies, the open streams and waiting calls fail (EngineFailed / Unavailable), the death
is logged and `on_lost` runs."""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import multiprocessing as mp
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

from decode_worker.config import DecodeWorkerConfig
from decode_worker.engine_api import LoadSnapshot, snapshot_of
from decode_worker.engine_process import (Abort, Add, Command, EngineFacts, Event, Free, KVUpdate, Load, Outputs, Ready,
                                          Reply, Reservation, Reserve, StartFailed, StepFailed, Stop,
                                          engine_process_main)
from decode_worker.engine_view import EngineView
from decode_worker.pipe_writer import PipeWriter
from decode_worker.streams import Streams
from engine.runtime.reserved_prompts import NO_HIT, ReservedHit
from engine.cache.kv_events import KVEventLog, KVSnapshot, Numbered
from engine.sampling_params import SamplingParams
from engine.weights.weight_store import remove_stale_segments
from kvtransfer.shm_pool import cleanup_stale_segments
from rpc.processes import child_start_method
from rpc.status import Unavailable

logger = logging.getLogger(__name__)


class ProcessPort:
    """on_lost(reason): called once if the engine process dies or closes its pipe while serving."""

    def __init__(self, config: DecodeWorkerConfig, streams: Streams, on_lost: Callable[[str], None] | None = None) -> None:
        self._config = config
        self._streams = streams
        self.on_lost = on_lost
        self._process: BaseProcess | None = None
        self._commands: PipeWriter | None = None
        self._events: Connection | None = None  # the receive end
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready: asyncio.Future[EngineFacts] | None = None
        self._pending: dict[int, asyncio.Future[Reservation | None]] = {}
        self._tags = itertools.count(1)
        self._gone: str | None = None  # why the engine process can no longer be used
        self._stopping = False
        self._events_closed = False  # the engine process's end of the pipe is closed
        self.engine: EngineView | None = None
        self.engine_steps = 0
        self.engine_step_tokens = 0
        self.kv_events = KVEventLog()  # a mirror of the engine's prefix cache events (empty with the cache off)

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def snapshot(self) -> LoadSnapshot:
        return snapshot_of(self.engine, self._config.spec_block_size) if self.engine is not None else LoadSnapshot()

    # --- lifecycle ---------------------------------------------------------------------------------------
    async def start(self) -> EngineView:
        """Spawns the engine process and waits until its engine is built; raises its construction error."""
        loop = self._loop = asyncio.get_running_loop()
        method = child_start_method(self._config.engine.device)
        context = mp.get_context(method)
        events, child_events = context.Pipe(duplex=False)
        child_commands, commands = context.Pipe(duplex=False)
        self._events = events
        parent_ends = (events, commands) if method == "fork" else ()  # a forked child closes its copies
        self._process = context.Process(target=engine_process_main, name="pdserve-decode-engine", daemon=False,
                                        args=(self._config, child_commands, child_events, logging.getLogger().level,
                                              parent_ends))
        if method == "fork":
            self._process.start()  # here, on the loop's thread: a second thread would make the fork unsafe
        else:
            await asyncio.to_thread(self._process.start)
        child_events.close()
        child_commands.close()
        self._commands = PipeWriter(commands, loop)
        self._ready = loop.create_future()
        loop.add_reader(events.fileno(), self._on_events)
        loop.add_reader(self._process.sentinel, self._on_exit)
        try:
            facts = await self._ready
        except BaseException:
            self._stopping = True
            await self._reap(timeout=30)
            raise
        self.engine = EngineView(facts)
        logger.info("decode engine process %d (%s) ready: %d pages, pools %s", self._process.pid, method,
                    facts.num_pages, ", ".join(facts.pool_names))
        return self.engine

    async def stop(self, timeout: float = 30.0) -> None:
        """Asks the engine process to finish (it closes the engine: pools unlinked, TP followers stopped)."""
        self._stopping = True
        if self._process is None:
            return
        if self._gone is None:
            with contextlib.suppress(Unavailable):  # its pipe broke: it is gone or going, reaped below
                self._send(Command(0, Stop()))
        await self._reap(timeout)

    async def _reap(self, timeout: float) -> None:
        process = self._process
        await asyncio.to_thread(process.join, timeout)
        if process.is_alive():
            logger.warning("decode engine process %d did not stop within %s s; killing it", process.pid, timeout)
            process.kill()
            await asyncio.to_thread(process.join, 10)
        self._lost(f"decode engine process stopped (exit code {process.exitcode})")
        removed = cleanup_stale_segments()  # a killed engine leaves its pool segments behind
        if removed:
            logger.info("removed %d KV pool segment(s) the engine process left", len(removed))
        remove_stale_segments()  # and the weight segment it owned, when no other process outlived it there

    # --- commands ----------------------------------------------------------------------------------------
    def _send(self, command: Command) -> None:
        if self._gone is not None:
            raise Unavailable(f"decode engine unavailable: {self._gone}")
        assert self._commands is not None
        try:
            self._commands.send(command)
        except OSError as error:
            self._lost(f"decode engine pipe broke: {error}")
            raise Unavailable(f"decode engine unavailable: {self._gone}") from error

    async def _call(self, body: Reserve | Add | Abort) -> Reservation | None:
        assert self._loop is not None
        tag = next(self._tags)
        future = self._pending[tag] = self._loop.create_future()
        try:
            self._send(Command(tag, body))
        except BaseException:
            self._pending.pop(tag, None)
            raise
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:  # nobody waits for the answer now: take its error, if any, when it comes
            future.add_done_callback(lambda done: done.cancelled() or done.exception())
            raise

    def _post(self, body: Free | Abort) -> None:
        """A command nobody waits for (its answer only updates the load figures); dropped if the engine is gone."""
        if self._gone is None:
            try:
                self._send(Command(0, body))
            except Unavailable:
                logger.warning("engine command %s dropped: %s", type(body).__name__, self._gone)

    async def allocate(self, num_tokens: int, pending: int = 0, prompt_ids: list[int] | None = None) -> Reservation:
        """Admission and allocation (after a prefix-cache lookup of prompt_ids, when given) by the engine
        process's command thread. A caller cancelled while it waits leaves nothing behind: the pages are freed
        when the answer comes."""
        task = asyncio.ensure_future(self._call(Reserve(num_tokens, pending, prompt_ids)))
        try:
            reservation = await asyncio.shield(task)
        except asyncio.CancelledError:
            task.add_done_callback(self._free_answer)
            raise
        assert reservation is not None
        return reservation

    def _free_answer(self, task: asyncio.Future[Reservation | None]) -> None:
        if not task.cancelled() and task.exception() is None:
            reservation = task.result()
            if reservation is not None:
                self.free(reservation.page_ids, reservation.state_slot, reservation.hit.checkpoint)

    def free(self, page_ids: list[int], state_slot: int | None, checkpoint: int | None = None) -> None:
        self._post(Free(page_ids, state_slot, checkpoint))

    async def add(self, request_id: str, prompt_ids: list[int], first_token: int, page_ids: list[int],
                  params: SamplingParams, state_slot: int | None, hit: ReservedHit = NO_HIT,
                  local: bool = False) -> None:
        try:
            await self._call(Add(request_id, prompt_ids, first_token, page_ids, params, state_slot, hit, local))
        except asyncio.CancelledError:  # the command still runs: an abort after it (FIFO) frees the pages
            self.abort_soon(request_id)
            raise

    def abort_soon(self, request_id: str) -> None:
        self._post(Abort(request_id))

    async def abort(self, request_id: str) -> None:
        if self._gone is None:
            await self._call(Abort(request_id))

    # --- event loop: what the engine process sends -------------------------------------------------------
    def _on_events(self) -> None:
        if self._events_closed:
            return
        try:
            while self._events.poll():
                self._handle(self._events.recv())
        except (EOFError, OSError):  # it exited (or is exiting): the exit handler says how
            self._events_closed = True
            assert self._loop is not None
            self._loop.remove_reader(self._events.fileno())
            if self._process.exitcode is not None:
                self._on_exit()

    def _handle(self, event: Event) -> None:
        match event:
            case Outputs(outputs, load):
                self.engine_steps += 1
                self.engine_step_tokens += sum(len(output.new_token_ids) for output in outputs)
                self._update(load)
                self._streams.deliver(outputs)
            case Reply(tag, error, value, load):
                self._update(load)
                future = self._pending.pop(tag, None)
                if future is not None and not future.done():
                    if error is None:
                        future.set_result(value)
                    else:
                        future.set_exception(error.exception())
            case KVUpdate(snapshot, instance_id, events):
                self._mirror(snapshot, instance_id, events)
            case StepFailed(failed, text, load):  # the engine process aborted the step's requests already
                self._update(load)
                self._streams.fail(failed, f"engine step failed: {text}")
            case Ready(facts) if self._ready is not None and not self._ready.done():
                self._ready.set_result(facts)
            case StartFailed(text) if self._ready is not None and not self._ready.done():
                self._ready.set_exception(RuntimeError(text))

    def _mirror(self, snapshot: KVSnapshot | None, instance_id: str, events: tuple[Numbered, ...]) -> None:
        if snapshot is not None:
            self.kv_events.adopt(snapshot)
        elif not self.kv_events.extend(instance_id, events):  # cannot happen on an ordered pipe: say so
            logger.error("KV events of the engine process out of order (instance %s, first %s, mirror at %d)",
                         instance_id, events[0][0] if events else None, self.kv_events.sequence)

    def _update(self, load: Load) -> None:
        if self.engine is not None:
            self.engine.update(load)

    def _on_exit(self) -> None:
        if self._gone is None:
            self._on_events()  # what it sent before it died goes first
        if self._process.exitcode is None:  # its pipes close a moment before it can be reaped
            self._process.join(5)
        self._lost_while_serving(f"the decode engine process exited (exit code {self._process.exitcode})")

    def _lost_while_serving(self, reason: str) -> None:
        if self._gone is not None:
            return
        if not self._stopping:
            logger.error("%s; failing %d open stream(s)", reason, len(self._streams.open_ids()))
        self._lost(reason)
        if not self._stopping and self.on_lost is not None:
            self.on_lost(reason)

    def _lost(self, reason: str) -> None:
        """Fails whatever waits on the engine process; idempotent."""
        if self._gone is not None:
            return
        self._gone = reason
        if self._loop is not None:
            self._loop.remove_reader(self._process.sentinel)
            if not self._events_closed:
                self._loop.remove_reader(self._events.fileno())
        for future in self._pending.values():
            if not future.done():
                future.set_exception(Unavailable(f"decode engine unavailable: {reason}"))
        self._pending.clear()
        if self._ready is not None and not self._ready.done():
            self._ready.set_exception(RuntimeError(f"engine failed to start: {reason}"))
        self._streams.fail_all(reason)
        if self._commands is not None:
            self._commands.close()
        self._events_closed = True
        self._events.close()
