"""A save's ``bytes_new`` and ``tensors_new`` are the figures its version's record keeps: what the
save added to the store, tensors no earlier version of any run referenced. A second run that
trains to the same states as a first one adds nothing, though its save sends the tensors that
changed since its last save (``bytes_sent``, nothing where the store answers that it holds
them): the store keeps one copy."""

from __future__ import annotations

import torch

from ckptstore import client


def _trained_pair() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 255), torch.nn.ReLU(), torch.nn.Linear(255, 3))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _step(model: torch.nn.Module, optim: torch.optim.Optimizer, step: int) -> None:
    inputs = torch.randn(8, 256, generator=torch.Generator().manual_seed(step))
    model(inputs).pow(2).mean().backward()
    optim.step()
    optim.zero_grad()


def test_a_saves_new_bytes_are_its_versions_across_runs_that_share_tensors(ckpt: client.Client) -> None:
    found: dict[str, list[tuple[int, int, int, int]]] = {}
    sent: dict[str, list[int]] = {}
    for run in ("first", "second"):  # the same training twice: the second run's tensors all exist
        model, optim = _trained_pair()
        for step in range(3):
            _step(model, optim, step)
            saved = ckpt.save(run, model, optim)
            record = ckpt.versions(run)[-1]
            assert record.version == saved.version
            found.setdefault(run, []).append((saved.bytes_new, record.bytes_new, saved.tensors_new, record.tensors_new))
            sent.setdefault(run, []).append(saved.bytes_sent)
    for run, figures in found.items():
        for saved_bytes, record_bytes, saved_tensors, record_tensors in figures:
            assert (saved_bytes, saved_tensors) == (record_bytes, record_tensors), (run, figures)
    assert all(new > 0 and tensors > 0 for new, _, tensors, _ in found["first"])
    assert [(new, tensors) for new, _, tensors, _ in found["second"]] == [(0, 0)] * 3
    # The first run sent what it added; the second sends at most that again (what changed in
    # place, unless the store says it holds those bytes already), kept once.
    assert sent["first"] == [new for new, _, _, _ in found["first"]]
    assert all(again <= first for again, first in zip(sent["second"], sent["first"], strict=True))
    listed = {run.run_id: run.bytes_new for run in ckpt.runs()}
    assert listed == {"first": sum(new for new, _, _, _ in found["first"]), "second": 0}
