"""core/heap.py: the collector's view of a long-running process (freeze what setup built)."""

import gc

from wamkit.core.heap import frozen_heap


def test_frozen_heap_leaves_full_collections_only_what_the_block_allocates():
    """Inside frozen_heap, what was alive before is in no generation a collection walks (gc.get_objects lists
    them per generation), what the block allocates is, a cycle made inside is still collected, and after the
    block nothing stays frozen; disabled, it freezes nothing."""
    before = [[i] for i in range(20_000)]
    with frozen_heap() as n:
        assert n >= len(before) and gc.get_freeze_count() >= len(before)
        after = [[i] for i in range(10)]
        gc.collect()
        walked = {id(o) for g in range(3) for o in gc.get_objects(generation=g)}
        assert id(after[0]) in walked and id(before[0]) not in walked and id(before[-1]) not in walked
        cycle: list = []
        cycle.append(cycle)
        del cycle
        assert gc.collect() >= 1
    assert gc.get_freeze_count() == 0
    assert id(before[0]) in {id(o) for o in gc.get_objects(generation=2)}
    with frozen_heap(False) as n:
        assert n == 0 and gc.get_freeze_count() == 0
