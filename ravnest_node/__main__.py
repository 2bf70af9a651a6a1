"""`python -m ravnest_node` is the `ravnest-node` command."""

import sys

from ravnest_node.cli.main import main

sys.exit(main())
