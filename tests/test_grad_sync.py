"""Gradient sync and backward hooks under ElasticPipelineStrategy, against one plain process.

Each case of grads_cases.py trains on 2 or 4 gloo processes and in one process on the same
global batches. Checked: the weights; what ``on_before_backward`` and ``on_after_backward``
see on every rank; that reductions start during the last backward; which stages reduce the
weights outside the block list; and clear errors for what the overlapped sync cannot do.
(16-mixed and more layouts: test_recipes.py and test_pipeline_equivalence.py.)
"""

import json
import math

import pytest
import torch
from distributed import run_workers
from grads_cases import ERROR_CASES, FOUR_PROCESS_CASES, TWO_PROCESS_CASES, reference_run


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    out = tmp_path_factory.mktemp("grads2")
    run_workers("grads_worker.py", 2, str(out), *(json.dumps(c) for c in TWO_PROCESS_CASES))
    return out


@pytest.fixture(scope="module")
def four_processes(tmp_path_factory):
    out = tmp_path_factory.mktemp("grads4")
    run_workers("grads_worker.py", 4, str(out), *(json.dumps(c) for c in FOUR_PROCESS_CASES))
    return out


_references: dict[str, dict] = {}


def _reference(case):
    if case["name"] not in _references:
        _references[case["name"]] = reference_run(case)
    return _references[case["name"]]


def _ranks(out, case, world):
    return [torch.load(out / f"{case['name']}_rank{r}.pt", weights_only=False) for r in range(world)]


def _case(name):
    return next(c for c in TWO_PROCESS_CASES + FOUR_PROCESS_CASES if c["name"] == name)


TOLERANCE = {"atol": 1e-5, "rtol": 1e-4}


def _check_weights(case, ranks):
    expected = _reference(case)["state"]
    for key, value in expected.items():
        torch.testing.assert_close(ranks[0]["state"][key], value, **TOLERANCE, msg=f"{case['name']}: {key}")


def _check_hooks(case, ranks):
    """on_before_backward / on_after_backward fired on every rank, once per batch, with the
    gradients in place: each rank's equal one process's (at synchronised batches when replicated)."""
    reference = _reference(case)
    world = len(ranks)
    replicas = world // case["pipeline_length"]
    batches = case["steps"] * case["accumulate"]
    for rank in ranks:
        assert len(rank["losses"]) == len(rank["grads"]) == batches
    tolerance = TOLERANCE
    for batch in range(batches):
        # A replica's stages agree on its loss; the replicas' losses average to the batch's.
        losses = [r["losses"][batch] for r in ranks]
        mean = sum(losses) / world
        assert mean == pytest.approx(reference["losses"][batch], rel=tolerance["rtol"], abs=tolerance["atol"])
        synced = replicas == 1 or (batch + 1) % case["accumulate"] == 0
        if not synced:
            continue
        expected = reference["grads"][batch]
        held = set()
        for r, rank in enumerate(ranks):
            grads = rank["grads"][batch]
            held |= set(grads)
            assert set(grads) <= set(expected), f"rank {r} holds gradients one process has not"
            for name, norm in grads.items():
                if not math.isfinite(expected[name]):  # an overflow: inf or nan alike
                    assert not math.isfinite(norm), f"batch {batch}, {name}"
                    continue
                torch.testing.assert_close(
                    torch.tensor(norm), torch.tensor(expected[name]), **tolerance, msg=f"batch {batch}, {name}"
                )
        assert held == set(expected), f"batch {batch}: gradients nobody holds: {set(expected) - held}"


@pytest.mark.parametrize("case", TWO_PROCESS_CASES, ids=lambda c: c["name"])
def test_two_processes_match_one_process(case, two_processes):
    ranks = _ranks(two_processes, case, 2)
    _check_weights(case, ranks)
    _check_hooks(case, ranks)


@pytest.mark.parametrize("case", FOUR_PROCESS_CASES, ids=lambda c: c["name"])
def test_four_processes_match_one_process(case, four_processes):
    ranks = _ranks(four_processes, case, 4)
    _check_weights(case, ranks)
    _check_hooks(case, ranks)


def test_reductions_start_during_the_last_backward(two_processes):
    """1x2, two micro-batches: when the word embedding's gradient arrives at the end of the
    last micro-batch's backward, the buckets of blocks 1-3 are already being reduced; at the
    end of the first micro-batch's backward, and in accumulating batches, nothing is."""
    case = _case("bert_1x2_overlap")
    for rank in _ranks(two_processes, case, 2):
        seen = rank["launched"]
        per_step = 2 * case["accumulate"]  # two micro-batches per batch
        assert len(seen) == per_step * case["steps"]
        for step in range(case["steps"]):
            firings = seen[step * per_step : (step + 1) * per_step]
            assert all(s == step for s, _ in firings)
            started = [blocks for _, blocks in firings]
            assert all(blocks == [] for blocks in started[:-1]), started
            if step == 0:
                assert started[-1] == []  # the first synchronised step finds who produces what
            else:
                assert {1, 2, 3} <= set(started[-1]), started


