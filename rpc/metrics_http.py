"""Serving a Prometheus registry on GET /metrics from a worker process (docs/metrics.md).

Workers use prometheus_client's own small HTTP server, on a daemon thread: a scrape every few seconds
costs the event loop nothing, and the metrics it reads (engine counters, load snapshots) are plain
numbers. The gateway serves its registry on its HTTP front instead (gateway/http_server.py)."""
from __future__ import annotations

import logging
from collections.abc import Callable

from prometheus_client import CollectorRegistry, start_http_server

logger = logging.getLogger(__name__)


def serve_metrics(listen: str, registry: CollectorRegistry) -> tuple[dict[str, str], Callable[[], None]]:
    """Serves registry at http://listen/metrics (port 0 picks one; "" serves nothing). Returns
    ({"metrics": bound host:port} for the ready file, or {}) and a stop function."""
    if not listen:
        return {}, lambda: None
    host, port = listen.rsplit(":", 1)
    host = host.strip("[]") or "0.0.0.0"
    server, thread = start_http_server(int(port), addr=host, registry=registry)
    advertised = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    address = f"{advertised}:{server.server_port}"
    logger.info("Prometheus metrics on http://%s/metrics", address)

    def stop() -> None:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)

    return {"metrics": address}, stop
