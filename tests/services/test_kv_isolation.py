"""KV isolation (issue 15, item 2) on the shared deployment: a Prefill sent straight to the prefill
worker with a destination naming another request's reserved pages is refused before it writes a byte,
so the victim's greedy output is unchanged."""
from __future__ import annotations

import dataclasses

import grpc
import pytest

from engine.sampling_params import SamplingParams
from gateway.client import build_request, generate
from kvtransfer.destination import Destination
from rpc.convert import sampling_to_proto
from rpc.internal.v1 import kv_pb2, worker_pb2, worker_pb2_grpc
from tests.services.conftest import worker_address
from tests.services.helpers import decode_once, gateway_stub, prefill_once, token_prompts

pytestmark = pytest.mark.slow
MAX_TOKENS = 12


async def test_forged_prefill_into_another_requests_pages_writes_nothing(cluster):
    """The victim is reserved and prefilled by hand; then forged Prefills aim at its pages (its own
    request id with a guessed lease id; the attacker's own real lease over the victim's pages; the
    victim's destination under the attacker's id). Each is refused, and the victim's decoded tokens
    equal the gateway's greedy output for the same prompt."""
    victim_prompt, attacker_prompt = token_prompts((40, 40), seed=15)
    sampling = sampling_to_proto(SamplingParams(max_new_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    decode_address, prefill_address = worker_address(cluster, "decode-0"), worker_address(cluster, "prefill-0")
    async with grpc.aio.insecure_channel(decode_address) as decode_channel, \
            grpc.aio.insecure_channel(prefill_address) as prefill_channel:
        decode, prefill = worker_pb2_grpc.DecodeServiceStub(decode_channel), worker_pb2_grpc.PrefillServiceStub(prefill_channel)

        async def reserve(request_id: str) -> kv_pb2.KVDestination:
            return (await decode.Reserve(worker_pb2.ReserveRequest(
                request_id=request_id, num_prompt_tokens=40, max_new_tokens=MAX_TOKENS,
                transport=kv_pb2.TRANSPORT_SHM), timeout=30)).destination

        async def prefill_into(request_id: str, prompt: list[int], destination: Destination):
            return await prefill_once(prefill, worker_pb2.PrefillRequest(
                request_id=request_id, token_ids=prompt, sampling=sampling, destination=destination.to_proto()), 60)

        victim = Destination.from_proto(await reserve("victim"))
        attacker = Destination.from_proto(await reserve("attacker"))
        first = (await prefill_into("victim", victim_prompt, victim)).first_token
        forged = [
            ("victim", dataclasses.replace(victim, lease_id="0" * 32)),
            ("attacker", dataclasses.replace(attacker, page_ids=victim.page_ids)),
            ("attacker", dataclasses.replace(victim, request_id="attacker")),
        ]
        for request_id, destination in forged:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await prefill_into(request_id, attacker_prompt, destination)
            assert caught.value.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.ALREADY_EXISTS,
                                           grpc.StatusCode.FAILED_PRECONDITION), caught.value
        tokens = [first] + await decode_once(decode, worker_pb2.DecodeRequest(
            request_id="victim", lease_id=victim.lease_id, token_ids=victim_prompt, first_token=first,
            sampling=sampling), 120)
        assert (await decode.Release(worker_pb2.ReleaseRequest(request_id="attacker"), timeout=30)).found
    async with gateway_stub(cluster.gateway_address) as stub:
        expected = await generate(stub, build_request(victim_prompt, max_tokens=MAX_TOKENS, temperature=0.0,
                                                      ignore_eos=True), timeout=120)
    assert tokens == list(expected.token_ids)
