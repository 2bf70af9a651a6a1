"""The `ravnest-node` command: argument parsing, config files, exit statuses.

Exit status: 0 after a normal end or a stop by SIGINT/SIGTERM; 1 when a training run failed;
2 for a usage or configuration error (one line on standard error), as argparse does; 3 for a
node the coordinator banned for failing audits (errors.EXIT_BANNED).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import logging
import os
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from ravnest_node import settings
from ravnest_node.bench.codecs import run_codec_bench
from ravnest_node.bench.config import BenchConfig
from ravnest_node.bench.flaps import run_flaps_bench
from ravnest_node.bench.planner import run_planner_bench
from ravnest_node.bench.replan import run_replan_bench
from ravnest_node.bench.replicas import run_replicas_bench
from ravnest_node.bench.runner import run_bench
from ravnest_node.bench.suite import Suite
from ravnest_node.cli import plan as plan_command
from ravnest_node.cli.export import add_export_parser, run_export
from ravnest_node.cli.models import add_models_parser, run_models
from ravnest_node.cli.status import run_status, run_swarm_status, watch
from ravnest_node.cli.swarm import (
    add_init_swarm_parser,
    add_revoke_parser,
    run_init_swarm,
    run_revoke,
)
from ravnest_node.daemon.config import NodeConfig
from ravnest_node.daemon.node import NodeDaemon, NodeInfo
from ravnest_node.errors import EXIT_BANNED, Banned, ConfigError, RunFailed, StartupError
from ravnest_node.launch.demo import DemoConfig, run_demo
from ravnest_node.launch.signals import STOP_DEADLINE_S, ignore_stop_signals, install_stop_handlers
from ravnest_node.logs import JsonLines, setup_logging
from ravnest_node.models import MODEL_PRESETS
from ravnest_node.transport.options import TransportConfig
from ravnest_node.version import __version__

PROG = "ravnest-node"

DESCRIPTION = """\
ravnest-node turns several ordinary machines into one training swarm for a model that none of
them could train alone. Each machine runs one node; the model is cut into stages, one per node;
activations stream forward and gradients back between neighbouring stages over gRPC.

Start here:
  ravnest-node demo                       a local 3-node swarm trains the default model
  ravnest-node start --swarm-size 3       a coordinator node that waits for 2 more nodes
  ravnest-node start --join HOST:PORT     a node that joins that coordinator
  ravnest-node start --peer HOST:PORT     a node that finds the coordinator through any node
  ravnest-node coordinator --state-dir D  a lab coordinator (no stage); survives restarts
  ravnest-node status HOST:PORT           what a running node says about itself

On a LAN nobody types addresses: start the coordinator with `--mdns --swarm-size 3` and the
other nodes with `--mdns --join auto` (the same --swarm-name on each keeps swarms apart).

