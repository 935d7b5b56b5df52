"""The garbage collector's view of a long-running process: freeze what setup built.

A full collection walks every object the collector tracks. After imports, a model built and warmed up (torch,
transformers, compiled graphs) or an evaluation's setup, that is hundreds of thousands of objects, and one full
collection then holds the thread that triggered it for 90-250 ms (session 22, GPU machine: the evaluating
process's loop, every env waiting on it, once or twice a 30 s row). Almost all of them live until the process ends.
gc.freeze moves every object alive into a permanent generation that collections skip; what is allocated later is
collected as before, and reference counting frees frozen objects that die as always (only a cycle among them waits
for an unfreeze). CPython documents the pattern for pre-fork servers; here it is for a server after its warm-up and
for an evaluation's run.
"""

from __future__ import annotations

import contextlib
import gc


def freeze_heap() -> int:
    """Collect, then freeze every object alive (for the rest of the process). Returns how many are frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


@contextlib.contextmanager
def frozen_heap(enabled: bool = True):
    """freeze_heap for the block, unfrozen after (garbage cycles made meanwhile among frozen objects are collected
    again then). Yields how many objects were frozen (0 when not enabled)."""
    if not enabled:
        yield 0
        return
    n = freeze_heap()
    try:
        yield n
    finally:
        gc.unfreeze()
