"""`target=pd`: prefill/decode disaggregation on this machine, started and stopped by the harness.

A local `mooncake_master`, `num_prefill` servers with `kv_transfer.kv_role=kv_producer`,
`num_decode` servers with `kv_role=kv_consumer` (all `engine.entrypoints.serve` with the run's
engine config and Mooncake's store as their connector) and `servelab-router` in front; the
driver talks to the router like to any OpenAI server. `target.kv_connector=transfer` joins them
with Mooncake's TransferEngine instead (the decode instances read the prefill instances'
outboxes directly; engine/kv_transfer/mooncake_transfer.py). At the end each instance's connector
counters (from its /metrics) go to `<run>/pd_instances.json`, one entry per instance with its
role, so the report can set the prefill and decode instances side by side.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from prometheus_client.parser import text_string_to_metric_families

from engine.config import EngineConfig, KVTransferConfig
from engine.kv_transfer.mooncake_master import MooncakeMaster
from workloads.targets.engine import free_port
from workloads.targets.openai import OpenAITarget

# target.kv_connector: Mooncake's store between the instances, or its TransferEngine reading the
# prefill instance's outbox directly (engine/kv_transfer/mooncake_transfer.py).
CONNECTORS = {"store": "MooncakeStoreConnector", "transfer": "MooncakeTransferConnector"}

_COUNTERS = ("loaded_blocks", "saved_blocks", "loaded_bytes", "saved_bytes", "load_seconds", "save_seconds",
             "external_hit_tokens", "load_failures")  # fmt: skip


class PDTarget(OpenAITarget):
    name = "pd"

    def __init__(
        self, engine_config: EngineConfig, run_dir: str | os.PathLike[str], num_prefill: int = 1, num_decode: int = 1,
        policy: str = "round_robin", startup_timeout_s: float = 180.0, endpoint: str = "completions",
        timeout_s: float | None = None, connector: str = "store",
    ) -> None:  # fmt: skip
        if num_prefill < 1 or num_decode < 1:
            raise ValueError("target.num_prefill and target.num_decode must be >= 1")
        if connector not in CONNECTORS:
            raise ValueError(f"target.kv_connector: {connector!r} is not one of {', '.join(CONNECTORS)}")
        self.connector = connector
        # transfer: each prefill instance's directory (the decode instances ask all of them)
        self.directories = [f"tcp://127.0.0.1:{free_port()}" for _ in range(num_prefill)]
        self.router_port = free_port()
        super().__init__(f"http://127.0.0.1:{self.router_port}", model="", endpoint=endpoint,
                         extra_body={"temperature": 0.0}, timeout_s=timeout_s)  # fmt: skip
        self.engine_config = engine_config
        self.run_dir = Path(run_dir)
        self.num_prefill, self.num_decode, self.policy = num_prefill, num_decode, policy
        self.startup_timeout_s = startup_timeout_s
        self.master: MooncakeMaster | None = None
        self.instances: list[tuple[str, str, subprocess.Popen[bytes]]] = []  # (role, url, process)
        self.router: subprocess.Popen[bytes] | None = None

    async def start(self) -> None:
        if self.router is None:
            try:
                await self._launch()
            except BaseException:
                self.shutdown()
                raise
        await super().start()

    async def _launch(self) -> None:
        self.master = MooncakeMaster(log_path=self.run_dir / "mooncake_master.log").start()
        roles = ["prefill"] * self.num_prefill + ["decode"] * self.num_decode
        for i, role in enumerate(roles):
            port = free_port()
            config = self._instance_config(role, i)
            cmd = [sys.executable, "-m", "engine.entrypoints.serve", "--config", str(config), "--port", str(port)]
            self.instances.append((role, f"http://127.0.0.1:{port}", self._popen(cmd, f"{role}{i}.log")))
        await asyncio.gather(*(self._wait(url + "/health", proc, name) for name, url, proc in self.instances))
        cmd = [sys.executable, "-m", "engine.entrypoints.router", "--port", str(self.router_port),
               "--policy", self.policy]  # fmt: skip
        for role, url, _ in self.instances:
            cmd += [f"--{role}", url]
        self.router = self._popen(cmd, "router.log")
        await self._wait(self.base_url + "/health", self.router, "router")

    def _instance_config(self, role: str, index: int) -> Path:
        assert self.master is not None
        extra = dict(self.engine_config.kv_transfer.kv_connector_extra_config)
        if self.connector == "store":
            extra.update(self.master.extra_config())
        else:
            extra["metadata_server"] = self.master.metadata_server
            if role == "prefill":
                extra["directory_address"] = self.directories[index]
            else:
                extra["producer_directories"] = list(self.directories)
        kv = KVTransferConfig(CONNECTORS[self.connector], "kv_producer" if role == "prefill" else "kv_consumer", extra)
        config = replace(self.engine_config, kv_transfer=kv)
        path = self.run_dir / f"serve_config_{role}{index}.yaml"
        path.write_text(f"# written by servelab-run for target=pd ({role} instance {index})\n"
                        + yaml.safe_dump(asdict(config), sort_keys=False))  # fmt: skip
        return path

    def _popen(self, cmd: list[str], log_name: str) -> subprocess.Popen[bytes]:
        log = open(self.run_dir / log_name, "wb")  # noqa: SIM115 - the child keeps it
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ))

    async def _wait(self, url: str, proc: subprocess.Popen[bytes], name: str) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        async with aiohttp.ClientSession() as session:
            while time.monotonic() < deadline:
                if proc.poll() is not None:
                    raise RuntimeError(f"target=pd: {name} exited with code {proc.returncode} during start-up "
                                       f"(log in {self.run_dir})")  # fmt: skip
                with contextlib.suppress(aiohttp.ClientError, OSError):
                    async with session.get(url) as resp:
                        if resp.status == 200:
                            return
                await asyncio.sleep(0.5)
        raise RuntimeError(f"target=pd: {name} not ready after {self.startup_timeout_s:.0f} s")

    def instance_counters(self) -> list[dict[str, Any]]:
        """Each instance's connector counters, read from its /metrics now."""
        out = []
        for i, (role, url, proc) in enumerate(self.instances):
            row: dict[str, Any] = {"instance": f"{role}{i}", "role": role, "url": url}
            if proc.poll() is None:
                with contextlib.suppress(OSError, ValueError), urllib.request.urlopen(url + "/metrics", timeout=5) as r:
                    row.update(parse_connector_counters(r.read().decode()))
            out.append(row)
        return out

    def shutdown(self) -> None:
        if self.instances:
            with contextlib.suppress(OSError):
                (self.run_dir / "pd_instances.json").write_text(json.dumps(self.instance_counters(), indent=2))
        procs = ([self.router] if self.router is not None else []) + [p for _, _, p in self.instances]
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.router, self.instances = None, []
        if self.master is not None:
            self.master.stop()
            self.master = None


def parse_connector_counters(text: str) -> dict[str, float]:
    """`servelab:kv_connector_<name>_total` samples of a /metrics page, summed over labels
    (parsed by prometheus_client: a sample's optional timestamp is not its value)."""
    out = dict.fromkeys(_COUNTERS, 0.0)
    prefix = "servelab:kv_connector_"
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not (sample.name.startswith(prefix) and sample.name.endswith("_total")):
                continue  # `_created` and other series of the family
            name = sample.name[len(prefix) : -len("_total")]
            if name in out:
                out[name] += float(sample.value)
    return out
