"""Pipeline schedules as data: per-rank lists of forward/backward/send/recv actions.

A schedule for ``stages`` pipeline stages and ``microbatches`` micro-batches is a list
with one entry per stage: the :class:`Action` objects that stage runs, in order. The
executor (:mod:`rapydli.parallel.executor`) runs such a list; the checks here read the
same lists, so what is tested is what runs:

* :func:`simulate` plays a schedule with given per-stage forward/backward times (sends
  complete at once, a receive waits for its send) and raises on a deadlock or a broken
  dependency; it gives the ideal timeline the measured one is compared with.
* :func:`peak_live` counts the micro-batches whose activations a stage holds at most.

Schedules are registered by name in :data:`SCHEDULES` (``TrainConfig.pipeline_schedule``
reads its choices from there).

Examples
--------
>>> [str(a) for a in gpipe(2, 2)[1]]
['recv_activation(0)', 'forward(0)', 'recv_activation(1)', 'forward(1)', 'backward(0)', 'send_gradient(0)', 'backward(1)', 'send_gradient(1)']
>>> peak_live(one_f_one_b(4, 8)[0]), peak_live(gpipe(4, 8)[0])
(4, 8)
>>> simulate(gpipe(3, 4), 1.0, 2.0).makespan  # (m + p - 1) * (t_f + t_b)
18.0
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from rapydli.errors import ConfigError
from rapydli.registry import Registry

#: Action kinds that compute (the others move tensors between neighbouring stages).
COMPUTE = ("forward", "backward")


@dataclass(frozen=True)
class Action:
    """One step of a stage's schedule.

    Attributes
    ----------
    kind
        ``"forward"``, ``"backward"``, ``"send_activation"``, ``"recv_activation"``,
        ``"send_gradient"`` or ``"recv_gradient"``.
    microbatch
        Index of the micro-batch the action works on.
    """

    kind: str
    microbatch: int

    def __str__(self) -> str:
        return f"{self.kind}({self.microbatch})"


Schedule = list[list[Action]]


def _forward(stage: int, stages: int, mb: int) -> list[Action]:
    actions = [Action("recv_activation", mb)] if stage > 0 else []
    actions.append(Action("forward", mb))
    if stage < stages - 1:
        actions.append(Action("send_activation", mb))
    return actions


def _backward(stage: int, stages: int, mb: int) -> list[Action]:
    actions = [Action("recv_gradient", mb)] if stage < stages - 1 else []
    actions.append(Action("backward", mb))
    if stage > 0:
        actions.append(Action("send_gradient", mb))
    return actions


def _check(stages: int, microbatches: int) -> None:
    for name, value in (("stages", stages), ("microbatches", microbatches)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"pipeline {name}={value!r} is invalid: it must be an integer >= 1")


def gpipe(stages: int, microbatches: int) -> Schedule:
    """Fill-drain (GPipe): every micro-batch's forward, then every backward, in order.

    A stage holds the activations of all ``microbatches`` before the first backward.
    """
    _check(stages, microbatches)
    schedule = []
    for s in range(stages):
        actions = [a for mb in range(microbatches) for a in _forward(s, stages, mb)]
        actions += [a for mb in range(microbatches) for a in _backward(s, stages, mb)]
        schedule.append(actions)
    return schedule


def one_f_one_b(stages: int, microbatches: int) -> Schedule:
    """One-forward-one-backward (PipeDream-flush / Megatron's non-interleaved schedule).

    Stage ``s`` runs ``min(stages - 1 - s, microbatches)`` warm-up forwards, then
    alternates one forward with one backward, then drains the remaining backwards; it
    holds at most ``stages - s`` micro-batches of activations.
    """
    _check(stages, microbatches)
    schedule = []
    for s in range(stages):
        warmup = min(stages - 1 - s, microbatches)
        actions = [a for mb in range(warmup) for a in _forward(s, stages, mb)]
        for i in range(microbatches - warmup):
            actions += _forward(s, stages, warmup + i)
            actions += _backward(s, stages, i)
        actions += [a for mb in range(microbatches - warmup, microbatches) for a in _backward(s, stages, mb)]
        schedule.append(actions)
    return schedule


#: Schedules by the name ``TrainConfig.pipeline_schedule`` uses: ``f(stages, microbatches) -> Schedule``.
#: Other packages add schedules in the ``rapydli.pipeline_schedules`` entry-point group.
SCHEDULES = Registry("pipeline schedule", {"gpipe": gpipe, "1f1b": one_f_one_b}, group="rapydli.pipeline_schedules")


def build(name: str, stages: int, microbatches: int) -> Schedule:
    """The schedule registered as ``name``; an unknown name is a :class:`ConfigError`."""
    if name not in SCHEDULES:
        raise ConfigError(f"pipeline_schedule={name!r} is unknown; allowed: {', '.join(SCHEDULES)}")
    make: Callable[[int, int], Schedule] = SCHEDULES.load(name)
    return make(stages, microbatches)


def peak_live(actions: Sequence[Action]) -> int:
    """Most micro-batches whose forward ran and whose backward did not yet, at any point."""
    live = peak = 0
    for action in actions:
        if action.kind == "forward":
            live += 1
            peak = max(peak, live)
        elif action.kind == "backward":
            live -= 1
    return peak


def bubble_fraction(stages: int, microbatches: int) -> float:
    """Theoretical idle fraction of a fill-drain or 1F1B pipeline: ``(p - 1) / (m + p - 1)``."""
    return (stages - 1) / (microbatches + stages - 1)


@dataclass
class Simulation:
    """The timeline :func:`simulate` computed.

    Attributes
    ----------
    spans
        Per stage: ``(action, start, end)`` of every action, in the order run.
    makespan
        When the last action ended.
    """

    spans: list[list[tuple[Action, float, float]]] = field(default_factory=list)
    makespan: float = 0.0

    def busy(self, stage: int) -> float:
        """Time stage ``stage`` spent computing."""
        return sum(end - start for action, start, end in self.spans[stage] if action.kind in COMPUTE)

    def idle_fraction(self, stage: int) -> float:
        """Share of the makespan stage ``stage`` did not compute."""
        return 1.0 - self.busy(stage) / self.makespan if self.makespan > 0 else 0.0


def simulate(
    schedule: Schedule,
    forward_time: float | Sequence[float],
    backward_time: float | Sequence[float],
    transfer_time: float = 0.0,
    receive_delay: Callable[[float], float] | None = None,
) -> Simulation:
    """Play ``schedule`` with per-stage compute times; check every dependency on the way.

    Sends never block; a receive ends ``transfer_time`` after its matching send, or when
    the stage reaches it, whichever is later; a receive that waited ``w`` seconds ends
    ``receive_delay(w)`` later still (a waiting rank that polls with sleeps notices late). Raises :class:`ConfigError` if a stage
    computes a micro-batch it has not received, backs it up before its forward, sends
    what it has not computed, or if the stages deadlock (no stage can go on and some are
    not done).
    """
    stages = len(schedule)
    t_f = [float(forward_time)] * stages if isinstance(forward_time, int | float) else [float(t) for t in forward_time]
    t_b = (
        [float(backward_time)] * stages if isinstance(backward_time, int | float) else [float(t) for t in backward_time]
    )
    sent: dict[tuple[str, int, int], float] = {}  # (kind, to stage, mb) -> time sent
    done: list[set[tuple[str, int]]] = [set() for _ in range(stages)]
    clock = [0.0] * stages
    position = [0] * stages
    result = Simulation(spans=[[] for _ in range(stages)])
    progressed = True
    while progressed:
        progressed = False
        for s in range(stages):
            while position[s] < len(schedule[s]):
                action = schedule[s][position[s]]
                start = clock[s]
                if action.kind.startswith("recv_"):
                    what = action.kind[len("recv_") :]
                    key = (what, s, action.microbatch)
                    if key not in sent:
                        break  # wait for the neighbour
                    end = max(start, sent[key] + transfer_time)
                    if receive_delay is not None and end > start:
                        end += receive_delay(end - start)
                else:
                    _require(action, s, stages, done[s])
                    end = start + (t_f[s] if action.kind == "forward" else t_b[s] if action.kind == "backward" else 0.0)
                    if action.kind.startswith("send_"):
                        what = action.kind[len("send_") :]
                        peer = s + 1 if what == "activation" else s - 1
                        sent[(what, peer, action.microbatch)] = end
                done[s].add((action.kind, action.microbatch))
                result.spans[s].append((action, start, end))
                clock[s] = end
                position[s] += 1
                progressed = True
    stuck = [f"stage {s} at {schedule[s][position[s]]}" for s in range(stages) if position[s] < len(schedule[s])]
    if stuck:
        raise ConfigError("the schedule deadlocks: " + "; ".join(stuck))
    result.makespan = max(clock) if clock else 0.0
    return result


def _require(action: Action, stage: int, stages: int, done: set[tuple[str, int]]) -> None:
    """Raise unless what ``action`` needs on ``stage`` has run there already."""
    mb = action.microbatch
    needs: list[str] = []
    if action.kind == "forward" and stage > 0:
        needs = ["recv_activation"]
    elif action.kind == "backward":
        needs = ["forward"] + (["recv_gradient"] if stage < stages - 1 else [])
    elif action.kind == "send_activation":
        needs = ["forward"]
    elif action.kind == "send_gradient":
        needs = ["backward"]
    for need in needs:
        if (need, mb) not in done:
            raise ConfigError(f"stage {stage} runs {action} before {need}({mb})")
    if (action.kind, mb) in done:
        raise ConfigError(f"stage {stage} runs {action} twice")
