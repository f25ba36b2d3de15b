"""The split backward: the input half then the weight half give the fused backward's gradients."""

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_pipetx.strategy.split_backward import AVAILABLE, backward_input, cannot_split

pytestmark = pytest.mark.skipif(not AVAILABLE, reason="this torch lacks torch.distributed.pipelining._backward")


def _stage(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 8), nn.Linear(8, 1))


def _loss(stage, x, reentrant=None):
    h = x
    for layer in stage:
        h = checkpoint(layer, h, use_reentrant=reentrant) if reentrant is not None else layer(h)
    return (h**2).mean()


def test_the_two_halves_give_the_fused_gradients_and_run_the_accumulation_hooks():
    x = torch.randn(4, 8)
    fused, split = _stage(), _stage()
    for _ in range(2):  # a second micro-batch accumulates onto the first
        x_fused = x.clone().requires_grad_()
        _loss(fused, x_fused).backward()
    accumulated = []
    for p in split.parameters():
        p.register_post_accumulate_grad_hook(lambda p: accumulated.append(p))
    for _ in range(2):
        x_split = x.clone().requires_grad_()
        before = [None if p.grad is None else p.grad.clone() for p in split.parameters()]
        hooks_before = len(accumulated)
        work = backward_input([_loss(split, x_split)], None, [x_split], list(split.parameters()))
        # no weight gradient yet: .grad holds what the earlier micro-batches left, and no hook ran
        assert len(accumulated) == hooks_before
        for p, kept in zip(split.parameters(), before):
            assert (p.grad is None) if kept is None else torch.equal(p.grad, kept)
        torch.testing.assert_close(x_split.grad, x_fused.grad, rtol=0, atol=0)
        work.run()
    assert len(accumulated) == 2 * len(list(split.parameters()))
    for (name, a), b in zip(fused.named_parameters(), split.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=0, atol=0, msg=name)


def test_a_reentrant_checkpoint_refuses_the_input_half_and_the_refusal_is_recognised():
    stage, x = _stage(), torch.randn(4, 8, requires_grad=True)
    with pytest.raises(RuntimeError) as error:
        backward_input([_loss(stage, x, reentrant=True)], None, [x], list(stage.parameters()))
    assert cannot_split(error.value)
    assert all(p.grad is None for p in stage.parameters())  # nothing accumulated: a fused backward may follow


def test_a_compiled_backward_that_donates_its_buffers_refuses_the_input_half_and_the_refusal_is_recognised():
    # torch.compile compiles the backward at its first run: one compiled under a whole backward()
    # (an earlier micro-batch's) donates its buffers, and refuses the graph the input half retains.
    stage, x = _stage(), torch.randn(4, 8)
    compiled = torch.compile(stage, backend="aot_eager")
    (compiled(x.clone().requires_grad_()) ** 2).mean().backward()
    before = [p.grad.clone() for p in stage.parameters()]
    x_split = x.clone().requires_grad_()
    with pytest.raises(RuntimeError) as error:
        backward_input([(compiled(x_split) ** 2).mean()], None, [x_split], list(stage.parameters()))
    assert cannot_split(error.value)
    assert all(torch.equal(p.grad, kept) for p, kept in zip(stage.parameters(), before))  # a fused backward may follow


def test_a_weight_used_twice_gets_both_uses_gradients():
    torch.manual_seed(0)
    fused, split = nn.Linear(8, 8), nn.Linear(8, 8)
    split.load_state_dict(fused.state_dict())
    x = torch.randn(4, 8)
    x_fused, x_split = x.clone().requires_grad_(), x.clone().requires_grad_()
    fused(torch.tanh(fused(x_fused))).pow(2).mean().backward()
    loss = split(torch.tanh(split(x_split))).pow(2).mean()
    backward_input([loss], None, [x_split], list(split.parameters())).run()
    torch.testing.assert_close(x_split.grad, x_fused.grad, rtol=0, atol=0)
    for a, b in zip(fused.parameters(), split.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=0, atol=0)
