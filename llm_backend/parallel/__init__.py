"""Model parallelism on torch.distributed: one model replica over several ranks (docs/parallel.md).

- `shard.py`: what a rank holds (the slicing rules of tensor and expert parallelism, written once);
- `comm.py`: the collectives the forward makes (`Parallel`: all-reduce, vocabulary gather, split embedding);
- `replica.py`: the first rank's side: it starts the other ranks, sends each step's inputs, watches them;
- `rank.py`: the other ranks' loop: load their shard, build their KV pools, run every forward they are sent.
"""
