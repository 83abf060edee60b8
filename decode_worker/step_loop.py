"""The decode engine's step loop, run where the engine lives (a thread of the worker or an engine process):
step while there is work, hand each step's outputs over, and the per-request commands that must run
between steps (add a prefilled request, abort one). Engine side only: nothing here touches the event loop."""
from __future__ import annotations

import logging
from collections.abc import Callable

from decode_worker.engine_api import DecodeEngine
from engine.runtime.outputs import StepOutput
from engine.runtime.reserved_prompts import NO_HIT, ReservedHit
from engine.sampling_params import SamplingParams
from rpc.core_board import BorrowedCores

logger = logging.getLogger(__name__)


class StepLoop:
    """hand_over(outputs): a step's outputs (called only when there are some); on_failure(engine, error): a step
    raised (the step's requests are the caller's to fail); after(engine): runs after every work call."""

    def __init__(self, hand_over: Callable[[list[StepOutput]], None],
                 on_failure: Callable[[DecodeEngine, Exception], None],
                 after: Callable[[DecodeEngine], None] | None = None) -> None:
        self._hand_over = hand_over
        self._on_failure = on_failure
        self._after = after
        self.cores: BorrowedCores | None = None  # core lending: each step's cores and threads (rpc/core_board.py)
        self.force_step = False  # step once even without work (emits finished / aborted requests)
        self.engine_steps = 0  # engine steps that produced output, and the tokens they produced (batch occupancy)
        self.engine_step_tokens = 0

    @property
    def borrowed_steps(self) -> int:
        return self.cores.borrowed_steps if self.cores is not None else 0

    def work(self, engine: DecodeEngine) -> bool:
        """One step if there is work; True when there is more."""
        if self.force_step or engine.has_work():
            self.force_step = False
            if self.cores is not None:
                self.cores.before_step()
            try:
                outputs = engine.step()
            except Exception as error:  # noqa: BLE001 - fail the streams, keep serving
                logger.exception("engine step failed; aborting running requests")
                self._on_failure(engine, error)
                outputs = []
            finally:
                if self.cores is not None:
                    self.cores.after_step()
            if outputs:
                self.engine_steps += 1
                self.engine_step_tokens += sum(len(output.new_token_ids) for output in outputs)
                self._hand_over(outputs)
        if self._after is not None:
            self._after(engine)
        more = engine.has_work()
        if not more and self.cores is not None:
            self.cores.idle()  # a prefill worker may borrow this worker's cores until the next step
        return more

    def add(self, engine: DecodeEngine, request_id: str, prompt_ids: list[int], first_token: int, page_ids: list[int],
            params: SamplingParams, state_slot: int | None, hit: ReservedHit = NO_HIT, local: bool = False) -> None:
        """A request whose KV is in place joins the running batch (local: the engine prefills it first, from its
        cached pages); if the engine refuses it, its pages, state slot and checkpoint pin go back and the error
        is raised again."""
        try:
            if local:
                engine.add_local_prefill(request_id, prompt_ids, page_ids, params, state_slot, hit)
            elif hit != NO_HIT:
                engine.add_prefilled(request_id, prompt_ids, first_token, page_ids, params, state_slot, hit)
            else:
                engine.add_prefilled(request_id, prompt_ids, first_token, page_ids, params, state_slot)
        except Exception:
            with engine.pool_lock:
                engine.free_reservation(page_ids, state_slot)
                if hit.checkpoint is not None:
                    engine.unpin_checkpoint(hit.checkpoint)
            raise
        self.force_step = True  # emits the request even if it finished on its first token

    def abort(self, engine: DecodeEngine, request_id: str) -> None:
        if engine.abort(request_id):
            self.force_step = True

    @staticmethod
    def abort_each(engine: DecodeEngine, request_ids: list[str]) -> None:
        """Aborts requests after a failed step (each failure logged, none stops the others)."""
        for request_id in request_ids:
            try:
                engine.abort(request_id)
            except Exception:  # noqa: BLE001
                logger.exception("abort of %s failed", request_id)
