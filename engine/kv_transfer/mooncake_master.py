"""Start and stop a local `mooncake_master` (with its HTTP metadata server) for tests, the
workbench and single-machine disaggregation. Its metadata and metrics ports listen on 0.0.0.0
whatever the host flag says: use it on trusted machines only.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType
from typing import IO


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def find_master_binary() -> str | None:
    """`mooncake_master` next to this Python (a venv's bin/) or on PATH."""
    here = Path(sys.executable).parent / "mooncake_master"
    return str(here) if here.exists() else shutil.which("mooncake_master")


class MooncakeMaster:
    """A `mooncake_master` on 127.0.0.1 with free ports; a context manager.

    `extra_config()` gives the connector's `kv_connector_extra_config` for it.
    """

    def __init__(self, log_path: str | os.PathLike[str] | None = None, startup_timeout_s: float = 30.0) -> None:
        binary = find_master_binary()
        if binary is None:
            raise RuntimeError("mooncake_master not found: pip install 'servelab[kv]' (mooncake-transfer-engine-non-cuda)")
        self.binary = binary
        self.rpc_port, self.http_port, self.metrics_port = _free_port(), _free_port(), _free_port()
        self.log_path = log_path
        self.startup_timeout_s = startup_timeout_s
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    def master_server_address(self) -> str:
        return f"127.0.0.1:{self.rpc_port}"

    @property
    def metadata_server(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/metadata"

    def extra_config(self, **more: object) -> dict[str, object]:
        return {"master_server_address": self.master_server_address, "metadata_server": self.metadata_server,
                "protocol": "tcp", **more}  # fmt: skip

    def start(self) -> MooncakeMaster:
        self._log = open(self.log_path, "wb") if self.log_path else None  # noqa: SIM115
        out = self._log if self._log is not None else subprocess.DEVNULL
        self.proc = subprocess.Popen(
            [self.binary, "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
             f"--http_metadata_server_port={self.http_port}", "--rpc_address=127.0.0.1",
             f"--rpc_port={self.rpc_port}", f"--metrics_port={self.metrics_port}"],
            stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
        deadline = time.monotonic() + self.startup_timeout_s
        for port in (self.rpc_port, self.http_port):
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"mooncake_master exited with {self.proc.returncode} at start-up")
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        self.stop()
                        raise RuntimeError(f"mooncake_master did not listen on {port} within "
                                           f"{self.startup_timeout_s:.0f} s") from None  # fmt: skip
                    time.sleep(0.05)
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> MooncakeMaster:
        return self.start()

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()
