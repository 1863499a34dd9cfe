"""Model parallelism on torch.distributed: one model replica over several ranks (docs/parallel.md).

- `shard.py`: what a rank holds (the slicing rules of tensor and expert parallelism, written once);
- `comm.py`: the collectives the forward makes (`Parallel`: all-reduce, vocabulary gather, split embedding);
- `replica.py`: the first rank's side: it starts the other ranks, broadcasts the calls, watches them;
- `mirror.py`: rank 0's model handle (`MirroredModel`): each forward call sent to the other ranks, then made;
- `rank.py`: the other ranks' loop: load their shard, build their KV pools, run every forward they are sent.
"""
