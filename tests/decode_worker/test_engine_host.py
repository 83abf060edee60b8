"""The engine process's side of the pipe protocol (decode_worker/engine_process.EngineHost), run on a thread
over a fake engine: reservations are answered with the load figures, refusals carry their kind, an added
request streams one message per step until it finishes, a refused one gives its pages back, a failed step is
reported with the requests it aborted, stop closes the engine. No process is started."""
from __future__ import annotations

import threading
from multiprocessing import Pipe
from types import SimpleNamespace
from typing import Any

from decode_worker.engine_process import EngineHost
from engine.engine_types import StepOutput
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


def _next(events, kind: str) -> tuple[Any, ...]:
    """The next message of `kind` (others in between are skipped); fails after 30 s without one."""
    while True:
        assert events.poll(30), f"no {kind!r} message within 30 s"
        message = events.recv()
        if message[0] == kind:
            return message


def _serve(engine: FakeEngine) -> tuple[Any, Any, threading.Thread]:
    """An EngineHost over engine on a thread: (commands to send, events to read, the thread)."""
    commands_in, commands = Pipe(duplex=False)
    events, events_out = Pipe(duplex=False)
    host = EngineHost(SimpleNamespace(spec_block_size=4), events_out, lambda: engine)
    thread = threading.Thread(target=host.serve, args=(commands_in,), daemon=True)
    thread.start()
    return commands, events, thread


def test_engine_host_answers_commands_and_streams_steps():
    """Every command is answered with the load figures; a request streams until it finishes and frees its pages."""
    engine = FakeEngine()
    commands, events, thread = _serve(engine)
    try:
        facts = _next(events, "ready")[1]
        assert (facts.num_pages, facts.pool_names, facts.max_context, facts.load.free_pages) == (PAGES, ("pool-0",), 4096, PAGES)

        commands.send((1, "reserve", (40, 0)))
        _, tag, error, value, load = _next(events, "reply")
        assert (tag, error, value, load.free_pages) == (1, None, ([0, 1, 2], None), PAGES - 3)
        commands.send((2, "reserve", (16 * 6, 0)))  # 6 pages asked, 5 free, growth headroom for none running
        _, tag, error, value, _ = _next(events, "reply")
        assert tag == 2 and error[0] == "ResourceExhausted" and value is None

        commands.send((3, "add", ("r1", [5] * 40, 7, [0, 1, 2], SamplingParams(max_new_tokens=4), None)))
        assert _next(events, "reply")[1:3] == (3, None)
        tokens, finished = [], False
        while not finished:
            _, outputs, load = _next(events, "out")
            (request_id, new, finished, reason, _),  = outputs
            tokens += new
        assert request_id == "r1" and reason == "length" and tokens == [8, 9, 10] and load.free_pages == PAGES

        commands.send((4, "reserve", (16, 0)))
        pages = _next(events, "reply")[3][0]
        commands.send((5, "add", ("bad", [], 7, pages, SamplingParams(max_new_tokens=4), None)))
        _, tag, error, _, load = _next(events, "reply")
        assert tag == 5 and error == ("ValueError", "prompt_ids is empty") and load.free_pages == PAGES

        engine.fail_next_step = True
        commands.send((6, "reserve", (16, 0)))
        pages = _next(events, "reply")[3][0]
        commands.send((7, "add", ("r2", [5], 7, pages, SamplingParams(max_new_tokens=4), None)))
        _, failed, text, load = _next(events, "failed")
        assert failed == ["r2"] and "injected step failure" in text
        assert not engine.running and load.free_pages == PAGES  # the failed step's requests were aborted
    finally:
        commands.send((0, "stop", ()))
        thread.join(30)
    assert not thread.is_alive() and engine.closed


def test_reserve_is_answered_while_a_step_runs():
    """The command thread answers Reserve and Free while the engine thread is inside a step (held here), and
    the step's output follows once it ends."""
    engine = FakeEngine()
    commands, events, thread = _serve(engine)
    try:
        _next(events, "ready")
        commands.send((1, "reserve", (16, 0)))
        pages = _next(events, "reply")[3][0]
        engine.step_gate = gate = threading.Event()
        commands.send((2, "add", ("long", [5], 7, pages, SamplingParams(max_new_tokens=3), None)))
        _next(events, "reply")
        assert engine.stepping.wait(30)
        engine.stepping.clear()
        commands.send((3, "reserve", (33, 0)))
        _, tag, error, value, load = _next(events, "reply")
        assert (tag, error, value) == (3, None, ([1, 2, 3], None)) and not gate.is_set()
        commands.send((4, "free", value))
        assert _next(events, "reply")[1] == 4 and not gate.is_set()
        gate.set()
        assert _next(events, "out")[1][0][0] == "long"
    finally:
        commands.send((0, "stop", ()))
        thread.join(30)
    assert not thread.is_alive()
