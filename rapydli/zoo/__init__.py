"""Reference models (:mod:`rapydli.zoo.models`) and data sets (:mod:`rapydli.zoo.datasets`).

Importable by name (``"rapydli.zoo.models:resnet_digits"``) so runs that use them can be
repeated; nothing is downloaded.
"""
