"""The decode engine in a process of its own (DecodeWorkerConfig.engine_process): the child side.

The worker's event loop and gRPC threads then never take the GIL from the step loop. Two threads here:
the engine thread (rpc/engine_thread.py) steps the LLMEngine and runs per-request commands between steps;
the main thread reads the worker's commands from a pipe and answers reservations itself, under the
engine's pool lock, so a Reserve never waits for the step in progress. Everything goes back to the worker
on one pipe, one message per step (a compact tuple list) or per command, each with the load figures.

Wire format. Worker -> engine: (tag, op, args), each answered (tag 0: nobody waits; the answer still
carries the load figures). ops: reserve (num_tokens,),
free (page_ids, slot), add (request_id, prompt_ids, first_token, page_ids, params, slot), abort
(request_id,), stop (). Engine -> worker: ("ready", EngineFacts) | ("error", text) at start, then
("out", [output tuple], Load) | ("reply", tag, error | None, value, Load) | ("failed", [request id], text,
Load) (a failed step: those requests were aborted);
error = (kind, text), kind "ValueError" / "ResourceExhausted" / "RuntimeError"."""
from __future__ import annotations

import logging
import signal
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, NamedTuple

from decode_worker.config import DecodeWorkerConfig
from decode_worker.leases import allocate_admitted
from decode_worker.step_loop import StepLoop
from rpc.engine_thread import EngineThread
from rpc.logging_setup import configure_logging
from rpc.processes import die_with_parent, forget_parent_signals
from rpc.server import SWITCH_INTERVAL_S
from rpc.status import ResourceExhausted

logger = logging.getLogger(__name__)
ROLE = "decode-engine"


class WireOutput(NamedTuple):
    """One request's part of a step (the attributes of engine.StepOutput that streams read)."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    logprobs: list[Any]


class Load(NamedTuple):
    """The engine's figures when a message left (read by the sender, in message order)."""

    free_pages: int
    free_state_slots: int
    running: int
    waiting: int
    preemptions: int
    verify_steps: int
    draft_tokens: int
    accepted_drafts: int


@dataclass(frozen=True)
class EngineFacts:
    """What does not change after the engine is built (what the worker's receivers and book read)."""

    config: Any  # engine.engine_types.EngineConfig
    cache_shape: Any
    pool_names: tuple[str, ...]
    device: Any
    max_context: int
    num_pages: int
    num_state_slots: int
    load: Load


def load_of(engine: Any) -> Load:
    stats = engine.acceptance_stats
    return Load(engine.num_free_pages, engine.num_free_state_slots, engine.num_running, engine.num_waiting,
                engine.num_preemptions, stats.num_verify_steps, stats.num_drafts, stats.num_accepted_drafts)


def error_tuple(error: BaseException) -> tuple[str, str]:
    kind = "ResourceExhausted" if isinstance(error, ResourceExhausted) else (
        "ValueError" if isinstance(error, ValueError) else "RuntimeError")
    return kind, str(error) or type(error).__name__


