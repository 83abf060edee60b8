"""What KV events cost (engine/cache/kv_events.py, issue 34 item 2): a decode step with the prefix cache recording
its events vs not, interleaved, and the gateway's side of cache-aware routing (a prompt's page keys and its overlap
with an index).

- decode step: B unique prompts, then plain decode steps (greedy, no speculation); per step, the median engine.step()
  time of the steps with nothing waiting, with events off (PrefixCache.events = None) and on (recorded, and taken by a
  KVEventForwarder after every step and pickled, as the decode engine process does before each message). Pages get
  published every page_size tokens per sequence, so a step records about B / page_size events.
- gateway: PromptKeys + KVIndex.overlap for prompts of 1K..16K tokens against an index holding them.

    .venv/bin/python -m benchmarks.bench_kv_events --model models/pdserve-tiny --repeats 5
"""
from __future__ import annotations

import argparse
import pickle
import random
import statistics
import time

from benchmarks.common import Metrics, add_common_arguments, interleave, load_note, median, paired, print_header, spread
from engine import SamplingParams
from engine.cache.kv_events import KVEventForwarder, KVEventLog, PageStored
from engine.cache.page_keys import page_keys
from engine.engine_config import EngineConfig
from engine.runtime.llm_engine import LLMEngine
from gateway.kv_index import KVIndex, PromptKeys
from rpc.kv_event_stream import snapshot_to_proto

VOCAB_LOW, VOCAB_HIGH = 4, 3000


def decode_run(engine: LLMEngine, log: KVEventLog, events_on: bool, seed: int, batch: int, prompt_len: int,
               steps: int) -> Metrics:
    cache = engine.prefix_cache
    assert cache is not None
    cache.events = log if events_on else None
    forwarder = KVEventForwarder(log) if events_on else None
    rng = random.Random(seed)
    params = SamplingParams(max_new_tokens=steps, temperature=0.0, ignore_eos=True, speculative=False)
    for index in range(batch):
        engine.add_request(f"r{seed}-{index}", [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(prompt_len)], params)
    times, recorded, start_sequence = [], 0, log.sequence
    while engine.has_work():
        decode_only = engine.num_waiting == 0
        begin = time.perf_counter()
        engine.step()
        if forwarder is not None:
            update = forwarder.take()
            if update is not None:
                pickle.dumps(update, protocol=pickle.HIGHEST_PROTOCOL)
        if decode_only:
            times.append(time.perf_counter() - begin)
    recorded = log.sequence - start_sequence
    return {"step_ms": statistics.median(times) * 1000, "steps": len(times), "events": recorded}


def per_event_costs(count: int = 20000, repeats: int = 5) -> tuple[float, float]:
    """(record us, forward + pickle us) per event, medians over repeats: the direct cost behind the step figures."""
    records, forwards = [], []
    events = [PageStored(i.to_bytes(16, "little"), (i - 1).to_bytes(16, "little", signed=True), 16, False)
              for i in range(count)]
    for _ in range(repeats):
        log = KVEventLog(b"r" * 16, 16, capacity=2 * count)
        forwarder = KVEventForwarder(log)
        forwarder.take()  # (the first snapshot)
        begin = time.perf_counter()
        for event in events:
            log.record(event)
        middle = time.perf_counter()
        update = forwarder.take()
        pickle.dumps(update, protocol=pickle.HIGHEST_PROTOCOL)
        end = time.perf_counter()
        records.append((middle - begin) / count * 1e6)
        forwards.append((end - middle) / count * 1e6)
    return statistics.median(records), statistics.median(forwards)


def gateway_scoring(lengths: tuple[int, ...], page_size: int = 16, repeats: int = 20) -> list[tuple[int, float, float]]:
    """(prompt tokens, PromptKeys ms, overlap ms) medians: the index holds the whole prompt."""
    rows = []
    rng = random.Random(0)
    for length in lengths:
        prompt = [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(length)]
        log = KVEventLog(b"r" * 16, page_size)
        parent = b"r" * 16
        for key in page_keys(parent, prompt, page_size):
            log.record(PageStored(key, parent, page_size, False))
            parent = key
        index = KVIndex()
        index.apply("w", snapshot_to_proto(log.snapshot()))
        keys_ms, overlap_ms = [], []
        for _ in range(repeats):
            begin = time.perf_counter()
            keys = PromptKeys(prompt)
            keys.keys(b"r" * 16, page_size)
            middle = time.perf_counter()
            index.overlap("w", keys)
            end = time.perf_counter()
            keys_ms.append((middle - begin) * 1000)
            overlap_ms.append((end - middle) * 1000)
        rows.append((length, statistics.median(keys_ms), statistics.median(overlap_ms)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_arguments(parser, repeats=5)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=96)
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.steps = 2, 32
    print_header("KV events: a decode step with and without recording, and the gateway's scoring", args)
    engine = LLMEngine(EngineConfig(model_dir=str(args.model), attention_backend="torch", num_threads=args.threads,
                                    kv_memory_bytes=256 * 2**20, draft_model_dir=""))
    log = engine.prefix_cache.events
    seeds = iter(range(args.seed, args.seed + 10_000))

    def variant(on: bool):
        return lambda: decode_run(engine, log, on, next(seeds), args.batch, args.prompt_len, args.steps)

    runs = interleave({"events off": variant(False), "events on": variant(True)}, args.repeats)
    ratios = paired(runs["events on"], runs["events off"], "step_ms")
    print(f"## decode step: batch {args.batch}, prompts of {args.prompt_len} tokens, {args.steps} steps each\n")
    print("| variant | step (median ms) | steps timed | events per run |")
    print("|---|---|---|---|")
    for name, samples in runs.items():
        print(f"| {name} | {spread([m['step_ms'] for m in samples])} | {median(samples, 'steps'):.0f} | "
              f"{median(samples, 'events'):.0f} |")
    print(f"\non / off per round: {spread(ratios, 100, '%')}; load average at the end of runs: {load_note(runs)}\n")
    record_us, forward_us = per_event_costs()
    events_per_step = median(runs["events on"], "events") / max(1, median(runs["events on"], "steps"))
    step_us = median(runs["events off"], "step_ms") * 1000
    print(f"per event: record {record_us:.2f} us, forward + pickle {forward_us:.2f} us; at {events_per_step:.2f} events "
          f"per step that is {(record_us + forward_us) * events_per_step / step_us * 100:.4f}% of a decode step\n")
    print("## gateway: a prompt's page keys and its overlap with an index holding it (page size 16)\n")
    print("| prompt tokens | PromptKeys (ms) | overlap (ms) |")
    print("|---|---|---|")
    for length, keys_ms, overlap_ms in gateway_scoring((1024, 4096, 16384)):
        print(f"| {length} | {keys_ms:.3f} | {overlap_ms:.3f} |")
    engine.close()


if __name__ == "__main__":
    main()
