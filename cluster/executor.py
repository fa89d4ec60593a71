"""How the engine runs a step: `Executor.submit(msg)`, then `Executor.result()` — a StepMsg in,
its StepResult out (workers/messages.py). Two implementations:

  LocalExecutor    in process: the draft's proposal, the target's step and the draft's context
                   write, one after the other (`dflash-serve generate`, tests, benchmarks).
  ChannelExecutor  the cluster: the message goes over the control channel to every TP worker
                   and the draft actor, whose loops run the same steppers; the draft hands its
                   proposals to the workers directly, and rank 0's result comes back. The driver
                   does not relay anything within a round.

`submit` returns at once in the cluster (the actors start working), so the engine can do its
host work of the previous step meanwhile; in process it runs the step."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from workers.channel import ChannelReader, ChannelTimeout, ChannelWriter
from workers.controls import ControlsEnv
from workers.messages import StepKind, StepMsg, StepResult
from workers.stepper import (
    Drafter,
    DraftStepper,
    TargetRunner,
    TargetStepper,
    committed_counts,
    draft_proposes,
    draft_writes_context,
)

if TYPE_CHECKING:
    from draft.replay import AcceptanceReplay

log = logging.getLogger(__name__)


class Executor(Protocol):
    def submit(self, msg: StepMsg) -> None: ...

    def result(self) -> StepResult:
        """The result of the oldest step submitted and not yet collected."""
        ...

    def shutdown(self) -> None: ...


def execute(executor: Executor, msg: StepMsg) -> StepResult:
    executor.submit(msg)
    return executor.result()


class LocalExecutor:
    # `submit` runs the step before it returns (no actors work beside the caller)
    runs_on_submit = True

    def __init__(self, runner: TargetRunner, drafter: Drafter | None,
                 controls: ControlsEnv | None = None, replay: AcceptanceReplay | None = None):
        self.runner, self.drafter = runner, drafter
        self.target = TargetStepper(runner, controls)
        self.draft = DraftStepper(drafter, controls, replay) if drafter is not None else None
        self._done: list[StepResult] = []

    def submit(self, msg: StepMsg) -> None:
        self._done.append(self._run(msg))

    def result(self) -> StepResult:
        return self._done.pop(0)

    def _run(self, msg: StepMsg) -> StepResult:
        self.target.apply(msg)
        if self.draft is not None:
            self.draft.apply(msg)
        drafts, propose_s = msg.drafts, None
        if self.draft is not None and draft_proposes(msg):
            drafts, propose_s = self.draft.propose(msg)
        if msg.kind is StepKind.PROPOSE:
            return StepResult(msg.step_id, drafts=drafts, propose_s=propose_s)
        if msg.kind is StepKind.RELEASE:
            return StepResult(msg.step_id)
        if msg.kind is not StepKind.PREFILL and msg.kind is not StepKind.ROUND:
            raise ValueError(f"{msg.kind.name} steps address worker actors; none in process")
        out, verify_s = self.target.run(msg, drafts)
        if self.draft is not None:
            self.draft.commit(msg, out.new_tokens)
        if self.draft is not None and draft_writes_context(msg):
            self.draft.write_context(msg, out.aux, committed_counts(msg, out.num_accepted))
        return StepResult(msg.step_id, out.new_tokens, out.num_accepted, propose_s=propose_s,
                          verify_s=verify_s, errors=out.errors, logprobs=out.logprobs,
                          prompt_logprobs=out.prompt_logprobs)

    def shutdown(self) -> None:
        pass


# A step is overdue once it has run STALL_FACTOR times its expected time (StepTimes), and at
# least STALL_MIN_S. Its actors are then asked, through Ray (a thread beside each one's step
# loop), to answer within PROBE_TIMEOUT_S, again every PROBE_EVERY_S while it runs on. One that
# does not answer is frozen (stopped, or wedged with the interpreter held): the step fails with
# ActorUnresponsive, and the engine restarts. Actors that answer are slow, not stuck (a kernel
# compiling, a step longer than the warm-up's): the step goes on, up to step_timeout_s.
STALL_FACTOR = 8.0
STALL_MIN_S = 5.0
# A step of this many sequences is expected to take as long as the warm-up's (batch 1 on a
# CPU; on a GPU its graph buckets); beyond, proportionally longer (a batch-32 verify round on
# an H100 takes 4.5 times a batch-1 one).
SEQS_PER_STEP_TIME = 8
PROBE_TIMEOUT_S = 5.0
PROBE_EVERY_S = 10.0


@dataclass
class StepTimes:
    """A step's expected seconds from the warm-up's steps (the start-up profile), each figure
    the largest seen: a step's own time (rounds, calls), which grows with its sequences past
    SEQS_PER_STEP_TIME, plus a cost per prompt token fed (prefill chunks). Until `calibrate()`
    nothing is expected, and no step is overdue before step_timeout_s (the warm-up itself
    compiles kernels)."""

    step_s: float = 0.0
    per_token_s: float = 0.0
    calibrated: bool = False

    def observe(self, msg: StepMsg, seconds: float) -> None:
        if self.calibrated:
            return
        tokens = sum(msg.chunk_lens)
        if msg.kind is StepKind.PREFILL and tokens:
            self.per_token_s = max(self.per_token_s, seconds / tokens)
        else:
            self.step_s = max(self.step_s, seconds)

    def calibrate(self) -> None:
        self.calibrated = True

    def deadline_s(self, msg: StepMsg) -> float | None:
        """Seconds after which `msg` is overdue; None before calibration."""
        if not self.calibrated:
            return None
        batch = max(1.0, len(msg.seq_ids) / SEQS_PER_STEP_TIME)
        expected = self.step_s * batch + self.per_token_s * sum(msg.chunk_lens)
        return max(STALL_MIN_S, STALL_FACTOR * expected)


@dataclass
class _InFlight:
    step_id: int
    msg: StepMsg
    sent: float  # time.monotonic()


class ChannelExecutor:
    """The driver's end: `steps` goes to every TP rank and the draft, `results` comes from
    rank 0. `check` raises when an actor of the engine has died (called while a wait sleeps);
    `probe(timeout_s)` raises when an actor does not answer (asked once a step is overdue,
    see StepTimes); a step with no result within `step_timeout_s` raises ActorStepTimeout.
    `stalled` says, for /health, why the step waited on now is overdue (None: it is not, or
    its actors answered)."""

    def __init__(self, steps: ChannelWriter, results: ChannelReader,
                 check: Callable[[], None], step_timeout_s: float,
                 probe: Callable[[float], None] | None = None, times: StepTimes | None = None):
        self.steps, self.results = steps, results
        self.check, self.step_timeout_s = check, step_timeout_s
        self.probe, self.times = probe, times or StepTimes()
        self.stalled: str | None = None
        self._in_flight: list[_InFlight] = []

    def submit(self, msg: StepMsg) -> None:
        self.steps.send(msg, self.step_timeout_s, self.check)
        self._in_flight.append(_InFlight(msg.step_id, msg, time.monotonic()))

    def result(self, timeout_s: float | None = None) -> StepResult:
        step = self._in_flight.pop(0)
        timeout_s = self.step_timeout_s if timeout_s is None else timeout_s
        try:
            res: StepResult = self.results.recv(timeout_s, self._watch(step))
        except ChannelTimeout:
            raise ActorStepTimeout(f"step {step.step_id}: no result within {timeout_s:.0f} s"
                                   ) from None
        finally:
            self.stalled = None
        if res.step_id != step.step_id:
            raise RuntimeError(f"step {step.step_id}: rank 0 answered step {res.step_id}")
        self.times.observe(step.msg, time.monotonic() - step.sent)
        return res

    def _watch(self, step: _InFlight) -> Callable[[], None]:
        """What a wait for `step` runs every poll: the dead-actor check, then, once the step
        is overdue, a probe of the actors every PROBE_EVERY_S."""
        deadline = self.times.deadline_s(step.msg)
        next_probe = None if deadline is None or self.probe is None else step.sent + deadline

        def watch() -> None:
            nonlocal next_probe
            self.check()
            now = time.monotonic()
            if next_probe is None or now < next_probe:
                return
            ran = now - step.sent
            self.stalled = (f"step {step.step_id} has run {ran:.1f} s, past the {deadline:.1f} s "
                            f"expected at most; probing the engine's actors")
            try:
                self.probe(PROBE_TIMEOUT_S)
            except ActorUnresponsive as e:
                raise ActorUnresponsive(f"step {step.step_id} ran {ran:.1f} s (overdue after "
                                        f"{deadline:.1f} s) and {e}") from None
            log.warning("step %d has run %.1f s (overdue after %.1f s); every actor answers, "
                        "so it goes on", step.step_id, time.monotonic() - step.sent, deadline)
            self.stalled = None
            next_probe = time.monotonic() + PROBE_EVERY_S

        return watch

    def shutdown(self) -> None:
        """Ends the actors' loops (STOP), then closes this end."""
        try:
            self.steps.send(StepMsg(-1, StepKind.STOP), timeout_s=5.0)
        except Exception:  # a dead or stuck reader: the actors are killed after this anyway
            pass
        self.steps.close()
        self.results.close()


class ActorStepTimeout(TimeoutError):
    pass


class ActorUnresponsive(ActorStepTimeout):
    """An actor of the engine did not answer a probe while a step was overdue."""
