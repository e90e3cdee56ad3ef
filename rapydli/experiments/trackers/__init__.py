"""Experiment trackers: RaPyDLI runs also logged to MLflow, TensorBoard and Weights & Biases.

One module per tracker (:mod:`.mlflow`, :mod:`.tensorboard`, :mod:`.wandb`) behind the
interface of :mod:`.base`, named in :data:`rapydli.registry.TRACKERS`. The client, never
a rank, logs: :mod:`.sync` reads a run from the run store and hands it to a tracker;
:mod:`.follow` does so live from a thread while the run trains; :mod:`.export` does it
once for recorded runs (``rapydli runs export --to``).
"""
