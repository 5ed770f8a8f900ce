"""`popbert.lowering.embedding`: a large CPU table's gradient is accumulated from the rows a batch
used, and `.grad` is the dense gradient `F.embedding` gives, whatever the layout around it.

The reference is `F.embedding`'s dense backward on the same indices and upstream gradients. The
sums are the same; only the order in which repeated rows are added differs (the dense path adds
each backward's rows into a fresh zero table, then that table into `.grad`), so they agree to a
few FP32 ulps: 1e-6 of the largest gradient.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import popbert.lowering.embedding as embedding_module
from popbert.lowering.embedding import SPARSE_MIN_ROWS, embedding
from popbert.optimizers import AdamW

ROWS, WIDTH = SPARSE_MIN_ROWS + 3, 8


def passes(seed: int = 0, count: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(indices, upstream gradient) per backward pass; repeated rows within and across passes."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for n in range(count):
        ids = torch.randint(0, 50, (4, 5 + n), generator=gen)  # few rows: many repeats
        ids[0, 0] = ROWS - 1
        out.append((ids, torch.randn(*ids.shape, WIDTH, generator=gen)))
    return out


def grads(lookup, table: torch.Tensor, feeds) -> list[torch.Tensor]:
    """``table.grad`` after each backward pass (accumulating, as micro-batch groups do)."""
    seen = []
    for ids, upstream in feeds:
        (lookup(ids, table) * upstream).sum().backward()
        seen.append(table.grad.clone())
    return seen


def fresh_table() -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.randn(ROWS, WIDTH, generator=torch.Generator().manual_seed(1)))


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return float((a - b).abs().max()) <= 1e-6 * float(b.abs().max())


def test_accumulated_gradients_equal_the_dense_ones_and_stay_dense() -> None:
    feeds = passes()
    dense = grads(F.embedding, fresh_table(), feeds)
    table = fresh_table()
    ours = grads(embedding, table, feeds)
    for got, expected in zip(ours, dense, strict=True):
        assert got.layout == torch.strided and got.shape == (ROWS, WIDTH)
        assert close(got, expected)
    assert table.grad.layout == torch.strided
    assert int((ours[-1] != 0).any(dim=1).sum()) < 60  # only the used rows moved


def test_the_backward_is_sparse_only_for_large_cpu_tables(monkeypatch) -> None:
    """What takes the row path: the gradient the table receives from autograd is sparse exactly
    when the table is large, on CPU, a leaf, outside torch.compile and not switched off."""
    layouts = []

    def layout_of(table: torch.Tensor) -> torch.layout:
        seen = []
        table.register_hook(lambda g: seen.append(g.layout))
        ids, upstream = passes(count=1)[0]
        (embedding(ids % table.shape[0], table) * upstream).sum().backward()
        return seen[0]

    layouts.append(layout_of(fresh_table()))
    small = torch.nn.Parameter(torch.randn(SPARSE_MIN_ROWS - 1, WIDTH))
    layouts.append(layout_of(small))
    monkeypatch.setattr(embedding_module, "SPARSE", False)
    layouts.append(layout_of(fresh_table()))
    assert layouts == [torch.sparse_coo, torch.strided, torch.strided]


def test_an_existing_dense_gradient_is_added_to_in_place() -> None:
    """Replicas point `.grad` at a slice of one flat buffer: the rows go into that slice."""
    feeds = passes()
    expected = grads(F.embedding, fresh_table(), feeds)[-1]
    table = fresh_table()
    flat = torch.zeros(ROWS * WIDTH + 5)
    table.grad = flat[5:].view(ROWS, WIDTH)
    grads(embedding, table, feeds)
    assert table.grad.data_ptr() == flat[5:].data_ptr()
    assert close(flat[5:].view(ROWS, WIDTH), expected)


def test_a_tied_table_sums_its_lookup_and_its_projection() -> None:
    """The MLM decoder reuses the word embedding as a projection: its dense gradient and the
    lookup's rows meet in one backward pass."""
    ids, upstream = passes(count=1)[0]
    hidden = torch.randn(3, WIDTH)

    def run(lookup) -> torch.Tensor:
        table = fresh_table()
        loss = (lookup(ids, table) * upstream).sum() + (hidden @ table.t()).square().mean()
        loss.backward()
        return table.grad

    assert close(run(embedding), run(F.embedding))


def test_an_optimizer_steps_on_the_accumulated_gradient() -> None:
    def train(lookup) -> torch.Tensor:
        table = fresh_table()
        optimizer = AdamW([{"params": [table], "weight_decay": 0.01}], lr=1e-2)
        for _ in range(2):
            grads(lookup, table, passes())
            optimizer.step()
            table.grad = None
        return table.detach()

    assert close(train(embedding), train(F.embedding))


def test_a_compiled_lookup_keeps_dense_gradients() -> None:
    feeds = passes(count=1)
    expected = grads(F.embedding, fresh_table(), feeds)[-1]
    table = fresh_table()
    compiled = torch.compile(embedding, backend="aot_eager", fullgraph=True)
    got = grads(compiled, table, feeds)[-1]
    assert got.layout == torch.strided and close(got, expected)


@pytest.mark.parametrize("requires_grad", [True, False])
def test_without_gradients_it_is_a_plain_lookup(requires_grad: bool) -> None:
    table = fresh_table().requires_grad_(requires_grad)
    ids = passes(count=1)[0][0]
    with torch.no_grad():
        assert torch.equal(embedding(ids, table), table[ids])
