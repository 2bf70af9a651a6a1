"""The planner, pure: from members and what they measured to a plan (negotiate.py, placement.py,
planner.py), the plan's checks (static_plan.py), and what a swarm would do before it exists
(estimate.py, shapes.py: `ravnest-node plan`)."""
