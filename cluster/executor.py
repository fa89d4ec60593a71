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

from collections.abc import Callable
from typing import Protocol

from workers.channel import ChannelReader, ChannelTimeout, ChannelWriter
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
    def __init__(self, runner: TargetRunner, drafter: Drafter | None):
        self.runner, self.drafter = runner, drafter
        self.target = TargetStepper(runner)
        self.draft = DraftStepper(drafter) if drafter is not None else None
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
        if self.draft is not None and draft_writes_context(msg):
            self.draft.write_context(msg, out.aux, committed_counts(msg, out.num_accepted))
        return StepResult(msg.step_id, out.new_tokens, out.num_accepted, propose_s=propose_s,
                          verify_s=verify_s, errors=out.errors, logprobs=out.logprobs,
                          prompt_logprobs=out.prompt_logprobs)

    def shutdown(self) -> None:
        pass


class ChannelExecutor:
    """The driver's end: `steps` goes to every TP rank and the draft, `results` comes from
    rank 0. `check` raises when an actor of the engine has died (called while a wait sleeps);
    a step with no result within `step_timeout_s` raises ActorStepTimeout."""

    def __init__(self, steps: ChannelWriter, results: ChannelReader,
                 check: Callable[[], None], step_timeout_s: float):
        self.steps, self.results = steps, results
        self.check, self.step_timeout_s = check, step_timeout_s
        self._in_flight: list[int] = []

    def submit(self, msg: StepMsg) -> None:
        self.steps.send(msg, self.step_timeout_s, self.check)
        self._in_flight.append(msg.step_id)

    def result(self, timeout_s: float | None = None) -> StepResult:
        step_id = self._in_flight.pop(0)
        timeout_s = self.step_timeout_s if timeout_s is None else timeout_s
        try:
            res: StepResult = self.results.recv(timeout_s, self.check)
        except ChannelTimeout:
            raise ActorStepTimeout(f"step {step_id}: no result within {timeout_s:.0f} s"
                                   ) from None
        if res.step_id != step_id:
            raise RuntimeError(f"step {step_id}: rank 0 answered step {res.step_id}")
        return res

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
