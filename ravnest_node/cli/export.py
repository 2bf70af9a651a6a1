"""`ravnest-node export`: a fine-tuned pretrained model, merged into one safetensors file, or
(``--adapter``) its LoRA adapters as a PEFT adapter directory."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from ravnest_node.checkpoint.export import export_pretrained
from ravnest_node.checkpoint.peft_adapter import export_adapter

__all__ = ["add_export_parser", "run_export"]


def add_export_parser(commands: Any) -> None:
    """Register the `export` subcommand on `commands` (argparse sub-parsers)."""
    export = commands.add_parser(
        "export",
        help="merge a fine-tuned pretrained model into one safetensors file",
        description="Gather the newest step at which the nodes' checkpoints cover every block, "
        "fold LoRA adapters into their base weights, and write a Hugging Face directory "
        "(model.safetensors, config.json, tokenizer files) that loads as hf:OUT. Give the "
        "state directories of the nodes (or copies of their checkpoints folders). With "
        "--adapter, write only the LoRA adapters, as PEFT saves them (adapter_model.safetensors, "
        "adapter_config.json): PeftModel.from_pretrained loads them onto the base model, and "
        "hf:DIR,lora=R,adapter=OUT starts a run from them.",
    )
    export.add_argument("--model", required=True, help="the run's model name (hf:DIR,...)")
    export.add_argument("--out", required=True, type=Path, help="directory to write")
    export.add_argument(
        "--adapter",
        action="store_true",
        help="write the LoRA adapters in PEFT's layout, not the merged model",
    )
    export.add_argument("state_dirs", nargs="+", type=Path, metavar="STATE_DIR",
                        help="a node's --state-dir (its checkpoints/ folder is read)")  # fmt: skip


def run_export(args: argparse.Namespace) -> int:
    """Run `export` and print what was written as one JSON line; exit status 0."""
    write = export_adapter if args.adapter else export_pretrained
    result = write(args.model, args.state_dirs, args.out)
    print(json.dumps(result))
    return 0
