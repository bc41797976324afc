"""`vllm bench serve`, run many times by one interpreter; runs in the peer venv (never imports servelab).

    <peer venv>/bin/python benchmarks/vllm_bench_worker.py

Each stdin line is a JSON list: the arguments that would follow `vllm bench serve` on a command
line. The worker runs vLLM's own CLI entry point (`vllm.entrypoints.cli.main.main`) on exactly
that command line, so the parser, its checks and the benchmark are vLLM's; what it saves is the
interpreter's start (importing vLLM costs 10-15 s of a 2-core machine per run, more than one
32-request round takes). It answers each line with one JSON line on stdout:
    {"ok": true, "seconds": wall seconds of the run}   or   {"ok": false, "error": "..."}
vLLM's own prints go to stderr, so stdout carries only the protocol. An empty line or EOF ends it.
"""

from __future__ import annotations

import json
import sys
import time
import traceback


def main() -> None:
    proto = sys.stdout
    sys.stdout = sys.stderr  # vLLM's own prints must not mix with the protocol
    from vllm.entrypoints.cli.main import main as vllm_main

    def say(obj: dict) -> None:
        proto.write(json.dumps(obj) + "\n")
        proto.flush()

    say({"ready": True})
    for line in sys.stdin:
        if not line.strip():
            break
        argv = json.loads(line)
        sys.argv = ["vllm", "bench", "serve", *argv]
        t0 = time.perf_counter()
        try:
            vllm_main()
        except SystemExit as exc:  # argparse's way of refusing arguments
            if exc.code not in (0, None):
                say({"ok": False, "error": f"vllm bench serve exited with {exc.code}"})
                continue
        except Exception:  # noqa: BLE001 - the caller gets vLLM's traceback as the error
            say({"ok": False, "error": traceback.format_exc()[-3000:]})
            continue
        say({"ok": True, "seconds": time.perf_counter() - t0})


if __name__ == "__main__":
    main()
