"""The pipeline's communication cannot deadlock, even when every send blocks until its
receive is posted (NCCL's rule): a model check of every stage's batches of sends and receives."""

import random

import pytest

from lightning_pipetx.strategy.stage_runner import Op, communication_plan, schedule_actions


def deadlocks(plans: list[list[list[Op]]]) -> bool:
    """Simulate the stages' batches under strict rendezvous semantics.

    A stage executes its batches one after the other; a send and its receive complete only
    together, when the batches holding them are both executing; a batch completes when all its
    operations have. Messages between two stages match in the order they were posted, as NCCL
    matches them. Returns True when some stage can never finish.
    """
    num_stages = len(plans)
    position = [0] * num_stages  # the batch each stage executes
    done: list[set[int]] = [set() for _ in range(num_stages)]  # completed ops of the current batch
    # The n-th send from a to b matches the n-th receive at b from a.
    order: dict[tuple[int, int, int, int], tuple[int, int]] = {}
    for stage, batches in enumerate(plans):
        counts: dict[tuple[int, int], int] = {}
        for b, batch in enumerate(batches):
            for o, op in enumerate(batch):
                src, dst = (stage, op.peer) if op.send else (op.peer, stage)
                n = counts.get((op.send, op.peer), 0)
                counts[(op.send, op.peer)] = n + 1
                order[(src, dst, n, op.send)] = (b, o)
    sequence = {}
    for stage, batches in enumerate(plans):
        counts = {}
        for b, batch in enumerate(batches):
            for o, op in enumerate(batch):
                n = counts.get((op.send, op.peer), 0)
                counts[(op.send, op.peer)] = n + 1
                sequence[(stage, b, o)] = n
    progress = True
    while progress:
        progress = False
        for stage in range(num_stages):
            if position[stage] >= len(plans[stage]):
                continue
            batch = plans[stage][position[stage]]
            for o, op in enumerate(batch):
                if o in done[stage]:
                    continue
                src, dst = (stage, op.peer) if op.send else (op.peer, stage)
                n = sequence[(stage, position[stage], o)]
                peer_batch, peer_op = order.get((src, dst, n, not op.send), (None, None))
                assert peer_batch is not None, f"unmatched {op} on stage {stage}"
                if position[op.peer] == peer_batch:
                    assert plans[op.peer][peer_batch][peer_op].message == op.message, "messages out of order"
                    done[stage].add(o)
                    done[op.peer].add(peer_op)
                    progress = True
            for s in range(num_stages):
                if position[s] < len(plans[s]) and len(done[s]) == len(plans[s][position[s]]):
                    position[s] += 1
                    done[s] = set()
                    progress = True
    return any(position[s] < len(plans[s]) for s in range(num_stages))


def _shape_changes(microbatches):
    """Which micro-batches change shape: none, every one, and seeded random subsets."""
    rng = random.Random(microbatches)
    every = frozenset(range(microbatches))
    return [frozenset(), every] + [frozenset(i for i in every if rng.random() < 0.5) for _ in range(3)]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("num_stages", range(2, 9))
def test_no_schedule_deadlocks_under_strict_sends(schedule, num_stages):
    for microbatches in range(1, 17):
        for changed in _shape_changes(microbatches):
            plans = [communication_plan(schedule, num_stages, s, microbatches, changed) for s in range(num_stages)]
            assert not deadlocks(plans), (schedule, num_stages, microbatches, sorted(changed))


def test_only_the_first_activation_of_a_step_and_a_changed_one_take_a_second_batch():
    plan = communication_plan("gpipe", 2, 1, 4, changed=frozenset({2}))
    acts = [[op.message for op in batch] for batch in plan if batch and batch[0].message[0] == "act"]
    assert acts == [
        [("act", 0, "header")],
        [("act", 0, "payload")],
        [("act", 1, "header"), ("act", 1, "payload")],
        [("act", 2, "header"), ("act", 2, "stand-in")],
        [("act", 2, "payload")],
        [("act", 3, "header"), ("act", 3, "payload")],
    ]


def _unpaired_plan(schedule, num_stages, stage, microbatches):
    """The old ordering: every send posted on its own after its action, every receive on its own."""
    batches = []
    for kind, i in schedule_actions(schedule, num_stages, stage, microbatches):
        if kind == "F" and stage > 0:
            batches.append([Op(False, stage - 1, ("act", i, "payload"))])
        if kind == "B" and stage < num_stages - 1:
            batches.append([Op(False, stage + 1, ("grad", i, ""))])
        if kind == "F" and stage < num_stages - 1:
            batches.append([Op(True, stage + 1, ("act", i, "payload"))])
        if kind == "B" and stage > 0:
            batches.append([Op(True, stage - 1, ("grad", i, ""))])
    return batches


def test_the_checker_finds_the_deadlock_of_unpaired_sends_in_1f1b():
    # Stage s sends activation i+1 then waits for gradient i, while stage s+1 sends gradient i
    # then waits for activation i+1: the circular wait NCCL can hit, which gloo's buffering hides.
    plans = [_unpaired_plan("1f1b", 2, s, 4) for s in range(2)]
    assert deadlocks(plans)
    plans = [_unpaired_plan("gpipe", 2, s, 4) for s in range(2)]
    assert not deadlocks(plans)  # GPipe never sends both ways at once


def test_every_send_of_a_plan_has_its_receive():
    for schedule, changed in [("gpipe", frozenset()), ("1f1b", frozenset()), ("1f1b", frozenset({1, 4}))]:
        plans = [communication_plan(schedule, 4, s, 6, changed) for s in range(4)]
        sends = sorted((s, op.peer, op.message) for s, plan in enumerate(plans) for b in plan for op in b if op.send)
        recvs = sorted(
            (op.peer, s, op.message) for s, plan in enumerate(plans) for b in plan for op in b if not op.send
        )
        assert sends == recvs
