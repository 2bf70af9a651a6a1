"""Every error ravnest-node raises on purpose, in one tree.

```
RavnestError
├── ConfigError          a setting (flag, environment, config file) is wrong (exit status 2)
├── StartupError         the node cannot start as configured, e.g. port in use (exit 2)
├── FrameError           a tensor frame from a peer is malformed or does not fit the plan
│                        (the stream is refused with a gRPC status; nothing changes)
├── PeerError            a peer misbehaved or went away
│   ├── PeerUnavailable  a peer could not be reached, or its stream broke
│   └── PeerRefused      a peer answered with an error status
│       └── Unreachable  the coordinator cannot open a connection to this node (behind NAT)
└── RunFailed            the training run stopped because of a fault (the message says which node)
```

Peer faults are recorded and handled by the caller; a bug of our own is not caught here and
crashes loudly.
"""

from __future__ import annotations


class RavnestError(Exception):
    """Base of every error raised on purpose by ravnest-node."""


class ConfigError(RavnestError, ValueError):
    """A setting is invalid; the message says what is wrong and what would be right."""


class StartupError(RavnestError):
    """The node cannot start as configured (for example its port is already in use)."""


class FrameError(RavnestError, ValueError):
    """A frame from the network is malformed or does not match what the plan expects."""


class PeerError(RavnestError):
    """A peer misbehaved or went away."""


class PeerUnavailable(PeerError):
    """A peer could not be reached, or its stream broke."""


class PeerRefused(PeerError):
    """A peer answered with an error status."""


class Unreachable(PeerRefused):
    """The coordinator refused this node's Join: it cannot open a connection to the node at
    its address (behind NAT, or a firewall); the node may go through a relay instead."""


class RunFailed(RavnestError):
    """The training run cannot continue."""


class Banned(RunFailed):
    """The coordinator banned this node for failing audits (coordinator/bans.py): it stops, with
    exit status EXIT_BANNED."""


EXIT_BANNED = 3
"""The exit status of a node the coordinator banned (`Banned`)."""
