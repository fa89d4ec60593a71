"""The long-lived step loops of the engine's actors, fed by the control channel
(workers/channel.py) with the messages of workers/messages.py:

  TP rank r   steps ─► [the draft's Drafts, for a round] ─► the step ─► rank 0: StepResult
  draft       steps ─► [a round: propose ─► Drafts] ─► rank 0's StepResult ─► context write of
              the step's committed tokens (their aux rows from the ring) ─► release the slot

So a round's hand-offs run actor to actor: the driver sends one message and reads one result.
The draft writes its context while the driver does its bookkeeping; its next proposal comes
after it in the same loop, so it never proposes from a stale context. A loop returns on STOP;
an error ends it with that error, which the driver sees on the loop's Ray task (and restarts
the engine). The driver creates, opens and seals each actor's channel ends at start-up
(cluster/ray_executor.py) through the methods of `StepLoopEnds`."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import torch

from workers.channel import ChannelReader, ChannelSpec, ChannelWriter
from workers.messages import Drafts, StepKind, StepMsg, StepResult
from workers.stepper import (
    DraftStepper,
    TargetStepper,
    committed_counts,
    draft_proposes,
    draft_writes_context,
)


class StepLoopEnds:
    """One actor's channel ends: the channel it writes (if any) and those it reads, by name
    ("steps", "drafts", "results")."""

    def __init__(self):
        self.channel_writer: ChannelWriter | None = None
        self.channel_readers: dict[str, ChannelReader] = {}

    def create_channel(self, kind: str, num_readers: int, host: str | None, spin_s: float
                       ) -> ChannelSpec:
        """host: where a tcp channel listens (None: this node's address)."""
        host = host or _node_ip()
        self.channel_writer = ChannelWriter(kind, num_readers, host=host, spin_s=spin_s)
        return self.channel_writer.spec

    def open_channel(self, name: str, spec: ChannelSpec, index: int, spin_s: float) -> None:
        self.channel_readers[name] = ChannelReader(spec, index, spin_s)

    def seal_channel(self) -> None:
        self.channel_writer.seal()

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def close_channels(self) -> None:
        for reader in self.channel_readers.values():
            reader.close()
        if self.channel_writer is not None:
            self.channel_writer.close()
        self.channel_writer, self.channel_readers = None, {}


def _node_ip() -> str:
    import ray

    return ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"


# The loop shares its process's GIL with Ray's threads: a short switch interval bounds how long
# it waits for the GIL after a channel wake-up (CPython's default is 5 ms).
GIL_SWITCH_INTERVAL_S = 0.0005


def _steps(steps: ChannelReader, stepper: TargetStepper | DraftStepper) -> Iterator[StepMsg]:
    """The messages until STOP, each applied to the stepper's sequence table first."""
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    while (msg := steps.recv()).kind is not StepKind.STOP:
        stepper.apply(msg)
        yield msg


def run_target_loop(worker) -> None:
    """A TargetWorker's loop (every rank; rank 0 also answers)."""
    drafts_in = worker.channel_readers.get("drafts")
    results = worker.channel_writer  # rank 0's only
    stepper = TargetStepper(worker.runner, worker.controls)
    for msg in _steps(worker.channel_readers["steps"], stepper):
        res = StepResult(msg.step_id)
        if msg.kind is StepKind.CALL:
            method, args = msg.call
            res.value = getattr(worker, method)(*args)
        elif msg.kind is not StepKind.RELEASE:
            drafts = msg.drafts
            if drafts_in is not None and draft_proposes(msg):
                got: Drafts = drafts_in.recv()
                if got.step_id != msg.step_id:
                    raise RuntimeError(f"step {msg.step_id}: drafts of step {got.step_id}")
                drafts, res.propose_s = got.tokens, got.propose_s
            if msg.kind is StepKind.PROPOSE:
                res.drafts = drafts
            else:
                out, res.verify_s = stepper.run(msg, drafts)
                res.new_tokens, res.num_accepted = out.new_tokens, out.num_accepted
                res.errors = out.errors
                res.logprobs, res.prompt_logprobs = out.logprobs, out.prompt_logprobs
                if results is not None and worker.aux_sender is not None \
                        and draft_writes_context(msg):
                    res.aux = worker.aux_sender.put(out.aux, out.aux_positions)
        if results is not None:
            results.send(res)


def run_draft_loop(draft) -> None:
    """A DraftWorker's loop."""
    results = draft.channel_readers["results"]
    drafts_out, receiver = draft.channel_writer, draft.aux_receiver
    stepper = DraftStepper(draft.runner, draft.controls, draft.replay)
    for msg in _steps(draft.channel_readers["steps"], stepper):
        if draft_proposes(msg):
            tokens, seconds = stepper.propose(msg)
            drafts_out.send(Drafts(msg.step_id, tokens, seconds))
        res: StepResult = results.recv()
        if res.step_id != msg.step_id:
            raise RuntimeError(f"step {msg.step_id}: rank 0 answered step {res.step_id}")
        stepper.commit(msg, res.new_tokens)
        if draft_writes_context(msg):
            aux, _ = receiver.get(res.aux)
            stepper.write_context(msg, aux, committed_counts(msg, res.num_accepted))
            if aux.is_cuda:  # the ring's rows are read once the stream has run the write
                torch.cuda.current_stream(aux.device).synchronize()
            receiver.release(res.aux)
