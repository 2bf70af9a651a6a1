"""`python -m ravnest_node` is the `ravnest-node` command."""

from ravnest_node.cli.main import entry_point

entry_point()
