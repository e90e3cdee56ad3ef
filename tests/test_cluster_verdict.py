"""A trial's rank 0 waits on the notebook's verdict; a lost answer is asked for again, not waited on forever."""

from __future__ import annotations

import pytest

from rapydli.cluster import engine


def test_a_lost_go_on_is_asked_for_again_until_it_arrives(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine, "VERDICT_REMIND_S", 0.02)
    reminders: list[int] = []

    def remind() -> None:  # the client answers the second reminder (the first answer was lost)
        reminders.append(1)
        if len(reminders) == 2:
            engine._go_on.set()

    engine.expect_verdict()
    assert engine.await_verdict(remind=remind) is False
    assert len(reminders) == 2 and not engine._go_on.is_set()  # the answer is used up


def test_an_answer_already_in_needs_no_reminder() -> None:
    engine.expect_verdict()
    engine._go_on.set()
    assert engine.await_verdict(remind=lambda: pytest.fail("reminded although the answer was in")) is False


class _Answers:
    """The cluster Job's side of a verdict: the ranks told to go on, in order."""

    def __init__(self) -> None:
        self.go_on_calls: list[list[int]] = []

    def go_on(self, ranks: list[int]) -> None:
        self.go_on_calls.append(list(ranks))


def _training_job(decided: list[dict]) -> tuple[object, _Answers]:
    """A TrainingJob's event handling alone, for a trial whose pruner reads ``val_loss``."""
    from rapydli.experiments.job import TrainingJob

    job = TrainingJob.__new__(TrainingJob)
    answers = _Answers()
    job.__dict__.update(
        rows=[],
        stop_requested_at=None,
        _verdict_step=None,
        await_verdict="val_loss",
        targets=[0, 1],
        job=answers,
        callbacks=[decided.append],
        store=None,
        run_id=None,
        _bar=None,
        stragglers=None,
        progress=False,
    )
    return job, answers


def test_a_lost_report_is_decided_on_from_the_reminder_that_carries_it() -> None:
    decided: list[dict] = []
    job, answers = _training_job(decided)
    row = {"kind": "eval", "step": 5, "val_loss": 0.7}
    job._on_event(0, "awaiting", {"step": 5, "row": row})  # the metrics event never came: the reminder brings the row
    assert [r["step"] for r in decided] == [5] and answers.go_on_calls == [[0]]
    job._on_event(0, "awaiting", {"step": 5, "row": row})  # decided already: only the answer is sent again
    assert [r["step"] for r in decided] == [5] and answers.go_on_calls == [[0], [0]]


def test_a_lost_answer_is_sent_again_without_deciding_twice() -> None:
    decided: list[dict] = []
    job, answers = _training_job(decided)
    row = {"kind": "eval", "step": 10, "val_loss": 0.5}
    job._on_event(0, "metrics", row)
    job._on_event(0, "awaiting", {"step": 10, "row": row})
    assert len(decided) == 1 and answers.go_on_calls == [[0], [0]]
    job.stop_requested_at = 1.0  # pruned: a stop is the answer, no "go on"
    job._on_event(0, "awaiting", {"step": 10, "row": row})
    assert answers.go_on_calls == [[0], [0]]


#: Raises the answer's signal at every line run while rank 0 waits on its verdict (the wait's own
#: frames and what they call: Event/Condition code that holds a lock, with the old flags), and
#: prints how many answers came through. The handler runs at the next bytecode, inside that code.
_SIGNAL_EVERYWHERE = """
import signal, sys, threading
from rapydli.cluster import engine

signal.signal(engine.GO_ON_SIGNAL, engine._on_go_on_signal)
waiting = [False]

def trace(frame, event, arg):
    if waiting[0] and event == "line" and frame.f_code.co_filename in (threading.__file__, engine.__file__):
        signal.raise_signal(engine.GO_ON_SIGNAL)
    return trace

answered = 0
for _ in range(50):
    engine.expect_verdict()
    waiting[0] = True
    sys.settrace(trace)
    engine.await_verdict()
    sys.settrace(None)
    waiting[0] = False
    answered += 1
print("answered", answered)
"""


def test_an_answer_that_interrupts_the_wait_anywhere_ends_it() -> None:
    """The answer is a signal whose handler runs in the waiting thread: a handler that takes a lock the wait holds
    (``threading.Event``) would wait for ever; here the signal comes at every line of the wait."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _SIGNAL_EVERYWHERE], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["answered", "50"]
