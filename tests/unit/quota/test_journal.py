"""ReconcileJournal on a real file: what is put survives a reopen until done, compaction keeps
exactly the outstanding settlements, a torn last line is skipped, one process holds it."""

from pathlib import Path

import pytest

from quota.journal import ReconcileJournal, Settlement, journal_path, orphaned_journals


def settlement(rid: str, delta: int = 10, *, final: bool = True) -> Settlement:
    return Settlement("acme", rid, True, 29_000_000, 20_000, delta, "owner-a", final)


def test_put_survives_a_reopen_until_done(tmp_path: Path) -> None:
    path = journal_path(tmp_path, "a")
    journal = ReconcileJournal(path)
    journal.put(settlement("r1"))
    journal.put(settlement("r2"))
    journal.put(settlement("r1", 99))  # replaces r1's earlier settlement
    journal.done("r2")
    journal.done("unknown")  # nothing to forget: no-op
    journal.close()

    again = ReconcileJournal(path)
    assert again.outstanding() == [settlement("r1", 99)]
    again.close()


def test_unchecked_settlement_round_trips_with_its_fields(tmp_path: Path) -> None:
    path = journal_path(tmp_path, "a")
    journal = ReconcileJournal(path)
    s = Settlement("t.1", "gw-x", False, 1, 2, 300, None, final=False)
    journal.put(s)
    journal.close()
    again = ReconcileJournal(path)
    assert again.outstanding() == [s]
    again.close()


def test_compaction_keeps_only_outstanding_settlements(tmp_path: Path) -> None:
    path = journal_path(tmp_path, "a")
    journal = ReconcileJournal(path, compact_lines=20)
    for i in range(100):
        journal.put(settlement(f"r{i}"))
        if i % 10:
            journal.done(f"r{i}")  # every tenth stays outstanding
    kept = [settlement(f"r{i}") for i in range(0, 100, 10)]
    assert journal.outstanding() == kept
    assert len(path.read_bytes().splitlines()) < 40  # not the 190 lines appended
    journal.close()
    again = ReconcileJournal(path)
    assert again.outstanding() == kept
    again.close()


def test_a_torn_last_line_is_skipped_and_cut_off(tmp_path: Path) -> None:
    path = journal_path(tmp_path, "a")
    journal = ReconcileJournal(path)
    journal.put(settlement("r1"))
    journal.put(settlement("r2"))
    journal.close()
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 15])  # the crash cut the second line short

    again = ReconcileJournal(path)
    assert again.outstanding() == [settlement("r1")]
    again.put(settlement("r3"))  # lands on a clean line, not glued to the torn one
    again.close()
    third = ReconcileJournal(path)
    assert third.outstanding() == [settlement("r1"), settlement("r3")]
    third.close()


def test_a_live_journal_cannot_be_adopted_until_its_owner_closes_it(tmp_path: Path) -> None:
    own = ReconcileJournal(journal_path(tmp_path, "mine"))
    other_path = journal_path(tmp_path, "other")
    other = ReconcileJournal(other_path)
    other.put(settlement("r1"))
    assert orphaned_journals(tmp_path, own.path) == [other_path]
    assert ReconcileJournal.adopt(other_path) is None
    with pytest.raises(BlockingIOError):
        ReconcileJournal(other_path)

    other.close()  # as a crash would: the lock goes with the process
    adopted = ReconcileJournal.adopt(other_path)
    assert adopted is not None and adopted.outstanding() == [settlement("r1")]
    adopted.done("r1")
    adopted.close(remove_if_empty=True)
    assert orphaned_journals(tmp_path, own.path) == []
    own.close()


def test_a_closed_journal_refuses_writes(tmp_path: Path) -> None:
    journal = ReconcileJournal(journal_path(tmp_path, "a"), fsync_every=1)
    journal.put(settlement("r1"))
    journal.close()
    with pytest.raises(ValueError):
        journal.put(settlement("r2"))
