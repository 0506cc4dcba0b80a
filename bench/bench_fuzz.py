"""The device server under 1,000,000 fuzzed requests (issue 25): counts by status, crashes,
INTERNAL answers (every one a bug: bad input gets INVALID_ARGUMENT or the precise code).

    tests/fuzz_server.py (a device server of its own, --allow-test-options)
        | mutated requests of every RPC, a healthy session checked between them
        v
    statuses, methods, INTERNAL messages, crashes, requests/s

    .venv/bin/python bench/run.py --only fuzz [--quick]     # --quick: 100,000 requests

A full run takes about 29 minutes on 2 shared cores (about 580 requests/s: bench/results/
fuzz.json, the record of issue 25). ``make bench`` (bench/run.py without ``--only``) runs the
quick count (``run.SEQUENCE_QUICK``; saved as fuzz-quick.json, the record left as it is): the
client is one seeded stream of mutants against a server process of its own, so the two
already take both cores of the machine, and a second client would neither finish sooner on
2 cores nor send the same requests as the record's seed.
"""

from __future__ import annotations

import os
import sys
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

REQUESTS = 1_000_000
QUICK_REQUESTS = 100_000
SEED = 20261203


def main(quick: bool = False) -> list[dict[str, Any]]:
    import fuzz_server

    requests = QUICK_REQUESTS if quick else REQUESTS
    report = fuzz_server.main(["--requests", str(requests), "--seconds", str(requests / 200),
                               "--seed", str(SEED)])
    return [{"requests": report.requests, "seconds": round(report.seconds, 1), "seed": SEED,
             "crashes": report.crashes, "internal": sum(report.internal.values()),
             "internal_messages": dict(report.internal), "statuses": dict(report.statuses),
             "methods": dict(report.by_method), "slow": dict(report.slow),
             "server_peak_rss_bytes": report.server_peak_rss, "failure": report.failure}]
