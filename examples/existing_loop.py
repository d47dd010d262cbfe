"""An ordinary PyTorch training loop, moved onto the parameter server by three changed lines.

    .venv/bin/psserver --port 7000 &  .venv/bin/psserver --port 7001 &
    .venv/bin/python examples/existing_loop.py 127.0.0.1:7000,127.0.0.1:7001
"""

import sys

import torch
from torch import nn

import psworker  # changed line 1 of 3: the import

torch.manual_seed(0)
x = torch.randn(2048, 8)
y = x @ torch.arange(1.0, 9.0).unsqueeze(1) + 0.5
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
optimizer = torch.optim.Adam(model.parameters(), lr=0.05)

session = psworker.connect(sys.argv[1], worker_name="example")  # changed line 2: connect
model, optimizer = session.prepare(model, optimizer)  # changed line 3: same model, PS optimizer

for step in range(300):
    batch = torch.randint(0, len(x), (64,))
    loss = nn.functional.mse_loss(model(x[batch]), y[batch])
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()  # pushes the gradients; the shards apply Adam; the new weights are pulled
    if step % 100 == 0:
        print(f"step {step} loss {loss.item():.4f}")

final = nn.functional.mse_loss(model(x), y).item()
print(f"final loss {final:.4f}")
session.close()
