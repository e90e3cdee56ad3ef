"""The command line's groups list their commands in full: each one's first sentence, wrapped to the terminal.

click shortens a command's summary in ``--help`` to what fits one line, ending it in "...",
so at 80 columns "List, show, compare, tag, annotate, repeat and export recorded..." hid
what the command does. :class:`Group` gives the whole first sentence, wrapped under the
command's name to the terminal's width.
"""

from __future__ import annotations

import click

#: The longest summary a command list shows (wrapped): a first sentence, however long, is whole.
SUMMARY_CHARS = 400


class Group(click.Group):
    """A :class:`click.Group` whose command list shows each command's whole first sentence, wrapped."""

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = []
        for name in self.list_commands(ctx):
            command = self.get_command(ctx, name)
            if command is not None and not command.hidden:
                rows.append((name, command.get_short_help_str(SUMMARY_CHARS)))
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)
