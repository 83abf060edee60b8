"""The decode engine in a process of its own: the child side (the worker's side is process_port.py).

The worker's event loop and gRPC threads then never take the GIL from the step loop. Two threads here:
the engine thread (rpc/engine_thread.py) steps the LLMEngine and runs per-request commands between steps;
the main thread reads the worker's commands from a pipe and answers reservations itself, under the
engine's pool lock, so a Reserve never waits for the step in progress. Everything goes back to the worker
on one pipe, one message per step or per command, each with the load figures.

Wire format: the dataclasses below, pickled. Worker -> engine: a Command (its tag names the Reply; tag 0:
nobody waits, the reply still carries the load figures) holding Reserve, Free, Add, Abort or Stop. Engine ->
worker: Ready or StartFailed at start, then Outputs (one step), Reply (one command) or StepFailed (a failed
step: those requests were aborted); before any of them, a KVUpdate when the prefix cache's KV events moved
(engine/cache/kv_events.py: a snapshot first, then the events in order; the worker mirrors them, process_port.py)."""
from __future__ import annotations

import enum
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import NamedTuple, Union

import torch

from decode_worker.config import DecodeWorkerConfig
from decode_worker.engine_api import DecodeEngine
from decode_worker.leases import allocate_admitted, free_lease
from decode_worker.step_loop import StepLoop
from engine.cache.kv_events import KVEventForwarder, KVSnapshot, Numbered
from engine.engine_config import EngineConfig
from engine.runtime.outputs import PrefixCacheStats, StepOutput
from engine.runtime.reserved_prompts import NO_HIT, PromptReservation, ReservedHit
from engine.cache.kv_cache import CacheShape
from engine.sampling_params import SamplingParams
from engine.runtime.sequence import TokenLogprob
from rpc.core_board import BorrowedCores, CoreBoard
from rpc.engine_thread import EngineThread
from rpc.logging_setup import configure_logging
from rpc.processes import die_with_parent, forget_parent_signals
from rpc.server import SWITCH_INTERVAL_S
from rpc.status import ResourceExhausted

logger = logging.getLogger(__name__)
ROLE = "decode-engine"


# --- worker -> engine ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Reserve:
    """Admit and allocate a reservation of num_tokens (pending: requests holding a claimed lease the engine
    does not run yet; prompt_ids: look the prompt up in the prefix cache first); replied with a
    leases.PromptReservation."""

    num_tokens: int
    pending: int
    prompt_ids: list[int] | None = None


@dataclass(frozen=True)
class Free:
    """Give a reservation's pages, state slot and checkpoint pin back."""

    page_ids: list[int]
    state_slot: int | None
    checkpoint: int | None = None


@dataclass(frozen=True)
class Add:
    """A claimed request joins the engine (between steps): prefilled elsewhere (running at once), or, local,
    prefilled here by the engine's scheduler (first_token ignored). hit: what its pages hold of the prefix cache."""

    request_id: str
    prompt_ids: list[int]
    first_token: int
    page_ids: list[int]
    params: SamplingParams
    state_slot: int | None
    hit: ReservedHit = NO_HIT
    local: bool = False


@dataclass(frozen=True)
class Abort:
    """Abort the request (between steps); unknown ids are ignored."""

    request_id: str


@dataclass(frozen=True)
class Stop:
    """Close the engine and end the process."""


@dataclass(frozen=True)
class Command:
    tag: int  # names the Reply (0: nobody waits for it)
    body: Reserve | Free | Add | Abort | Stop


# --- engine -> worker ----------------------------------------------------------------------------------
class WireOutput(NamedTuple):
    """One request's part of a step (the attributes of engine.StepOutput that streams read; a NamedTuple: one
    per running request per step, it pickles as cheaply as a plain tuple)."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    logprobs: list[TokenLogprob]

    @classmethod
    def of(cls, output: StepOutput) -> WireOutput:
        return cls(output.request_id, output.new_token_ids, output.finished, output.finish_reason, output.logprobs)


@dataclass(frozen=True)
class Load:
    """The engine's figures when a message left (read by the sender, in message order)."""

    free_pages: int
    free_state_slots: int
    running: int
    waiting: int
    preemptions: int
    verify_steps: int
    draft_tokens: int
    accepted_drafts: int
    prefix_cache: PrefixCacheStats = field(default_factory=PrefixCacheStats)  # all zero without a prefix cache
    borrowed_steps: int = 0  # steps run on the prefill workers' lent cores (rpc/core_board.py)


