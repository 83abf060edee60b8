"""Supervision (issue 15, item 6) on real processes: 2 prefill + 2 decode workers under the `pdserve up`
supervisor. SIGKILL of a decode worker: its streams migrate to the other (gateway/migration.py) and complete; it
is restarted and routed to again, and nothing leaks. SIGKILL of the prefill worker running a prompt sends
that prompt once more to the other prefill worker. A decode worker SIGSTOPped past the hang limit is killed by the
supervisor's hang watch and restarted like a dead one."""
from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from gateway.client import build_request, generate
from pdserve.hang_watch import HangPolicy, HangWatch
from pdserve.launcher import Cluster
from pdserve.supervisor import RestartPolicy, Supervisor
from rpc.internal.v1 import worker_pb2, worker_pb2_grpc
from rpc.v1 import gateway_pb2
from tests.services.conftest import launch, worker_address
from tests.services.helpers import until_value, at_rest, decode_load, gateway_stub, idle_free_pages, token_prompts, wait_for_free_pages
from tests.services.processes import alive, existing_segments, group_members, mapped_kv_segments

pytestmark = pytest.mark.slow
HANG_LIMIT_S = 20.0


@pytest.fixture(scope="module")
def supervised(service_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    cluster = launch(service_model, tmp_path_factory.mktemp("supervision_logs"), num_prefill=2, num_decode=2,
                     prefill_args=("--max-batched-tokens", "32"))
    # the hang limit is far above any health-probe delay a loaded 2-core machine shows (the gateway itself stops
    # routing to a silent decode worker after ~4.5 s), so only the SIGSTOPped worker is taken for hung
    supervisor = Supervisor(cluster, RestartPolicy(max_restarts=3, backoff_initial_s=0.5),
                            hang_watch=HangWatch(HangPolicy(limit_s=HANG_LIMIT_S, probe_interval_s=1.0,
                                                            probe_timeout_s=3.0)))
    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(0.1):
            supervisor.check()

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    yield cluster
    stop.set()
    thread.join()
    cluster.stop()


def _child(cluster: Cluster, role: str):
    return next(child for child in cluster.children if child.role == role)


async def _stream(stub, prompt: list[int], max_tokens: int) -> str:
    """How a long stream ended: the finish reason's name, or the status code's name."""
    try:
        result = await generate(stub, build_request(prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                                timeout=300)
    except grpc.aio.AioRpcError as error:
        return error.code().name
    if result.error is not None:
        return grpc.StatusCode(next(c for c in grpc.StatusCode if c.value[0] == result.error.code)).name
    return gateway_pb2.Complete.FinishReason.Name(result.complete.finish_reason)


async def test_decode_worker_killed_restarted_and_routed_to_again(supervised):
    """With streams running on both decode workers, SIGKILL of decode-0: every stream completes (decode-0's
    migrate to decode-1); new requests succeed; decode-0 comes back (restarted on its address) and gets
    requests again; both workers end at their idle baseline with no lease, the killed process group is
    gone and its shared-memory pool removed."""
    victim, survivor = worker_address(supervised, "decode-0"), worker_address(supervised, "decode-1")
    baselines = {victim: await idle_free_pages(victim), survivor: await idle_free_pages(survivor)}
    old = _child(supervised, "decode-0").process.pid
    old_pids = group_members(old) | {old}
    old_segments = mapped_kv_segments(old_pids)
    async with gateway_stub(supervised.gateway_address) as stub:
        streams = [asyncio.create_task(_stream(stub, prompt, 400)) for prompt in token_prompts((8,) * 6, seed=6)]

        async def both_busy() -> bool:
            return all([(await decode_load(address)).running > 0 for address in (victim, survivor)])

        await until_value(both_busy, "streams on both decode workers")
        os.killpg(old, signal.SIGKILL)
        endings = await asyncio.gather(*streams)
        assert endings == ["FINISH_REASON_LENGTH"] * len(endings), endings  # decode-0's streams migrated
        for prompt in token_prompts((5, 9, 13), seed=7):
            result = await generate(stub, build_request(prompt, max_tokens=4, temperature=0.0, ignore_eos=True),
                                    timeout=120)
            assert result.complete is not None, result.error

        async def back() -> bool:
            try:
                return (await decode_load(victim)).total_pages > 0
            except grpc.aio.AioRpcError:
                return False

        await until_value(back, "decode-0 to be restarted")

        async def routed_again() -> bool:
            await generate(stub, build_request([5, 6, 7], max_tokens=2, temperature=0.0, ignore_eos=True), timeout=120)
            return (await decode_load(victim)).requests_total > 0

        await until_value(routed_again, "the gateway to route to the restarted decode-0")
    assert _child(supervised, "decode-0").process.pid != old
    for address, baseline in baselines.items():
        load = await wait_for_free_pages(address, baseline, timeout=60)
        assert at_rest(load, baseline), (address, load)
    assert not alive(old_pids)
    assert old_segments and not existing_segments(old_segments)


async def test_prefill_worker_killed_mid_prompt_is_retried_elsewhere(supervised):
    """The prefill worker running a 3000-token prompt (in 32-token chunks) is killed; the gateway sends
    the prompt once more to the other prefill worker and the request completes with the same greedy
    tokens as a clean run of it."""
    prompt = token_prompts((3000,), seed=8)[0]
    addresses = [worker_address(supervised, f"prefill-{i}") for i in range(2)]
    channels = [grpc.aio.insecure_channel(address) for address in addresses]
    stubs = [worker_pb2_grpc.PrefillServiceStub(channel) for channel in channels]

    async def totals() -> list[int]:
        return [(await stub.GetPrefillLoad(worker_pb2.GetPrefillLoadRequest(), timeout=10)).requests_total
                for stub in stubs]

    try:
        before = await totals()
        async with gateway_stub(supervised.gateway_address) as stub:
            request = build_request(prompt, max_tokens=4, temperature=0.0, ignore_eos=True)
            run = asyncio.create_task(generate(stub, request, timeout=300))

            async def started() -> int | None:
                now = await totals()
                grown = [i for i in range(2) if now[i] > before[i]]
                return grown[0] + 1 if grown else None  # 1-based, so that index 0 is truthy

            running_on = await until_value(started, "the prompt to reach a prefill worker") - 1
            os.killpg(_child(supervised, f"prefill-{running_on}").process.pid, signal.SIGKILL)
            result = await run
            assert result.complete is not None, result.error
            again = await generate(stub, request, timeout=300)
        assert list(result.token_ids) == list(again.token_ids) and len(result.token_ids) == 4
        assert "prefill worker lost during prefill" in Path(supervised.log_dir, "gateway.log").read_text()
    finally:
        for channel in channels:
            await channel.close()


async def test_hung_decode_worker_is_killed_and_restarted_by_the_supervisor(supervised):
    """decode-1 SIGSTOPped and left stopped: the hang watch kills its process group once the limit passes without
    a SERVING health answer, the supervisor restarts it on its address, the gateway routes to it again, and the
    stopped processes are gone with their shared-memory pool; meanwhile requests keep succeeding on decode-0."""
    victim = worker_address(supervised, "decode-1")
    baseline = await idle_free_pages(victim)
    old = _child(supervised, "decode-1").process.pid
    old_pids = group_members(old) | {old}
    old_segments = mapped_kv_segments(old_pids)
    os.killpg(old, signal.SIGSTOP)
    try:
        async with gateway_stub(supervised.gateway_address) as stub:
            async def restarted() -> bool:
                child = _child(supervised, "decode-1")
                if child.process.pid == old:
                    return False
                try:
                    return (await decode_load(victim)).total_pages > 0
                except grpc.aio.AioRpcError:
                    return False

            deadline = time.monotonic() + HANG_LIMIT_S + 180
            while not await restarted():  # requests during the hang are served elsewhere (or migrate)
                result = await generate(stub, build_request([5, 6, 7, 8], max_tokens=3, temperature=0.0,
                                                            ignore_eos=True), timeout=120)
                assert result.complete is not None, result.error
                assert time.monotonic() < deadline, "decode-1 was not restarted"
                await asyncio.sleep(0.2)

            async def routed_again() -> bool:
                await generate(stub, build_request([5, 6, 7], max_tokens=2, temperature=0.0, ignore_eos=True),
                               timeout=120)
                return (await decode_load(victim)).requests_total > 0

            await until_value(routed_again, "the gateway to route to the restarted decode-1")
    finally:
        if alive({old}):
            os.killpg(old, signal.SIGCONT)
    load = await wait_for_free_pages(victim, baseline, timeout=60)
    assert at_rest(load, baseline), load
    assert not alive(old_pids)
    assert old_segments and not existing_segments(old_segments)
