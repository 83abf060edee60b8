"""Both worker configs embed one EngineConfig: build() passes engine flags through, sets the role's pool kind,
reads engine settings through, and refuses bad role settings by name."""
from __future__ import annotations

import pytest

from decode_worker.config import DecodeWorkerConfig
from prefill_worker.config import PrefillWorkerConfig


def test_build_embeds_the_engine_config_with_the_roles_pool():
    """Engine flags land in config.engine (readable as config.<field>); prefill computes into private pages,
    decode into a shared pool; both share weights per node by default."""
    prefill = PrefillWorkerConfig.build(batch_tokens=64, tp_size=2, page_size=32)
    decode = DecodeWorkerConfig.build(lease_ttl_s=5.0, max_running=7, share_weights=False)
    assert (prefill.engine.tp_size, prefill.tp_size, prefill.page_size, prefill.batch_tokens) == (2, 2, 32, 64)
    assert (prefill.engine.kv_pool, decode.engine.kv_pool) == ("local", "shm")
    assert prefill.engine.kv_memory_bytes == 256 * 2**20 and prefill.engine.share_weights
    assert (decode.max_running, decode.lease_ttl_s, decode.share_weights) == (7, 5.0, False)
    assert decode.engine_config() is decode.engine
    assert (prefill.engine.prefill_tokens_while_decoding, decode.prefill_tokens_while_decoding) == (0, 128)
    assert DecodeWorkerConfig.build(prefill_tokens_while_decoding=0).engine.prefill_tokens_while_decoding == 0
    with pytest.raises(AttributeError):
        decode.no_such_setting  # noqa: B018 - neither the role's nor the engine's


@pytest.mark.parametrize("build, field", [
    (lambda: PrefillWorkerConfig.build(batch_tokens=0), "batch_tokens"),
    (lambda: PrefillWorkerConfig.build(batch_target_ms=-1), "batch_target_ms"),
    (lambda: DecodeWorkerConfig.build(admit_timeout_s=0), "admit_timeout_s"),
    (lambda: DecodeWorkerConfig.build(prefill_tokens_while_decoding=-1), "prefill_tokens_while_decoding"),
    (lambda: DecodeWorkerConfig.build(listen="nowhere"), "listen"),
    (lambda: PrefillWorkerConfig.build(tp_size=0), "tp_size"),
])
def test_bad_settings_name_their_field(build, field):
    """A bad role or engine setting is a ValueError naming the field."""
    with pytest.raises(ValueError, match=field):
        build()