Every flag can also be set in a TOML file (--config) or as a RAVNEST_* environment variable,
e.g. --steps is `steps` under [train] and RAVNEST_TRAIN_STEPS; flags win over the environment,
which wins over the file.
"""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    # The built-in names only: listing the installed ones would look for entry points at every
    # start of a node (`ravnest-node models` lists them).
    models = f"{', '.join(sorted(MODEL_PRESETS))}, those of installed packages (`models`)"
    _add_start_parser(commands, models)
    _add_coordinator_parser(commands)
    _add_status_parser(commands)
    add_init_swarm_parser(commands)
    add_revoke_parser(commands)
    add_export_parser(commands)
    add_models_parser(commands)
    _add_demo_parser(commands, models)
    _add_bench_parser(commands)
    _add_plan_parser(commands)
    return parser


def _add_start_parser(commands: Any, models: str) -> None:
    """Register `start` on `commands` (argparse sub-parsers); `models`: the registered names."""
    start = commands.add_parser(
        "start",
        help="run one node daemon",
        description="Run one node daemon until SIGINT/SIGTERM. Without --join or --peer it is "
        "also the coordinator: it waits for --swarm-size nodes (itself included), hands out the "
        f"plan and the training run (models: {models}). With --join auto or --peer it finds the "
        "coordinator over mDNS (--mdns) or through the bootstrap peers. It prints one JSON line "
        "when ready.",
    )
    start.add_argument("--config", type=Path, help="TOML file with settings (see docs)")
    settings.add_arguments(start, NodeConfig)


def _add_coordinator_parser(commands: Any) -> None:
    """Register `coordinator` on `commands` (argparse sub-parsers)."""
    coordinator = commands.add_parser(
        "coordinator",
        help="run a lab coordinator that holds no stage and keeps its state in SQLite",
        description="Run a coordinator only: it holds no stage, waits for --swarm-size worker "
        "nodes (`ravnest-node start --join HOST:PORT`), hands out the plan and collects "
        "progress. Membership, the plan and progress live in --state-dir/coordinator.sqlite3: "
        "restarted with the same settings, it carries on where it was and the nodes, which "
        "train on meanwhile, reattach. It prints one JSON line when ready.",
    )
    coordinator.add_argument("--config", type=Path, help="TOML file with settings (see docs)")
    settings.add_arguments(coordinator, NodeConfig)


def _add_status_parser(commands: Any) -> None:
    """Register `status` on `commands` (argparse sub-parsers)."""
    status = commands.add_parser(
        "status",
        help="show what a running node, or a whole swarm, says about itself",
        description="Ask a node (Node.Status) for its role, swarm, the coordinator it follows "
        "and how it found it (--join, mDNS or a bootstrap peer), its stage and counters; or, "
        "with --swarm NAME, find that swarm's coordinator (mDNS and --peer) and show every "
        "member, the plan, who owns which blocks, who answers, and samples/s.",
    )
    status.add_argument("address", metavar="HOST:PORT", nargs="?", help="the node's gRPC address")
    status.add_argument("--swarm", metavar="NAME", help="show this swarm instead of one node")
    status.add_argument(
        "--peer",
        action="append",
        default=[],
        metavar="HOST:PORT",
        help="with --swarm: a node of the swarm to ask (repeatable; mDNS is used as well)",
    )
    status.add_argument(
        "--mdns-interface", metavar="IP", help="with --swarm: the interface for mDNS"
    )
    status.add_argument(
        "--swarm-dir",
        type=Path,
        metavar="DIR",
        help="a protected swarm's credentials (init-swarm); --swarm defaults to its name",
    )
    status.add_argument(
        "--token", help="the same credentials as one line (or RAVNEST_TRANSPORT_TOKEN)"
    )
    status.add_argument("--json", action="store_true", help="print one JSON object")
    status.add_argument(
        "--watch",
        action="store_true",
        help="show it again every --every seconds until Ctrl-C, redrawn in place on a terminal",
    )
    status.add_argument(
        "--every",
        type=float,
        default=2.0,
        metavar="SECONDS",
        help="with --watch: seconds between two views (default: 2)",
    )
    status.add_argument(
        "--timeout-s", type=float, default=10.0, help="seconds to wait for an answer (default: 10)"
    )


def _add_demo_parser(commands: Any, models: str) -> None:
    """Register `demo` on `commands` (argparse sub-parsers); `models`: the registered names."""
    demo = commands.add_parser(
        "demo",
        help="train the default model on a local swarm of node processes",
        description="Start --nodes node processes on 127.0.0.1, train, print progress and a "
        f"summary, stop them all. Models: {models}.",
    )
    demo.add_argument("--config", type=Path, help="TOML file with settings (see docs)")
    settings.add_arguments(demo, DemoConfig)


def _add_bench_parser(commands: Any) -> None:
    """Register `bench` on `commands` (argparse sub-parsers)."""
    bench = commands.add_parser(
        "bench",
        help="measure ravnest-node against the alternatives on emulated home links",
        description="Run each system (compute-bound, naive, ours, torch-pipelining, hivemind) "
        "on the same model, data and samples over an emulated link, write one JSON line per "
        "run to --jsonl, and a markdown table (.md) and plot (.png) beside it. As root, nodes "
        "run in network namespaces with tbf-capped links; otherwise loopback relays shape them.",
    )
    bench.add_argument(
        "suite",
        nargs="?",
        choices=["links", "codecs", "replicas", "planner", "replan", "flaps"],
        default="links",
        help="links (default): the systems over emulated links; codecs: bits, speed and "
        "convergence of every codec; replicas: two pipelines that average against one; "
        "planner: solve times and placements against the static plan; replan: a fourth node "
        "joins a running swarm; flaps: links that drop or lose packets mid-run (root, "
        "namespaces, iptables; --model small for 600 steps, 200 with --quick, unless given)",
    )
    bench.add_argument(
        "--only",
        default="",
        help="bench flaps only: comma-separated scenarios to run, of clean, flap3, flap10, "
        "flap60, flap300, loss5, coord10 (default: all; --quick leaves out flap300)",
    )
    bench.add_argument("--config", type=Path, help="TOML file with settings (see docs)")
    settings.add_arguments(bench, BenchConfig)


def _add_plan_parser(commands: Any) -> None:
    """Register `plan` on `commands` (argparse sub-parsers)."""
    plan = commands.add_parser(
        "plan",
        help="predict a swarm: stages, memory per node, bytes per link, samples/s",
        description="Plan a model (llama-8b, llama-70b, a llama shape, or a preset) on nodes "
        "(16x24gb, 16xrtx4090, 8x24gb,8x12gb) over a link (1gbit, 50mbit,20ms) without "
        "starting anything: the stage plan, memory per node, bytes per step per link for each "
        "codec, and the predicted samples/s with its bottleneck. Exit status 1 if nothing fits.",
    )
    plan_command.add_arguments(plan)


def _fail(message: str) -> int:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return 2


def _start(cfg: NodeConfig) -> int:
    formatter = setup_logging(cfg.logs.log_level, cfg.logs.log_format)

    def announce(info: NodeInfo) -> None:
        event = {"event": "ready", "node_id": info.node_id, "address": info.address,
                 "pid": info.pid, "coordinator": info.coordinator,
                 "metrics": info.metrics}  # fmt: skip
        print(json.dumps(event), flush=True)

    async def main() -> None:
        daemon = NodeDaemon(cfg)
        if isinstance(formatter, JsonLines):
            formatter.node_id = daemon.node_id
        # A worker's stop may first hand its blocks over: allow for it before the watchdog.
        deadline_s = STOP_DEADLINE_S + (
            0 if cfg.discovery.is_coordinator else cfg.membership.leave_timeout_s
        )
        deadline = install_stop_handlers(
            asyncio.get_running_loop(), daemon.stop, deadline_s=deadline_s
        )

        async def deadline_of_own_stop() -> None:
            error = await daemon.stopping()
            if error is not None:  # a stop of its own has the deadline a signal's has
                deadline.start(EXIT_BANNED if isinstance(error, Banned) else 1)

        watch = asyncio.create_task(deadline_of_own_stop())
        try:
            await daemon.run(announce)
        finally:
            watch.cancel()

    try:
        asyncio.run(main())
    except StartupError as exc:
        return _fail(str(exc))
    except Banned as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return EXIT_BANNED
    except RunFailed as exc:
        print(f"{PROG}: training failed: {exc}", file=sys.stderr)
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; returns the exit status."""
    args = _parser().parse_args(argv)
    try:
        return _run(args)
    finally:
        ignore_stop_signals()