def test_weights_outside_the_blocks_are_reduced_only_where_they_are_trained(two_processes, four_processes):
    for rank in _ranks(two_processes, _case("bert_2x1_hooks"), 2):  # 2x1: nothing to reduce at all
        producers = rank["grad_sync"]["producers"]
        assert producers["model.bert.embeddings.word_embeddings.weight"] == [0]
        assert producers["model.classifier.weight"] == [1]
        assert rank["grad_sync"]["buckets"] == rank["grad_sync"]["late_buckets"] == 0
    # 4x1 GPT-2: the tied embedding is reduced over stages 0 and 3 (global ranks 3 and 0), after the schedule.
    for r, rank in enumerate(_ranks(four_processes, _case("gpt2_4x1_tied"), 4)):
        found = rank["grad_sync"]
        assert found["producers"]["model.transformer.wte.weight"] == [0, 3]
        assert found["producers"]["model.transformer.wpe.weight"] == [0]
        assert found["producers"]["model.transformer.ln_f.weight"] == [3]
        assert found["late_buckets"] == (1 if r in (0, 3) else 0) and found["buckets"] == 0


@pytest.mark.parametrize(
    ("case", "message"),
    [
        (ERROR_CASES[0], ".grad was not zeroed as Lightning zeroes it"),
        (ERROR_CASES[1], "got a gradient on stage 0, which produced none for it in the first step"),
    ],
    ids=lambda c: c["name"] if isinstance(c, dict) else "",
)
def test_what_the_overlapped_sync_cannot_do_is_refused_clearly(case, message, tmp_path):
    output = run_workers("grads_worker.py", 2, str(tmp_path), json.dumps(case), expect_failure=True, timeout=300)
    assert message in output, output[-3000:]


def test_buckets_follow_the_given_order_and_caps():
    from lightning_pipetx.strategy.grad_buckets import make_buckets

    params = [torch.nn.Parameter(torch.zeros(n)) for n in (10, 10, 10, 40, 10, 10)]  # float32: 40, 160 bytes
    params.insert(2, torch.nn.Parameter(torch.zeros(5, dtype=torch.float64)))
    buckets = make_buckets(params, None, 2, cap_bytes=100, first_cap_bytes=50)
    # float32: the first bucket holds up to 50 bytes, the others up to 100, a larger parameter
    # sits alone; float64 has buckets of its own. Buckets start in the order of their first parameter.
    position = {id(p): i for i, p in enumerate(params)}
    assert [[position[id(p)] for p in b.params] for b in buckets] == [[0], [1, 3], [2], [4], [5, 6]]
    bucket = buckets[1]
    bucket.reset()
    bucket.fill(0, torch.full((10,), 4.0), torch.full((10,), 2.0))  # (grad + earlier) / divisor
    bucket.fill(1, None)  # no gradient here
    assert bucket.buffer[:10].tolist() == [3.0] * 10 and bucket.flags().tolist() == [1.0, 0.0]
    with pytest.raises(RuntimeError, match="twice in the last backward"):
        bucket.fill(0, torch.ones(10))
    bucket.install([1.0, 0.0])
    assert params[1].grad.tolist() == [3.0] * 10 and params[3].grad is None


def test_synchronised_steps_take_turns_with_two_buffers():
    """A step's gradients survive the next step's reduction, and no step after the second allocates."""
    from lightning_pipetx.strategy.grad_buckets import Bucket

    params = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2))]
    bucket = Bucket(params, None, divisor=1)
    storages = []
    for step in range(4):
        bucket.reset()
        storages.append(bucket.buffer.data_ptr())
        bucket.fill(0, torch.full((3,), float(step)))
        bucket.fill(1, None)  # a stale slice of the reused buffer must not leak into the flags or the values
        assert bucket.buffer[3:5].tolist() == [0.0, 0.0] and bucket.flags().tolist() == [1.0, 0.0]
        previous = params[0].grad
        bucket.install([1.0, 0.0])
        if previous is not None:
            assert previous.tolist() == [step - 1.0] * 3
        assert params[0].grad.tolist() == [float(step)] * 3 and params[1].grad is None
    assert storages[0] != storages[1] and storages[2] == storages[0] and storages[3] == storages[1]
