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


def _commit(table, app_ids, first: int, last: int) -> None:
    """A batch's table commit as the writer makes it (no data file: only the transactions matter)."""
    (checked, _), *alongside = app_ids
    table.append([], None, checked, first - 1 if first > 0 else -1, last,
                 also={a: last if v is None else v for a, v in alongside})


def test_offsets_are_keyed_by_topic_id_so_a_recreated_topic_starts_fresh(tmp_path):
    """A recreated topic that grew past the old offsets before ingest looked: keyed by the topic's id,
    nothing is skipped; the name-keyed guess (no committed offset, the partition ends before the
    table's offset) could not have told."""
    from kafka import TopicPartition

    from tide.dataset.partitions import id_keyed_mark, resume
    from tide.dataset.table import DatasetTable

    table = DatasetTable(str(tmp_path / "t"))
    table.ensure()
    tp = TopicPartition("capture", 0)
    never = lambda recorded: False  # noqa: E731 - the name-keyed guess: never asked once ids key offsets
    first = resume(table, "g", tp, "id-1", never)
    mark = id_keyed_mark("g", "capture", 0)
    assert first.skip_through == -1 and first.app_ids == (("g/capture@id-1/0", None), ("g/capture/0", None), (mark, 0))
    _commit(table, first.app_ids, 0, 11)
    assert table.app_version("g/capture/0") == 11  # mirrored for replicas of earlier versions
    assert resume(table, "g", tp, "id-1", never).skip_through == 11  # the same topic: after its offsets
    grown = resume(table, "g", tp, "id-2", never)  # recreated, whatever its end offset
    assert grown.skip_through == -1 and grown.follows is None and grown.app_ids[0] == ("g/capture@id-2/0", None)
    _commit(table, grown.app_ids, 0, 29)
    assert table.app_version("g/capture@id-2/0") == 29 and table.app_version("g/capture@id-1/0") == 11
    assert resume(table, "g", tp, None, never).skip_through == 29  # no id known: the mirror, as before


def test_a_table_from_before_topic_ids_resumes_from_its_name_keyed_offsets(tmp_path):
    from kafka import TopicPartition

    from tide.dataset.partitions import resume
    from tide.dataset.table import DatasetTable

    table = DatasetTable(str(tmp_path / "t"))
    table.ensure()
    tp = TopicPartition("capture", 1)
    _commit(table, (("g/capture/1", None),), 0, 7)  # written by name (a broker without topic ids)
    assert resume(table, "g", tp, None, lambda recorded: False).skip_through == 7
    upgraded = resume(table, "g", tp, "id-1", lambda recorded: False)
    assert upgraded.skip_through == 7 and upgraded.app_ids[0] == ("g/capture@id-1/1", None)
    recreated = resume(table, "g", tp, None, lambda recorded: recorded == 7)  # the old guess says so
    assert recreated.skip_through == -1 and recreated.follows == 7