def entry_point() -> NoReturn:
    """The `ravnest-node` console script (and `python -m ravnest_node`): `main()`, then the
    process ends at once. Everything it wrote is closed by then (checkpoints are fsynced and
    renamed, the log is flushed here), so the interpreter's teardown would only free memory:
    with torch loaded that takes about a second on an idle machine and several under load,
    which a node asked to stop would otherwise spend before its exit."""
    status = main()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError):  # a reader that has gone (`... | head`)
            stream.flush()
    os._exit(status)


def _run(args: argparse.Namespace) -> int:
    try:
        return _COMMANDS[args.command](args)
    except ConfigError as exc:
        return _fail(str(exc))
    except RunFailed as exc:
        print(f"{PROG}: {args.command} failed: {exc}", file=sys.stderr)
        return 1


def _run_node(args: argparse.Namespace) -> int:
    """`start` and `coordinator` (one that holds no stage)."""
    node_cfg = settings.load(
        NodeConfig,
        args=args,
        env=os.environ,
        toml_path=args.config,
        overrides={"coordinator_only": True} if args.command == "coordinator" else None,
    )
    return _start(node_cfg)


def _run_status(args: argparse.Namespace) -> int:
    """`status`: one node, or a whole swarm; once, or again every --every seconds."""
    token = args.token or os.environ.get(settings.env_name(("transport", "token")))
    transport = TransportConfig(swarm_dir=args.swarm_dir, token=token)
    creds = transport.credentials
    swarm = args.swarm or (creds.swarm if creds and args.address is None else None)
    if (args.address is None) == (swarm is None):
        return _fail("status: give a node's HOST:PORT or --swarm NAME (one of them)")
    if swarm is not None:
        show = functools.partial(
            run_swarm_status,
            swarm,
            peers=args.peer,
            interface=args.mdns_interface,
            as_json=args.json,
            timeout_s=args.timeout_s,
            transport=transport,
        )
    else:
        show = functools.partial(
            run_status,
            args.address,
            as_json=args.json,
            timeout_s=args.timeout_s,
            transport=transport,
        )
    if not args.watch:
        return show()
    if not 0 < args.every < 86_400:
        return _fail(f"status: --every {args.every}: give seconds, more than 0")
    return watch(show, args.every, header=sys.stderr if args.json else sys.stdout)


