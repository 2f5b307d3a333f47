"""What ingest holds per partition: the offsets a fetch must yield (every offset of the capture topic
holds a record), and what it does when one skips some."""
from tide.dataset.partitions import PASS, REFETCH, PartitionState


def test_offsets_in_order_are_no_gap_and_the_first_one_sets_the_stream():
    state = PartitionState()
    assert state.gap(40) == ""  # nothing expected yet: a (re)assignment starts anywhere
    for offset in (40, 41, 42):
        assert state.gap(offset) == ""
        state.note(offset, 0.0)
    assert state.expected == 43
    assert state.gap(43) == "" and state.gap(42) == ""  # the next one, or one fetched again


def test_a_gap_is_fetched_again_once_then_passed():
    state = PartitionState()
    state.note(133, 0.0)
    assert state.gap(135) == REFETCH  # 134 never came: fetch from 134 again
    assert state.expected == 134
    assert state.gap(134) == ""  # it came the second time
    state.note(134, 0.0)
    assert state.gap(136) == REFETCH  # a new gap is fetched again too
    assert state.gap(136) == PASS  # ... but only once: the topic has nothing at 135
    state.note(136, 0.0)
    assert state.gap(137) == ""
