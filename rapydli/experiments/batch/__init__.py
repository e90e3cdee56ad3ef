"""Batches of notebooks run headless through papermill: the spec, the plan, items, places, reports, the Jupyter kernels they run on."""