def _run_bench(args: argparse.Namespace) -> int:
    """`bench SUITE`: links (the default) runs the systems; the others run their own suite."""
    bench_cfg = settings.load(BenchConfig, args=args, env=os.environ, toml_path=args.config)
    if args.suite == "planner":
        return run_planner_bench(bench_cfg.jsonl, quick=bench_cfg.quick)
    if args.suite in ("codecs", "replicas", "replan", "flaps"):
        prefix = f"ravnest-{args.suite}-"
        work_dir = bench_cfg.work_dir or Path(tempfile.mkdtemp(prefix=prefix))
        run_suite: Callable[[Suite], int] = {
            "codecs": run_codec_bench,
            "replicas": run_replicas_bench,
            "replan": run_replan_bench,
            "flaps": lambda suite: run_flaps_bench(
                suite, args.only, getattr(args, "model", None), getattr(args, "steps", None)
            ),
        }[args.suite]
        suite = Suite(
            train=bench_cfg.train,
            jsonl=bench_cfg.jsonl,
            work_dir=work_dir,
            quick=bench_cfg.quick,
            transport=bench_cfg.transport,
        )
        return run_suite(suite)
    return run_bench(bench_cfg)


def _run_demo(args: argparse.Namespace) -> int:
    demo_cfg = settings.load(DemoConfig, args=args, env=os.environ, toml_path=args.config)
    return run_demo(demo_cfg)


_COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "start": _run_node,
    "coordinator": _run_node,
    "status": _run_status,
    "init-swarm": run_init_swarm,
    "revoke": run_revoke,
    "export": run_export,
    "models": run_models,
    "demo": _run_demo,
    "bench": _run_bench,
    "plan": plan_command.run_plan,
}
"""What runs each subcommand (argparse accepts no other), given its parsed arguments; returns the
exit status."""
