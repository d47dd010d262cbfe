"""``psbench``: the parameter server measured against its limits, in one run on loopback.

Baselines (raw TCP, bare gRPC streaming and echo, local training) are measured in the same run
as the figures they judge: PS push + pull goodput by model size and shard count, small-call
latency, training throughput of 2 shards x 2 async workers, a shard's peak memory, and the
cost of mutual TLS on goodput and training (TLS and plaintext alternated in the same run). See
docs/benchmarks.md for the method and the latest numbers::

    psbench --out bench.json          # full run, several minutes
    psbench --quick                   # every section on tiny sizes, seconds
    psbench --only goodput --sizes 64 # one section while iterating on the transport
"""

__all__: list[str] = []
