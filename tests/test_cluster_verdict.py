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
