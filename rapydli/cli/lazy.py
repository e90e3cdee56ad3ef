"""A click group whose subcommands are imported only when invoked.

Each command lives in the module that owns its feature; the group knows it only by an
import path, so ``rapydli --help`` stays fast and a benchmark's heavy imports load only
when that benchmark runs.
"""

from __future__ import annotations

from importlib import import_module

import click

from rapydli.cli.group import Group


class LazyGroup(Group):
    """A :class:`click.Group` with ``lazy={"name": "package.module:attribute"}``."""

    def __init__(self, *args, lazy: dict[str, str] | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.lazy = dict(lazy or {})

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(set(super().list_commands(ctx)) | set(self.lazy))

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in self.lazy:
            module_name, attribute = self.lazy[cmd_name].split(":")
            return getattr(import_module(module_name), attribute)
        return super().get_command(ctx, cmd_name)
