"""Generates docs/configuration.md from the config dataclasses (`make docs`; a test checks it)."""

from __future__ import annotations

import sys

from ravnest_node import settings
from ravnest_node.bench.config import BenchConfig
from ravnest_node.daemon.config import NodeConfig
from ravnest_node.launch.demo import DemoConfig

HEADER = """\
# Configuration reference

Generated from the config dataclasses by `make docs`; do not edit by hand.

Every setting can be given three ways, which all fill the same field: a command-line flag, a
`RAVNEST_*` environment variable, or a key in a TOML file passed with `--config FILE` (top-level
keys at the top, the others in their `[train]` / `[transport]` table). Flags win over the
environment, which wins over the file, which wins over the defaults. In text and TOML, `none`
means "not set" for optional settings. A wrong value anywhere is a one-line error and exit
status 2.

Example `node.toml` for a coordinator that waits for three nodes:

```toml
listen = "0.0.0.0:7070"
advertise = "192.168.1.10:7070"
state_dir = "/var/lib/ravnest-node"
swarm_size = 3

[train]
model = "bench-small"
steps = 500
codec = "none"
```
"""


def render() -> str:
    return (
        HEADER
        + "\n## `ravnest-node start`\n\n"
        + settings.reference_markdown(NodeConfig)
        + "\n\n## `ravnest-node demo`\n\n"
        + settings.reference_markdown(DemoConfig)
        + "\n\n## `ravnest-node bench`\n\n"
        + settings.reference_markdown(BenchConfig)
        + "\n"
    )


if __name__ == "__main__":
    sys.stdout.write(render())