class EngineHost:
    """events: the pipe to the worker (written by both threads, under one lock); engine_factory (tests):
    builds the engine instead of build_engine(config)."""

    def __init__(self, config: DecodeWorkerConfig, events: Connection,
                 engine_factory: Callable[[], Any] | None = None) -> None:
        self._events = events
        self._lock = threading.Lock()
        self._block = config.spec_block_size
        self._steps = StepLoop(self._send_outputs, self._send_failure)
        self._thread: EngineThread[Any] = EngineThread(engine_factory or (lambda: build_engine(config)),
                                                       self._steps.work, name=ROLE)
        self._engine: Any = None
        self._requests: set[str] = set()  # added and not finished or aborted (engine thread only)

    def serve(self, commands: Connection) -> None:
        """Builds the engine (its error goes to the worker), then answers commands until stop or EOF."""
        try:
            engine = self._engine = self._thread.start(build_here=True)  # one thread yet: TP followers may fork
        except Exception as error:  # noqa: BLE001 - reported to the worker's start()
            self._send(("error", str(error)))
            return
        self._send(("ready", EngineFacts(engine.config, engine.cache_shape, tuple(engine.pool_names), engine.device,
                                         engine.model_config.max_position_embeddings, engine.allocator.num_pages,
                                         engine.num_state_slots, load_of(engine))))
        try:
            while True:
                try:
                    tag, op, args = commands.recv()
                except EOFError:
                    logger.warning("the decode worker closed its pipe; stopping the engine")
                    return
                if op == "stop":
                    return
                try:
                    self._handle(tag, op, args)
                except (ResourceExhausted, ValueError) as error:  # a refusal: the caller reports it
                    self._reply(tag, error_tuple(error), None)
                except Exception as error:  # noqa: BLE001 - one bad command must not stop the engine
                    logger.exception("engine command %s failed", op)
                    self._reply(tag, error_tuple(error), None)
        finally:
            self._thread.stop()  # closes the engine: its pools go, its TP followers stop

    def _handle(self, tag: int, op: str, args: tuple[Any, ...]) -> None:
        engine = self._engine
        if op == "reserve":
            self._reply(tag, None, allocate_admitted(engine, args[0], self._block, args[1]))  # a refusal: answered by serve
        elif op == "free":
            engine.free_reservation(*args)
            self._reply(tag, None, None)
        elif op in ("add", "abort"):
            self._thread.post(lambda engine: self._between_steps(engine, tag, op, args))
        else:
            self._reply(tag, ("ValueError", f"unknown engine command {op!r}"), None)

    def _between_steps(self, engine: Any, tag: int, op: str, args: tuple[Any, ...]) -> None:
        try:
            (self._steps.add if op == "add" else self._steps.abort)(engine, *args)
        except Exception as error:  # noqa: BLE001 - answered to the caller
            self._reply(tag, error_tuple(error), None)
            return
        (self._requests.add if op == "add" else self._requests.discard)(args[0])
        self._reply(tag, None, None)

    # --- to the worker -------------------------------------------------------------------------------
    def _send(self, message: tuple[Any, ...]) -> None:
        with self._lock:
            if self._engine is not None:
                message = (*message, load_of(self._engine))
            try:
                self._events.send(message)
            except (BrokenPipeError, OSError):  # the worker is gone: the command thread ends on EOF
                logger.warning("the decode worker's pipe is closed; dropped a %s message", message[0])

    def _reply(self, tag: int, error: tuple[str, str] | None, value: Any) -> None:
        self._send(("reply", tag, error, value))

    def _send_outputs(self, outputs: list[Any]) -> None:
        for output in outputs:
            if output.finished:
                self._requests.discard(output.request_id)
        self._send(("out", [(o.request_id, o.new_token_ids, o.finished, o.finish_reason, o.logprobs or None)
                            for o in outputs]))

    def _send_failure(self, engine: Any, error: Exception) -> None:
        """A failed step aborts every request the engine holds (as on a worker's engine thread); the worker
        ends their streams."""
        failed, self._requests = sorted(self._requests), set()
        StepLoop.abort_each(engine, failed)
        self._send(("failed", failed, str(error) or type(error).__name__))


def engine_process_main(config: DecodeWorkerConfig, commands: Connection, events: Connection, log_level: int,
                        parent_ends: tuple[Connection, ...] = ()) -> None:
    """The engine process's entry point (multiprocessing fork or spawn); it dies with the worker. A forked
    one gets the worker's ends of the two pipes too (`parent_ends`) and closes them."""
    die_with_parent(signal.SIGKILL)
    if parent_ends:
        forget_parent_signals()
        for end in parent_ends:
            end.close()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C reaches the whole group: the worker stops us
    sys.setswitchinterval(SWITCH_INTERVAL_S)  # the command thread answers a Reserve without waiting 5 ms for the GIL
    configure_logging(ROLE, 0, log_level)
    EngineHost(config, events).serve(commands)


def build_engine(config: DecodeWorkerConfig) -> Any:
    from engine.llm_engine import LLMEngine

    return LLMEngine(config.engine_config())
