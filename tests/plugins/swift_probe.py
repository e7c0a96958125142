"""What the ms-swift-style test plugins (tests/plugins/swift_*.py) record: one JSON line per event in the file
named by $SWIFT_COMPAT_PROBE (tests/test_swift_compat.py reads it). Not part of any plugin's API."""

import json
import os
import threading

PROBE_ENV = "SWIFT_COMPAT_PROBE"


def record(probe: str, **fields) -> None:
    path = os.environ.get(PROBE_ENV)
    if path:
        line = json.dumps({"probe": probe, "thread": threading.current_thread().name, **fields}) + "\n"
        with open(path, "a") as f:
            f.write(line)
