"""The switch: EngineConfig.prefix_cache (on by default), LLM(..., prefix_cache=False), `pdserve prefill` /
`pdserve decode --no-prefix-cache` set it in the worker's EngineConfig, and `pdserve up --no-prefix-cache` hands
the flag to every worker."""
from __future__ import annotations

import argparse

import pytest

from decode_worker.config import DecodeWorkerConfig
from engine import LLM
from engine.paths import DSV3_MODEL_DIR
from pdserve.commands import decode, prefill
from pdserve.commands.common import engine_kwargs
from prefill_worker.config import PrefillWorkerConfig
from tests.services.helpers import up_specs


def test_llm_switch_turns_the_cache_off():
    """LLM(..., prefix_cache=False) builds an engine without a cache: a repeated prompt maps nothing."""
    with LLM(str(DSV3_MODEL_DIR), prefix_cache=False, draft_model="", kv_memory_bytes=16 * 2**20) as llm:
        assert llm.engine.prefix_cache is None
    with LLM(str(DSV3_MODEL_DIR), draft_model="", kv_memory_bytes=16 * 2**20) as llm:
        assert llm.engine.prefix_cache is not None


@pytest.mark.parametrize("command, config", [(prefill, PrefillWorkerConfig), (decode, DecodeWorkerConfig)])
@pytest.mark.parametrize("argv, expected", [([], True), (["--no-prefix-cache"], False)])
def test_worker_commands_set_the_engine_config(command, config, argv, expected):
    """The worker commands' flags reach EngineConfig.prefix_cache through engine_kwargs and the role's build."""
    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    kwargs = engine_kwargs(parser.parse_args(argv))
    assert kwargs["prefix_cache"] is expected
    kwargs.pop("internal_token")
    assert config.build(**kwargs).engine.prefix_cache is expected


def test_pdserve_up_hands_the_flag_to_every_worker(monkeypatch):
    """`pdserve up --no-prefix-cache` puts the flag in the arguments every worker gets; without it, none."""
    specs = up_specs(monkeypatch, [[], ["--no-prefix-cache"]])
    assert "--no-prefix-cache" not in specs[0].worker_args and "--no-prefix-cache" in specs[1].worker_args
