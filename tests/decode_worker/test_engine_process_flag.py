"""The one switch: DecodeWorkerConfig.engine_process (on by default), `pdserve decode --[no-]engine-process`
sets it, and `pdserve up --[no-]engine-process` hands the flag to every decode worker."""
from __future__ import annotations

import argparse

import pytest

from decode_worker.config import DecodeWorkerConfig
from tests.services.helpers import up_specs
from pdserve.commands import decode


def test_the_config_switch_is_on_by_default():
    """Without the flag the engine runs in a process of its own; engine_process=False puts it on a thread."""
    assert DecodeWorkerConfig.build().engine_process is True
    assert DecodeWorkerConfig.build(engine_process=False).engine_process is False


@pytest.mark.parametrize("argv, expected", [([], True), (["--engine-process"], True), (["--no-engine-process"], False)])
def test_pdserve_decode_passes_the_flag_to_the_config(monkeypatch, argv, expected):
    """`pdserve decode` hands --engine-process / --no-engine-process to DecodeWorkerConfig.build."""
    parser = argparse.ArgumentParser()
    decode.add_arguments(parser)
    parser.add_argument("--log-level", default="WARNING")  # the top-level parser's
    seen = {}
    monkeypatch.setattr(decode, "configure_logging", lambda *args: None)  # leave pytest's logging alone
    monkeypatch.setattr(decode, "run_worker", lambda role, args, build, serve, **role_kwargs: seen.update(role_kwargs) or 0)
    assert decode.run(parser.parse_args(argv)) == 0
    assert seen["engine_process"] is expected


def test_pdserve_up_hands_the_flag_to_the_decode_workers(monkeypatch):
    """`pdserve up` puts --engine-process (--no-engine-process with that flag) in the decode workers' arguments,
    and only theirs."""
    specs = up_specs(monkeypatch, [[], ["--no-engine-process"]])
    assert "--engine-process" in specs[0].decode_args and "--no-engine-process" not in specs[0].decode_args
    assert "--no-engine-process" in specs[1].decode_args and "--engine-process" not in specs[1].decode_args
    assert not {"--engine-process", "--no-engine-process"} & set(specs[0].worker_args)