@dataclass(frozen=True)
class EngineFacts:
    """What does not change after the engine is built (what the worker's receivers and book read)."""

    config: EngineConfig
    cache_shape: CacheShape
    pool_names: tuple[str, ...]
    device: torch.device
    max_context: int
    num_pages: int
    num_state_slots: int
    load: Load


class ErrorKind(enum.Enum):
    """Which exception a failed command raises in the worker."""

    RESOURCE_EXHAUSTED = "ResourceExhausted"
    VALUE = "ValueError"
    RUNTIME = "RuntimeError"


@dataclass(frozen=True)
class WireError:
    kind: ErrorKind
    text: str

    @classmethod
    def of(cls, error: BaseException) -> WireError:
        kind = (ErrorKind.RESOURCE_EXHAUSTED if isinstance(error, ResourceExhausted)
                else ErrorKind.VALUE if isinstance(error, ValueError) else ErrorKind.RUNTIME)
        return cls(kind, str(error) or type(error).__name__)

    def exception(self) -> Exception:
        if self.kind is ErrorKind.RESOURCE_EXHAUSTED:
            return ResourceExhausted(self.text)
        return (ValueError if self.kind is ErrorKind.VALUE else RuntimeError)(self.text)


@dataclass(frozen=True)
class Ready:
    facts: EngineFacts


@dataclass(frozen=True)
class StartFailed:
    text: str


@dataclass(frozen=True)
class Outputs:
    outputs: list[WireOutput]
    load: Load


Reservation = PromptReservation  # a Reserve's (page_ids, state_slot, hit)


@dataclass(frozen=True)
class Reply:
    tag: int
    error: WireError | None
    value: Reservation | None  # a Reserve's; None for the other commands
    load: Load


@dataclass(frozen=True)
class StepFailed:
    request_ids: list[str]  # aborted by the engine process already
    text: str
    load: Load


@dataclass(frozen=True)
class KVUpdate:
    """The prefix cache's KV events since the last update: a snapshot (first, or after the buffer overflowed)
    or the numbered events of log `instance_id`."""

    snapshot: KVSnapshot | None
    instance_id: str = ""
    events: tuple[Numbered, ...] = ()


Event = Union[Ready, StartFailed, Outputs, Reply, StepFailed, KVUpdate]


def load_of(engine: DecodeEngine, borrowed_steps: int = 0) -> Load:
    stats = engine.acceptance_stats
    return Load(engine.num_free_pages, engine.num_free_state_slots, engine.num_running, engine.num_waiting,
                engine.num_preemptions, stats.num_verify_steps, stats.num_drafts, stats.num_accepted_drafts,
                engine.prefix_cache_stats, borrowed_steps)


