"""Starting and watching node processes, for `ravnest-node demo` and the benchmarks alike: the
local-swarm launcher (demo.py), the progress line (progress.py) and the stop signals with their
watchdog (signals.py). Below both `cli` and `bench`, above the daemon it starts as processes."""
