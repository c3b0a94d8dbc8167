"""The garbage collector's settings for a long-running process once it has started (a server, an engine core)."""
from __future__ import annotations

import gc

# The youngest generation's collection threshold (Python's default: 700 allocations). A served token allocates a
# handful of short-lived objects (protobuf wrappers, lists), and an engine step at 256 sequences a few per sequence,
# so at 700 the collector ran hundreds of times a second: 3-5% of the gateway's CPU under load (perf), and in the
# engine core a 256-stream decode step took 2.58 ms against 2.24-2.35 ms at 20,000 (bench_host, family 25 model 17).
# At 20,000 most of those objects are gone before it runs, and a collection walks a few milliseconds' worth of them.
GC_YOUNG_THRESHOLD = 20_000


def settle() -> None:
    """Collect once, freeze what is left, and collect young objects less often.

    Everything alive when a process has started (imports, a loaded model's modules) lives as long as the process.
    A full collection walks every tracked object holding the GIL: about 225,000 once the 0.6B model has loaded,
    110 ms, a stall in whichever step or call it falls. Frozen, the collector never looks at them again."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_YOUNG_THRESHOLD, *gc.get_threshold()[1:])
