"""A real Prometheus (Debian's package) for tests: started on loopback with a scrape config, and
waited on until its series hold enough samples."""

from __future__ import annotations

import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import yaml


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(
    work: Path, static_configs: list[dict[str, Any]], interval: str = "500ms"
) -> tuple[subprocess.Popen[bytes], str, Path]:
    """Prometheus scraping `static_configs` every `interval`: (its process, its URL, its log)."""
    binary = shutil.which("prometheus")
    assert binary, "prometheus is missing: scripts/test and scripts/test_serving install it"
    config = {
        "global": {"scrape_interval": interval, "evaluation_interval": "1s"},
        "scrape_configs": [{"job_name": "vllm", "static_configs": static_configs}],
    }
    (work / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    log = work / "prometheus.log"
    with log.open("w") as stderr:
        proc = subprocess.Popen(
            [binary, f"--config.file={work / 'prometheus.yml'}",
             f"--storage.tsdb.path={work / 'data'}", f"--web.listen-address=127.0.0.1:{port}",
             "--log.level=warn"],
            stdout=subprocess.DEVNULL, stderr=stderr,
        )  # fmt: skip
    return proc, f"http://127.0.0.1:{port}", log


def wait_for(url: str, proc: subprocess.Popen[bytes], log: Path, query: str, least: float) -> None:
    """Until `query` (an instant query of one number) reaches `least`, at most 30 s."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"prometheus exited: {log.read_text()}"
        try:
            response = httpx.get(f"{url}/api/v1/query", params={"query": query})
        except httpx.TransportError:
            response = None  # not listening yet
        if response is not None and response.status_code == 200:  # 503 while starting
            result = response.json()["data"]["result"]
            if result and float(result[0]["value"][1]) >= least:
                return
        time.sleep(0.5)
    raise AssertionError(f"prometheus: `{query}` below {least} after 30 s: {log.read_text()}")


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    proc.wait(timeout=10)


@contextmanager
def scraping(
    handler: type[BaseHTTPRequestHandler], work: Path, query: str, least: float
) -> Iterator[str]:
    """A loopback server of `handler`'s metrics, scraped by Prometheus every half second; yields
    Prometheus's URL once `query` reaches `least`, and stops both after."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    proc, url, log = start(work, [{"targets": [f"127.0.0.1:{server.server_port}"]}])
    try:
        wait_for(url, proc, log, query, least)
        yield url
    finally:
        stop(proc)
        server.shutdown()
        server.server_close()
