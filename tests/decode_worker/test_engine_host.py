"""The engine process's side of the pipe protocol (decode_worker/engine_process.EngineHost), run on a thread
over a fake engine: reservations are answered with the load figures, refusals carry their kind, an added
request streams one message per step until it finishes, a refused one gives its pages back, a failed step is
reported with the requests it aborted, stop closes the engine. The fake engine implements engine_api.DecodeEngine
(checked), so renaming what the host uses of an engine breaks it. No process is started."""
from __future__ import annotations

import threading
from multiprocessing import Pipe
from types import SimpleNamespace
from typing import Any

from decode_worker.engine_api import DecodeEngine
from decode_worker.engine_process import (Add, Command, EngineHost, ErrorKind, Free, Outputs, Ready, Reply, Reserve,
                                          StepFailed, Stop, WireError)
from engine.cache.prefix_cache import PrefixHit
from engine.runtime.outputs import PrefixCacheStats, StepOutput
from engine.runtime.reserved_prompts import PromptReservation
from engine.sampling_params import SamplingParams

PAGES = 8


class FakeEngine:
    """The LLMEngine surface the host uses: 8 pages of 16 tokens, one token per running request per step."""

    def __init__(self) -> None:
        self.config = SimpleNamespace(page_size=16, tp_size=1, kv_pool="shm")
        self.model_config = SimpleNamespace(max_position_embeddings=4096)
        self.allocator = SimpleNamespace(num_pages=PAGES)
        self.cache_shape, self.pool_names, self.device = None, ("pool-0",), "cpu"
        self.pool_lock = threading.RLock()
        self.acceptance_stats = SimpleNamespace(num_verify_steps=0, num_drafts=0, num_accepted_drafts=0)
        self.prefix_cache_stats = PrefixCacheStats()
        self.num_state_slots = self.num_free_state_slots = self.num_waiting = self.num_preemptions = 0
        self.free: list[int] = list(range(PAGES))
        self.running: dict[str, list[Any]] = {}  # request id -> [pages, tokens left, next token]
        self.fail_next_step = False
        self.step_gate: threading.Event | None = None  # set: steps wait for it (a long forward)
        self.stepping = threading.Event()
        self.closed = False

    @property
    def num_free_pages(self) -> int:
        return len(self.free)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def allocate_reservation(self, num_tokens: int) -> tuple[list[int], None]:
        count = -(-num_tokens // 16)
        pages, self.free = self.free[:count], self.free[count:]
        return pages, None

    def free_reservation(self, pages: list[int], slot: None) -> None:
        self.free += pages

    def match_prompt(self, prompt_ids: list[int]) -> PrefixHit:
        return PrefixHit([], [], None)  # no prefix cache

    def unpin_checkpoint(self, checkpoint: int) -> None:
        raise AssertionError("no hit was taken, so no checkpoint is pinned")

    def add_local_prefill(self, request_id, prompt_ids, pages, params, slot=None, hit=None) -> None:
        raise AssertionError("these tests add prefilled requests only")

    def add_prefilled(self, request_id, prompt_ids, first_token, pages, params, slot) -> None:
        if not prompt_ids:
            raise ValueError("prompt_ids is empty")
        self.running[request_id] = [pages, params.max_new_tokens - 1, first_token + 1]

    def abort(self, request_id: str) -> bool:
        state = self.running.pop(request_id, None)
        if state is not None:
            self.free += state[0]
        return state is not None

    def has_work(self) -> bool:
        return bool(self.running)

    def step(self) -> list[StepOutput]:
        self.stepping.set()
        if self.step_gate is not None:
            assert self.step_gate.wait(60), "the test never let the step finish"
        if self.fail_next_step:
            self.fail_next_step = False
            raise RuntimeError("injected step failure")
        outputs = []
        for request_id, state in list(self.running.items()):
            state[1] -= 1
            outputs.append(StepOutput(request_id, [state[2]], state[1] == 0, "length" if state[1] == 0 else None))
            state[2] += 1
            if state[1] == 0:
                self.free += self.running.pop(request_id)[0]
        return outputs

    def close(self) -> None:
        self.closed = True


def _next(events, kind: type) -> Any:
    """The next message of `kind` (others in between are skipped); fails after 30 s without one."""
    while True:
        assert events.poll(30), f"no {kind.__name__} message within 30 s"
        message = events.recv()
        if isinstance(message, kind):
            return message


def _serve(engine: FakeEngine) -> tuple[Any, Any, threading.Thread]:
    """An EngineHost over engine on a thread: (commands to send, events to read, the thread)."""
    commands_in, commands = Pipe(duplex=False)
    events, events_out = Pipe(duplex=False)
    host = EngineHost(SimpleNamespace(spec_block_size=4, core_board=None), events_out, lambda: engine)
    thread = threading.Thread(target=host.serve, args=(commands_in,), daemon=True)
    thread.start()
    return commands, events, thread


def test_engine_host_answers_commands_and_streams_steps():
    """Every command is answered with the load figures; a request streams until it finishes and frees its pages."""
    engine = FakeEngine()
    assert isinstance(engine, DecodeEngine)
    commands, events, thread = _serve(engine)
    try:
        facts = _next(events, Ready).facts
        assert (facts.num_pages, facts.pool_names, facts.max_context, facts.load.free_pages) == (PAGES, ("pool-0",), 4096, PAGES)

        commands.send(Command(1, Reserve(40, 0)))
        reply = _next(events, Reply)
        assert (reply.tag, reply.error, reply.value, reply.load.free_pages) == (1, None, PromptReservation([0, 1, 2], None), PAGES - 3)
        commands.send(Command(2, Reserve(16 * 6, 0)))  # 6 pages asked, 5 free, growth headroom for none running
        reply = _next(events, Reply)
        assert reply.tag == 2 and reply.error.kind is ErrorKind.RESOURCE_EXHAUSTED and reply.value is None

        commands.send(Command(3, Add("r1", [5] * 40, 7, [0, 1, 2], SamplingParams(max_new_tokens=4), None)))
        reply = _next(events, Reply)
        assert (reply.tag, reply.error) == (3, None)
        tokens, finished = [], False
        while not finished:
            message = _next(events, Outputs)
            (output,) = message.outputs
            tokens += output.new_token_ids
            finished = output.finished
        assert output.request_id == "r1" and output.finish_reason == "length" and tokens == [8, 9, 10]
        assert message.load.free_pages == PAGES

        commands.send(Command(4, Reserve(16, 0)))
        pages = _next(events, Reply).value[0]
        commands.send(Command(5, Add("bad", [], 7, pages, SamplingParams(max_new_tokens=4), None)))
        reply = _next(events, Reply)
        assert reply.tag == 5 and reply.error == WireError(ErrorKind.VALUE, "prompt_ids is empty")
        assert reply.load.free_pages == PAGES

        engine.fail_next_step = True
        commands.send(Command(6, Reserve(16, 0)))
        pages = _next(events, Reply).value[0]
        commands.send(Command(7, Add("r2", [5], 7, pages, SamplingParams(max_new_tokens=4), None)))
        failed = _next(events, StepFailed)
        assert failed.request_ids == ["r2"] and "injected step failure" in failed.text
        assert not engine.running and failed.load.free_pages == PAGES  # the failed step's requests were aborted
    finally:
        commands.send(Command(0, Stop()))
        thread.join(30)
    assert not thread.is_alive() and engine.closed


def test_reserve_is_answered_while_a_step_runs():
    """The command thread answers Reserve and Free while the engine thread is inside a step (held here), and
    the step's output follows once it ends."""
    engine = FakeEngine()
    commands, events, thread = _serve(engine)
    try:
        _next(events, Ready)
        commands.send(Command(1, Reserve(16, 0)))
        pages = _next(events, Reply).value[0]
        engine.step_gate = gate = threading.Event()
        commands.send(Command(2, Add("long", [5], 7, pages, SamplingParams(max_new_tokens=3), None)))
        _next(events, Reply)
        assert engine.stepping.wait(30)
        engine.stepping.clear()
        commands.send(Command(3, Reserve(33, 0)))
        reply = _next(events, Reply)
        assert (reply.tag, reply.error, reply.value) == (3, None, PromptReservation([1, 2, 3], None)) and not gate.is_set()
        commands.send(Command(4, Free(reply.value.page_ids, reply.value.state_slot)))
        assert _next(events, Reply).tag == 4 and not gate.is_set()
        gate.set()
        assert _next(events, Outputs).outputs[0].request_id == "long"
    finally:
        commands.send(Command(0, Stop()))
        thread.join(30)
    assert not thread.is_alive()
