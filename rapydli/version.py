"""The package's version, said once: ``pyproject.toml`` reads it from here (``[tool.hatch.version]``),
the package root, the CLI, the lab server's handlers, benchmark reports and every run's provenance import it."""

__version__ = "0.1.0"
