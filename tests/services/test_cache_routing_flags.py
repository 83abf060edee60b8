"""The cache routing flags: `pdserve gateway --cache-routing-weight / --cache-routing-max-load` reach GatewayConfig,
`pdserve up` hands them to its gateway, and bad values are refused by name (GatewayConfig, and `pdserve up` before
any process starts)."""
from __future__ import annotations

import argparse

import pytest

from gateway.config import DEFAULT_CACHE_ROUTING_WEIGHT, GatewayConfig
from pdserve.commands import gateway
from tests.services.helpers import up_args, up_specs


def test_gateway_command_parses_the_flags():
    """Defaults: weight DEFAULT_CACHE_ROUTING_WEIGHT (1.0), max load 0.9; given values are kept."""
    parser = argparse.ArgumentParser()
    gateway.add_arguments(parser)
    base = ["--prefill", "127.0.0.1:1", "--decode", "127.0.0.1:2"]
    args = parser.parse_args(base)
    assert (args.cache_routing_weight, args.cache_routing_max_load) == (DEFAULT_CACHE_ROUTING_WEIGHT, 0.9)
    args = parser.parse_args(base + ["--cache-routing-weight", "0", "--cache-routing-max-load", "0.5"])
    assert (args.cache_routing_weight, args.cache_routing_max_load) == (0.0, 0.5)


def test_gateway_config_refuses_bad_values():
    """A negative weight or a max load outside (0, 1] is a ValueError naming it."""
    common = dict(model_dir="m", prefill=("127.0.0.1:1",), decode=("127.0.0.1:2",))
    assert GatewayConfig(**common, cache_routing_weight=0.0).cache_weights.weight == 0.0
    with pytest.raises(ValueError, match="weight"):
        GatewayConfig(**common, cache_routing_weight=-0.5)
    with pytest.raises(ValueError, match="max load"):
        GatewayConfig(**common, cache_routing_max_load=1.5)


def test_pdserve_up_hands_the_flags_to_its_gateway(monkeypatch):
    """`pdserve up --cache-routing-weight 0` puts the weight in the gateway's arguments (the default otherwise)."""
    specs = up_specs(monkeypatch, [[], ["--cache-routing-weight", "0", "--cache-routing-max-load", "0.75"]])
    assert specs[0].gateway_args == ("--cache-routing-weight", str(DEFAULT_CACHE_ROUTING_WEIGHT),
                                     "--cache-routing-max-load", "0.9")
    assert specs[1].gateway_args == ("--cache-routing-weight", "0.0", "--cache-routing-max-load", "0.75")


def test_pdserve_up_refuses_a_negative_weight(capsys, monkeypatch):
    """Refused before anything starts, with the reason on stderr."""
    from pdserve.commands import up

    monkeypatch.setattr(up, "configure_logging", lambda *args: None)  # leave pytest's logging alone
    args = up_args(cache_routing_weight=-1.0, log_level="WARNING")
    assert up.run(args) != 0
    assert "weight" in capsys.readouterr().err
