"""The run config's schema: every key of every section, with its type,
default, range or choices, one line of documentation, and whether a resumed
run may change it (``schema``), and the loss settings refused together
(``combinations``). Pure Python, imported by every column.

May import: nothing.
"""
