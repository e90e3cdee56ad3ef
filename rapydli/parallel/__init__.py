"""rapydli.parallel: splitting a model across ranks.

``tensor`` splits linear layers (and attention heads) across a tensor-parallel group.
"""
