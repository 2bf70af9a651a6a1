"""A node's worker role: join the coordinator, take a stage from each plan, train it.

`Worker` (worker.py) is the plan loop and what the daemon uses; its parts, one concern each:
the coordinator client (coordinator_client.py), link measurements (links.py), the server half
of boundary streams and probe admission (sessions.py), one stage of one plan (training.py),
blocks handed between plans (handover.py), checkpoints and their copies (checkpoints.py,
checkpoint_copies.py), what the node measures of itself (capabilities.py), and what the parts
wait on and the tasks they own (changes.py, tasks.py).
"""

from ravnest_node.daemon.worker.worker import Worker

__all__ = ["Worker"]
