"""The spool of placement rows the metadata DB refused (airflow_drl_executor.spool)."""

from __future__ import annotations

import datetime as dt
import json
import os
from pathlib import Path

import pytest

from airflow_drl_executor.spool import Spool
from airflow_drl_executor.traces import PlacementRecord


def _row(celery_id: str) -> dict[str, object]:
    return PlacementRecord(
        ti_id="0193a6a4-0000-7000-8000-000000000001", dag_id="etl", run_id="r", task_id="t", map_index=-1,
        try_number=1, pool="gpu", vm_class="gpu-a10", score=-1.5, reason="r", fallback=False, policy="drl",
        policy_version="1", request_id="q", decision_ms=1.0, features={"kind": "x"}, celery_id=celery_id,
    ).row(dt.datetime(2026, 12, 6, 9, 30, 1, 250000, tzinfo=dt.UTC))


def _die(spool: Spool) -> None:
    """What the kernel does for a killed process: its lock goes, its files stay."""
    assert spool._lock_fd is not None
    os.close(spool._lock_fd)
    spool._lock_fd = None


def test_a_live_executors_rows_are_its_own_and_a_dead_ones_are_taken_over_once(tmp_path: Path) -> None:
    a, b, c = Spool(tmp_path), Spool(tmp_path), Spool(tmp_path)
    a.save([_row("x"), _row("y")])
    assert b.adopt_orphans()[0] == [], "a's process is alive: its rows are its own"
    _die(a)
    got = b.adopt_orphans()[0]
    assert got == [_row("x"), _row("y")], "the same rows, dates included"
    assert c.adopt_orphans()[0] == [], "taken by b: c does not write them a second time"
    b.save(got)
    b.release()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [f"{b.name}.jsonl", f"{b.name}.lock", f"{c.name}.lock"]), "a's files gone once b saved its rows"
    assert c.adopt_orphans()[0] == []


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
    assert c.adopt_orphans()[0] == [_row("z")]


def test_an_unreadable_file_is_left_in_place_and_the_others_are_taken(tmp_path: Path) -> None:
    a, b = Spool(tmp_path), Spool(tmp_path)
    a.data.write_text('{"celery_id": "x"}\nnot json\n')
    a._saved = True
    b.save([_row("y")])
    _die(a)
    _die(b)
    c = Spool(tmp_path)
    assert c.adopt_orphans()[0] == [_row("y")]
    c.save([_row("y")])
    c.release()
    assert a.data.exists(), "kept for a person to read: its rows are not lost"
    assert not b.data.exists()


def test_a_forked_child_does_not_keep_a_dead_executors_rows_from_the_next(tmp_path: Path) -> None:
    """was: Celery's publishing and state-fetching pools (forked) kept a copy of the lock's
    descriptor: a killed scheduler's children held its lock for ever, and its rows were never
    taken over (the tasks sent again by the next scheduler's adoption)"""
    import signal
    import time

    a, b = Spool(tmp_path), Spool(tmp_path)
    a.save([_row("x")])
    ready_r, ready_w = os.pipe()
    child = os.fork()
    if child == 0:  # a pool worker that outlives its scheduler
        os.write(ready_w, b"1")  # past fork: its handlers ran
        time.sleep(30)
        os._exit(0)
    try:
        assert os.read(ready_r, 1) == b"1"
        _die(a)
        assert b.adopt_orphans()[0] == [_row("x")]
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)


def test_a_lock_file_this_user_cannot_open_is_left_and_the_others_are_taken(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """was: a PermissionError (a scheduler once run as root left a 0600 lock) went up through
    start() and adoption: the scheduler stopped at every start"""
    a, b = Spool(tmp_path), Spool(tmp_path)
    a.save([_row("x")])
    b.save([_row("y")])
    _die(a)
    _die(b)
    real_open = os.open

    def open_(path, flags, *args):  # type: ignore[no-untyped-def]
        if Path(path).name == f"{a.name}.lock":
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", open_)
    c = Spool(tmp_path)
    assert c.adopt_orphans()[0] == [_row("y")]
    assert c.celery_ids() == {"x", "y"}, "adoption still counts a's row as sent"


def test_a_failed_save_leaves_no_partial_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    a = Spool(tmp_path)
    a.save([_row("x")])

    def full(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError):
        a.save([_row("x"), _row("y")])
    assert sorted(p.suffix for p in tmp_path.iterdir()) == [".jsonl", ".lock"], "no .tmp left"
    monkeypatch.undo()
    assert Spool(tmp_path).celery_ids() == {"x"}, "the previous version stays"


def test_rows_that_are_not_placements_are_set_aside_not_taken_over(tmp_path: Path) -> None:
    """was: a row without its task instance or request (a file written by hand) was taken over and
    made every later start raise KeyError, as each took over the file of the one before"""
    a = Spool(tmp_path)
    partial = {k: v for k, v in _row("w").items() if k != "waited_s"}  # has what names it, not every column
    a.data.write_text('{"celery_id": "x"}\n' + json.dumps({**_row("y"), "decided_at": "2026-12-06T09:30:01+00:00"})
                      + "\n" + json.dumps({**partial, "decided_at": "2026-12-06T09:30:01+00:00"}) + "\n")
    a._saved = True
    _die(a)
    b = Spool(tmp_path)
    assert [r["celery_id"] for r in b.adopt_orphans()[0]] == ["y"]
    assert '"celery_id": "x"' in b.rejected.read_text() and '"celery_id": "w"' in b.rejected.read_text()


def test_unsent_marks_outlive_their_process_and_go_once_written(tmp_path: Path) -> None:
    """The (Celery id, request id) of rows whose not-sent mark the DB refused: every executor
    here sees them, the next one takes a dead one's over. was: in memory only, so the next
    scheduler's adoption took such a task for sent"""
    a, b = Spool(tmp_path), Spool(tmp_path)
    a.save([_row("x")], {("x", "q")})
    assert b.unsent_pairs() == {("x", "q")}, "a live one's too"
    _die(a)
    assert b.adopt_orphans() == ([_row("x")], {("x", "q")})
    b.save([_row("x")], {("x", "q")})
    b.release()
    b.save([], set())  # written and marked
    assert b.unsent_pairs() == set() and sorted(p.name for p in tmp_path.iterdir()) == [f"{b.name}.lock"]


def test_an_unreadable_unsent_file_is_set_aside_and_its_rows_are_taken_all_the_same(tmp_path: Path) -> None:
    """found by review: a malformed unsent file kept its process's rows from the DB for ever, and
    one nested too deeply raised RecursionError out of the scheduler's start"""
    a = Spool(tmp_path)
    a.save([_row("x")], {("x", "q")})
    a.unsent.write_text("[" * 100_000)
    _die(a)
    b = Spool(tmp_path)
    assert b.adopt_orphans() == ([_row("x")], set())
    assert (tmp_path / f"{a.name}.unsent.rejected.json").exists() and b.unsent_pairs() == set()
