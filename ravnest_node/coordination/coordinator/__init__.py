"""The coordinator service and its pure parts.

`CoordinatorService` (service.py) serves `ravnest.v1.Coordinator`: it validates each call,
hands it to the part that decides (member_calls.py, replan.py, recovery.py, reporting.py,
view.py) and maps a refusal to a gRPC status; it is the only place that aborts. What they
decide from: the roster (roster.py: members, leases, lost members), the plan book (planbook.py:
the plans and the run's phase), faults (faults.py: crashes, restores, a takeover), the run's
progress (progress.py) and the summary (summary.py), held together in swarm_state.py and kept
by a lab coordinator in SQLite (store.py).
"""

from ravnest_node.coordination.coordinator.service import CoordinatorService

__all__ = ["CoordinatorService"]
