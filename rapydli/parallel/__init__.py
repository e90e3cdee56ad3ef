"""rapydli.parallel: pipeline parallelism and its composition with data parallelism.

``grid`` splits the ranks into pipelines x data-parallel groups, ``split`` cuts a model
into stages at module boundaries, ``schedules`` holds GPipe and 1F1B as per-stage action
lists, ``executor`` runs one stage's list with non-blocking MPI point-to-point, and
``timeline`` records and draws what ran. ``training`` is what the
:class:`~rapydli.train.trainer.Trainer` calls for a pipelined config.
"""
