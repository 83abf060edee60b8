"""Worker metrics endpoints and ready files: serve_metrics serves a registry on port 0 and says where; the
ready file carries the served address and the other endpoints; "" serves nothing."""
from __future__ import annotations

import urllib.request

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.parser import text_string_to_metric_families

from rpc.metrics_http import serve_metrics
from rpc.server import read_ready_file, write_ready_file


def test_serve_metrics_on_port_zero():
    """GET /metrics at the returned address answers the registry's samples; stop() closes it."""
    registry = CollectorRegistry()
    Counter("pdserve_test_things", "things", registry=registry).inc(3)
    endpoints, stop = serve_metrics("127.0.0.1:0", registry)
    try:
        with urllib.request.urlopen(f"http://{endpoints['metrics']}/metrics", timeout=10) as response:
            text = response.read().decode()
    finally:
        stop()
    samples = {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}
    assert samples["pdserve_test_things_total"] == 3


def test_no_listen_address_serves_nothing():
    endpoints, stop = serve_metrics("", CollectorRegistry())
    stop()
    assert endpoints == {}


def test_ready_file_round_trip(tmp_path):
    """The first line is the gRPC address; name=address lines follow; empty endpoints are left out."""
    path = str(tmp_path / "ready")
    write_ready_file(path, "127.0.0.1:5", http="127.0.0.1:6", metrics="")
    assert read_ready_file(path) == ("127.0.0.1:5", {"http": "127.0.0.1:6"})
