"""Starts `calla serve` (the bundled demo checkpoint) on a free loopback port for the client tests.

The binary is $CALLA_BIN, else target/release/calla, else target/debug/calla.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def calla_bin() -> str:
    if os.environ.get("CALLA_BIN"):
        return os.environ["CALLA_BIN"]
    for profile in ("release", "debug"):
        path = REPO / "target" / profile / "calla"
        if path.exists():
            return str(path)
    raise RuntimeError("no calla binary: build it (cargo build --release -p calla-cli) or set CALLA_BIN")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, tmp: Path, *extra: str) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log = open(tmp / f"serve-{self.port}.log", "w+b")
        env = dict(os.environ, XDG_CACHE_HOME=str(tmp / "cache"), RUST_LOG="info")
        self.process = subprocess.Popen(
            [calla_bin(), "serve", "--port", str(self.port), *extra],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        deadline = time.monotonic() + 60
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"calla serve exited with {self.process.returncode}:\n{self.logs()}")
            try:
                with urllib.request.urlopen(f"{self.base_url}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"calla serve did not become healthy:\n{self.logs()}")
            time.sleep(0.1)

    def logs(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read().decode("utf-8", "replace")

    def metrics(self) -> dict[str, float]:
        """Scalar series by name (histogram buckets left out)."""
        with urllib.request.urlopen(f"{self.base_url}/metrics", timeout=5) as r:
            text = r.read().decode()
        values = {}
        for line in text.splitlines():
            if line.startswith("#") or not line.strip() or "le=" in line:
                continue
            series, value = line.rsplit(" ", 1)
            values[series.split("{", 1)[0]] = float(value)
        return values

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("calla"))
    yield s
    s.stop()


@pytest.fixture(scope="session")
def keyed_server(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("calla-key"), "--api-key", "sk-calla-test")
    yield s
    s.stop()
