"""A training job for the resume tests, run as its own process: ``python -m tests.client.resume_job``.

It trains a model with dropout on a shuffled torchdata ``StatefulDataLoader`` over random data,
with a random augmentation that draws from NumPy's and Python's global generators too, and
prints the loss of every step as ``float.hex`` (exact). Modes:

- ``straight END``: steps 0..END in one go;
- ``first STOP RUN``: steps 0..STOP, then ``client.save(RUN, model, optim, ...)`` mid-epoch,
  with no ``extra``;
- ``second END RUN``: a fresh job (other seeds, other initial weights) that resumes the latest
  version of RUN with ``client.load`` and runs the steps after it up to END.

``--plain`` saves with ``rng=False`` and no data loader, and loads without either: what a save
recorded before versions carried the generators and the loader. The store is the one
``CKPTSTORE_URL`` / ``CKPTSTORE_HOME`` name.
"""

from __future__ import annotations

import argparse
import json
import random
import warnings

import numpy as np
import torch
from torch import nn
from torchdata.stateful_dataloader import StatefulDataLoader

from ckptstore import client

#: 48 samples in batches of 4: 12 steps an epoch, so step 20 is in the middle of the second.
SAMPLES, BATCH = 48, 4


def build(seed: int) -> tuple[nn.Module, torch.optim.Optimizer, StatefulDataLoader]:
    """The model, its optimizer and the data loader, with every global generator seeded by ``seed``
    (the data itself is the same whatever the seed)."""
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)
    data = torch.Generator().manual_seed(7)
    inputs = torch.randn(SAMPLES, 6, generator=data)
    targets = torch.randn(SAMPLES, 1, generator=data)
    model = nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 1))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = StatefulDataLoader(torch.utils.data.TensorDataset(inputs, targets), batch_size=BATCH, shuffle=True)
    return model, optim, loader


def train(
    model: nn.Module, optim: torch.optim.Optimizer, loader: StatefulDataLoader, first: int, end: int
) -> list[str]:
    """Steps ``first``..``end``, epoch after epoch from wherever the loader stands; each loss as hex."""
    losses: list[str] = []
    step = first
    model.train()
    while step < end:
        for inputs, targets in loader:
            # A random augmentation from NumPy's and Python's global generators.
            noise = torch.from_numpy(np.random.normal(0.0, 0.1, size=tuple(inputs.shape)).astype(np.float32))
            scale = random.uniform(0.9, 1.1)
            loss = nn.functional.mse_loss(model(inputs * scale + noise), targets)
            optim.zero_grad()
            loss.backward()
            optim.step()
            losses.append(float(loss.item()).hex())
            step += 1
            if step == end:
                break
    return losses


def main() -> None:
    """Run the mode the command line names and print its losses as JSON."""
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["straight", "first", "second"])
    parser.add_argument("steps", type=int)
    parser.add_argument("run", nargs="?", default="resume-job")
    parser.add_argument("--plain", action="store_true")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message=".*set_vital.*")  # torchdata's own deprecation notice
    if args.mode == "second":
        model, optim, loader = build(seed=1234)
        resumed = client.default_client().versions(args.run)[-1].step
        if args.plain:
            loaded = client.load(args.run, model=model, optim=optim, rng=False)
        else:
            loaded = client.load(args.run, model=model, optim=optim, dataloader=loader)
        assert loaded.step == resumed and loaded.extra is None
        losses = train(model, optim, loader, resumed or 0, args.steps)
    else:
        model, optim, loader = build(seed=0)
        stop = args.steps
        losses = train(model, optim, loader, 0, stop)
        if args.mode == "first":
            if args.plain:
                client.save(args.run, model, optim, step=stop, rng=False)
            else:
                client.save(args.run, model, optim, step=stop, dataloader=loader)
    print(json.dumps(losses))


if __name__ == "__main__":
    main()
