"""Tensor and expert parallelism over torch.distributed (NCCL on GPU, gloo on CPU).

`state` holds the process group and this rank's place in it, `layers` the collective-wrapping
modules, `shard` the in-place slicing of a loaded model, `driver` rank 0's engine (it schedules
and tells the workers what to run), `worker` the other ranks' loop, `launch` process start-up
(spawned workers on one node, or torchrun / several nodes). docs/parallel.md has the layouts.
"""
