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


def test_a_partition_after_the_table_expects_the_next_offset_and_a_passed_gap_opens_the_batch():
    """The table's offsets stay contiguous (DatasetTable.append): a state resumed after the table's
    recorded offset expects the one after it, and a gap passed at a batch's start opens the batch
    at the gap, so its commit follows the recorded offset."""
    assert PartitionState.after(None).expected == -1
    state = PartitionState.after(99)
    assert (state.skip_through, state.expected) == (99, 100)
    assert state.gap(104) == REFETCH and state.gap(104) == PASS  # 100..103: not in the topic
    state.cover_gap(1.0)
    state.note(104, 1.0)
    assert (state.first_offset, state.last_offset, state.expected) == (100, 104, 105)
    state.cover_gap(2.0)  # a batch already open keeps its start
    assert state.first_offset == 100
