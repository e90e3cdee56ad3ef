"""The data loader kinds by name (light: naming one imports nothing heavy).

Third-party loaders register in the ``rapydli.loaders`` entry-point group (a builder
``f(dataset, **build_loader options) -> Loader``); ``TrainConfig.loader`` accepts every
registered name.
"""

from rapydli.registry import Registry

LOADERS = Registry(
    "loader kind",
    {"default": "rapydli.data.loaders:build_default", "clairvoyant": "rapydli.data.clairvoyant:build_clairvoyant"},
    group="rapydli.loaders",
)
