"""Identical workers sharing one job's data: an ordinary DataLoader loop with psworker.ElasticSampler.

Start the shards, then as many copies of this script as you like, whenever you like: shard 0
leases each copy data tasks (slices of every epoch's seeded permutation), and together they train
every example of the job once, however many copies run and whenever they join or leave.

    .venv/bin/psserver --port 7000 &  .venv/bin/psserver --port 7001 &
    .venv/bin/python examples/elastic_sampler.py 127.0.0.1:7000,127.0.0.1:7001 &
    .venv/bin/python examples/elastic_sampler.py 127.0.0.1:7000,127.0.0.1:7001
"""

import sys

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import psworker

# Every copy builds the same data and the same model (the first to register initialises the job).
torch.manual_seed(0)
teacher = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4))  # labels to learn: 4 classes
with torch.no_grad():
    inputs = torch.randn(5120, 8)
    labels = teacher(inputs).argmax(dim=1)
train = TensorDataset(inputs[:4096], labels[:4096])
test_x, test_y = inputs[4096:], labels[4096:]

model = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 4))
optimizer = torch.optim.Adam(model.parameters(), lr=0.01)

session = psworker.connect(sys.argv[1])  # worker name: host-pid, so every copy has its own
model, optimizer = session.prepare(model, optimizer)
# The job, the same in every copy: 3 passes over the data in tasks of 256 examples, shared by
# whichever workers run. With DataLoader(num_workers=W), pass lag=W * prefetch_factor.
sampler = psworker.ElasticSampler(session, len(train), seed=0, task_size=256, epochs=3)
loader = DataLoader(train, batch_size=32, sampler=sampler)

examples = step = 0
while not sampler.finished:  # until the job's data is done, whoever trains it
    for x, y in loader:  # a pass ends early when the rest is held by others: then look again
        loss = nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()  # pushes; a task is reported once the step of its last batch is acknowledged
        examples += len(x)
        step += 1
        if step % 100 == 0:
            print(f"{session.worker_name} step {step} loss {loss.item():.4f}")

session.pull(wait=False)  # the job's final weights: every worker's steps are in
with torch.no_grad():
    accuracy = (model(test_x).argmax(dim=1) == test_y).float().mean().item()
session.close()  # reports the last task, hands back anything unfinished, leaves
print(f"{session.worker_name} trained {examples} examples in {sampler.feed.tasks} tasks "
      f"of the job's {sampler.feed.plan.total}")
print(f"{session.worker_name} final accuracy {accuracy:.4f}")
