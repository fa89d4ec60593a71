"""Step messages as diffs (workers/messages.py, workers/stepper.py): the engine sends each
sequence in full exactly once, names it by id afterwards and drops it once, so the workers'
tables end empty; the runners satisfy the Protocols the steppers drive."""

from __future__ import annotations

import numpy as np
import torch

from cluster.engine import LLMEngine
from configs.engine import EngineConfig, SamplingParams
from draft.proposer import DraftRunner
from workers.messages import NewSeq, StepKind, StepMsg
from workers.model_runner import ModelRunner
from workers.stepper import Drafter, SeqTable, TargetRunner


class Recording:
    """Wraps an executor and keeps every message it was given."""

    def __init__(self, inner):
        self.inner, self.msgs = inner, []

    def submit(self, msg: StepMsg) -> None:
        self.msgs.append(msg)
        self.inner.submit(msg)

    def result(self):
        return self.inner.result()

    def shutdown(self) -> None:
        self.inner.shutdown()


def test_sequences_cross_once_and_steps_carry_only_ids(tiny_demo):
    target, draft = map(str, tiny_demo)
    engine = LLMEngine(EngineConfig(model=target, draft_model=draft, block_size=4,
                                    max_num_seqs=4, page_size=4, max_num_batched_tokens=8))
    engine.executor = rec = Recording(engine.executor)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (3, 11, 6, 20, 2)]
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (5, 9, 2, 7, 12)]
    outs = engine.generate(prompts, params)
    assert [len(o.output_ids) for o in outs] == [5, 9, 2, 7, 12]
    sent = [s.seq_id for m in rec.msgs for s in m.new_seqs]
    released = [i for m in rec.msgs for i in m.released]
    assert sorted(sent) == sorted(set(sent)) and len(sent) == len(prompts)  # once each
    assert sorted(released) == sorted(sent)  # and dropped once each
    table = SeqTable()
    for m in rec.msgs:
        table.apply(m)
        assert all(i in table.seqs for i in m.seq_ids)  # a step names only known sequences
        for i, t in zip(m.seq_ids, table.tables(m), strict=True):  # made once, at admission
            assert t.dtype == torch.int32 and t.tolist() == table.seqs[i].block_table
    assert table.seqs == {} and table.table_t == {}
    for m in rec.msgs:  # the full prompt crosses only inside a NewSeq
        if m.kind is StepKind.PREFILL:
            assert sum(m.chunk_lens) <= 8 and all(isinstance(s, NewSeq) for s in m.new_seqs)
        if m.kind is StepKind.ROUND:
            assert len(m.anchors) == len(m.seq_ids) == len(m.starts) and m.drafts is None
    assert rec.msgs[-1].kind is StepKind.RELEASE  # idle: the last finished ones dropped
    assert not engine.executor.inner.runner.generators


def test_runners_satisfy_the_protocols_the_steppers_drive(tiny_demo):
    engine = LLMEngine(EngineConfig(model=str(tiny_demo[0]), draft_model=str(tiny_demo[1]),
                                    max_num_seqs=2, page_size=4))
    runner, drafter = engine.executor.runner, engine.executor.drafter
    assert isinstance(runner, ModelRunner) and isinstance(runner, TargetRunner)
    assert isinstance(drafter, DraftRunner) and isinstance(drafter, Drafter)


def test_host_tables_take_lists_or_tensors_and_slice_or_pad_to_a_width():
    from workers.messages import host_tables

    lists = [[4, 9, 2], [7], [1, 3, 5, 8]]
    for tables in (lists, [torch.tensor(t, dtype=torch.int32) for t in lists]):
        assert host_tables(tables, 4).tolist() == [[4, 9, 2, 0], [7, 0, 0, 0], [1, 3, 5, 8]]
        assert host_tables(tables, 2).tolist() == [[4, 9], [7, 0], [1, 3]]
        wide = host_tables(tables, 6)
        assert wide.dtype == np.int32 and wide.tolist()[1] == [7, 0, 0, 0, 0, 0]
