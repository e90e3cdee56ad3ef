"""rapydli.parallel: splitting training across ranks beyond data parallelism.

``layout`` owns a run's degrees (data x pipeline x tensor, ZeRO stage): it validates them
against the ranks that run, and hands the Trainer its part of the model and its gradient
strategy (``gradients``: nothing, a synchronizer, or ZeRO's sharded optimizer).
``grid`` splits the ranks into data-parallel replicas x pipeline stages x tensor-parallel
ranks, ``split`` cuts a model into stages at module boundaries, ``schedules`` holds GPipe
and 1F1B as per-stage action lists, ``executor`` runs one stage's list with non-blocking
MPI point-to-point, and ``timeline`` records and draws what ran. ``training`` is what the
:class:`~rapydli.trainer.loop.Trainer` calls for a pipelined config. ``tensor`` splits
linear layers (and attention heads) across a tensor-parallel group, ``clip`` clips by the
global norm of a model spread over stages and shards; ``zero`` shards the optimizer state
over the data-parallel group, and ``memory`` counts what a rank holds.
"""