class EngineHost:
    """events: the pipe to the worker (written by both threads, under one lock); engine_factory (tests):
    builds the engine instead of build_engine(config)."""

    def __init__(self, config: DecodeWorkerConfig, events: Connection,
                 engine_factory: Callable[[], DecodeEngine] | None = None) -> None:
        self._events = events
        self._config = config
        self._lock = threading.Lock()
        self._block = config.spec_block_size
        self._steps = StepLoop(self._send_outputs, self._send_failure)
        self._thread: EngineThread[DecodeEngine] = EngineThread(engine_factory or (lambda: build_engine(config)),
                                                                self._steps.work, name=ROLE)
        self._engine: DecodeEngine | None = None
        self._requests: set[str] = set()  # added and not finished or aborted (engine thread only)
        self._kv: KVEventForwarder | None = None  # the prefix cache's KV events, forwarded with the messages

    def serve(self, commands: Connection) -> None:
        """Builds the engine (its error goes to the worker), then answers commands until Stop or EOF."""
        try:
            engine = self._engine = self._thread.start(build_here=True)  # one thread yet: TP followers may fork
        except Exception as error:  # noqa: BLE001 - reported to the worker's start()
            self._send(StartFailed(str(error)))
            return
        if self._config.core_board:
            self._steps.cores = borrowed_cores(self._config)
        self._send(Ready(EngineFacts(engine.config, engine.cache_shape, tuple(engine.pool_names), engine.device,
                                     engine.model_config.max_position_embeddings, engine.allocator.num_pages,
                                     engine.num_state_slots, load_of(engine))))
        kv_events = getattr(engine, "kv_events", None)
        if kv_events is not None:
            with self._lock:
                self._kv = KVEventForwarder(kv_events)
                self._send_kv()  # the snapshot: the worker's mirror starts from it
        try:
            while True:
                try:
                    command: Command = commands.recv()
                except EOFError:
                    logger.warning("the decode worker closed its pipe; stopping the engine")
                    return
                if isinstance(command.body, Stop):
                    return
                try:
                    self._handle(engine, command)
                except (ResourceExhausted, ValueError) as error:  # a refusal: the caller reports it
                    self._reply(command.tag, WireError.of(error))
                except Exception as error:  # noqa: BLE001 - one bad command must not stop the engine
                    logger.exception("engine command %s failed", type(command.body).__name__)
                    self._reply(command.tag, WireError.of(error))
        finally:
            self._thread.stop()  # closes the engine: its pools go, its TP followers stop

    def _handle(self, engine: DecodeEngine, command: Command) -> None:
        tag, body = command.tag, command.body
        match body:
            case Reserve(num_tokens, pending, prompt_ids):  # a refusal: answered by serve
                self._reply(tag, None, allocate_admitted(engine, num_tokens, self._block, pending, prompt_ids))
            case Free(page_ids, state_slot, checkpoint):
                free_lease(engine, page_ids, state_slot, checkpoint)
                self._reply(tag, None)
            case Add() | Abort():
                self._thread.post(lambda engine: self._between_steps(engine, tag, body))
            case _:
                self._reply(tag, WireError(ErrorKind.VALUE, f"unknown engine command {body!r}"))

    def _between_steps(self, engine: DecodeEngine, tag: int, body: Add | Abort) -> None:
        try:
            if isinstance(body, Add):
                self._steps.add(engine, body.request_id, body.prompt_ids, body.first_token, body.page_ids, body.params,
                                body.state_slot, body.hit, body.local)
                self._requests.add(body.request_id)
            else:
                self._steps.abort(engine, body.request_id)
                self._requests.discard(body.request_id)
        except Exception as error:  # noqa: BLE001 - answered to the caller
            self._reply(tag, WireError.of(error))
            return
        self._reply(tag, None)

    # --- to the worker -------------------------------------------------------------------------------
    def _send(self, event: Event | Callable[[Load], Event]) -> None:
        """event: the message, or (once the engine exists) a function of the load figures read now, under the
        lock, so that figures follow message order."""
        with self._lock:
            if not isinstance(event, (Ready, StartFailed)):
                assert self._engine is not None
                event = event(load_of(self._engine, self._steps.borrowed_steps))
                self._send_kv()
            self._send_now(event)

    def _send_kv(self) -> None:
        """The KV events recorded since the last message (under the lock, before that message)."""
        update = self._kv.take() if self._kv is not None else None
        if isinstance(update, KVSnapshot):
            self._send_now(KVUpdate(update))
        elif update is not None:
            self._send_now(KVUpdate(None, update[0], tuple(update[1])))

    def _send_now(self, event: Event) -> None:
        try:
            self._events.send(event)
        except (BrokenPipeError, OSError):  # the worker is gone: the command thread ends on EOF
            logger.warning("the decode worker's pipe is closed; dropped a %s message", type(event).__name__)

    def _reply(self, tag: int, error: WireError | None, value: Reservation | None = None) -> None:
        self._send(lambda load: Reply(tag, error, value, load))

    def _send_outputs(self, outputs: list[StepOutput]) -> None:
        for output in outputs:
            if output.finished:
                self._requests.discard(output.request_id)
        wire = [WireOutput.of(output) for output in outputs]
        self._send(lambda load: Outputs(wire, load))

    def _send_failure(self, engine: DecodeEngine, error: Exception) -> None:
        """A failed step aborts every request the engine holds (as on a worker's engine thread); the worker
        ends their streams."""
        failed, self._requests = sorted(self._requests), set()
        StepLoop.abort_each(engine, failed)
        text = str(error) or type(error).__name__
        self._send(lambda load: StepFailed(failed, text, load))


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


def borrowed_cores(config: DecodeWorkerConfig) -> BorrowedCores:
    """Core lending for this engine process: its own cores are the mask it started with (`--cpus`), its own
    thread count the engine's; the lent cores widen both while every prefill worker on the board is idle."""
    own = frozenset(os.sched_getaffinity(0))
    lent = frozenset(config.borrow_cpus) - own
    cores = BorrowedCores(CoreBoard(config.core_board), config.core_board_slot, own, lent,
                          config.engine.num_threads or len(own), torch.set_num_threads,
                          extra_threads=config.borrow_threads)
    logger.info("core lending: %d own core(s), %d more while prefill is idle (%d thread(s) then, board %s)",
                len(own), len(lent), cores.wide_threads, config.core_board)
    return cores


def build_engine(config: DecodeWorkerConfig) -> DecodeEngine:
    from engine.runtime.llm_engine import LLMEngine

    return LLMEngine(config.engine_config())
