"""A deployment whose decode worker runs its engine on a thread of the worker process (`--no-engine-process`;
the default is an engine process of its own, which every other end-to-end test runs): greedy outputs through
the gateway equal the in-process engine's, speculation on and off, and the pages are free again afterwards."""
from __future__ import annotations

import psutil
import pytest

from tests.services.conftest import MAX_TOKENS, PROMPTS, launch
from tests.services.helpers import greedy_through_gateway, idle_free_pages
from tests.services.processes import descendants

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine_thread_cluster(service_model, tmp_path_factory):
    cluster = launch(service_model, tmp_path_factory.mktemp("engine_thread_logs"),
                     decode_args=("--no-engine-process",))
    yield cluster
    cluster.stop()


@pytest.mark.parametrize("speculative", [True, False], ids=["spec", "nospec"])
async def test_engine_thread_outputs_match_in_process(engine_thread_cluster, reference, speculative):
    """The 16 prompts (1..2048 tokens), sent concurrently, come back token-identical to LLM.generate; the
    decode worker has no engine process below it, and its pages are all free again afterwards."""
    decode = next(child for child in engine_thread_cluster.children if child.role.startswith("decode"))
    assert not [pid for pid in descendants(decode.process.pid) if "multiprocessing.spawn" in _cmdline(pid)]
    results = await greedy_through_gateway(engine_thread_cluster.gateway_address, PROMPTS, MAX_TOKENS, speculative)
    assert [r.token_ids for r in results] == reference[speculative]
    assert await idle_free_pages(decode.address) > 0


def _cmdline(pid: int) -> str:
    try:
        return " ".join(psutil.Process(pid).cmdline())
    except psutil.Error:
        return ""
