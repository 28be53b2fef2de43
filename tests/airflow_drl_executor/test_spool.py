"""The spool of placement rows the metadata DB refused (airflow_drl_executor.spool)."""

from __future__ import annotations

import datetime as dt
import os
from pathlib import Path

from airflow_drl_executor.spool import Spool


def _row(celery_id: str) -> dict[str, object]:
    return {"celery_id": celery_id, "task_id": "t", "features": "{}", "score": -1.5,
            "decided_at": dt.datetime(2026, 12, 6, 9, 30, 1, 250000, tzinfo=dt.UTC)}


def _die(spool: Spool) -> None:
    """What the kernel does for a killed process: its lock goes, its files stay."""
    assert spool._lock_fd is not None
    os.close(spool._lock_fd)
    spool._lock_fd = None


def test_a_live_executors_rows_are_its_own_and_a_dead_ones_are_taken_over_once(tmp_path: Path) -> None:
    a, b, c = Spool(tmp_path), Spool(tmp_path), Spool(tmp_path)
    a.save([_row("x"), _row("y")])
    assert b.adopt_orphans() == [], "a's process is alive: its rows are its own"
    _die(a)
    got = b.adopt_orphans()
    assert got == [_row("x"), _row("y")], "the same rows, dates included"
    assert c.adopt_orphans() == [], "taken by b: c does not write them a second time"
    b.save(got)
    b.release()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [f"{b.name}.jsonl", f"{b.name}.lock", f"{c.name}.lock"]), "a's files gone once b saved its rows"
    assert c.adopt_orphans() == []


def test_rows_written_leave_no_file_and_a_clean_stop_keeps_what_is_left(tmp_path: Path) -> None:
    a = Spool(tmp_path)
    a.save([_row("x")])
    a.save([])  # the DB took them
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{a.name}.lock"]
    a.close()
    assert list(tmp_path.iterdir()) == [], "nothing left: no trace of a at all"
    b = Spool(tmp_path)
    b.save([_row("z")])
    b.close()  # the DB still down at the stop
    c = Spool(tmp_path)
    assert c.adopt_orphans() == [_row("z")]


def test_an_unreadable_file_is_left_in_place_and_the_others_are_taken(tmp_path: Path) -> None:
    a, b = Spool(tmp_path), Spool(tmp_path)
    a.data.write_text('{"celery_id": "x"}\nnot json\n')
    a._saved = True
    b.save([_row("y")])
    _die(a)
    _die(b)
    c = Spool(tmp_path)
    assert c.adopt_orphans() == [_row("y")]
    c.save([_row("y")])
    c.release()
    assert a.data.exists(), "kept for a person to read: its rows are not lost"
    assert not b.data.exists()
