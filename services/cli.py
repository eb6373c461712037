"""`kiln`: the command-line entry point. Thin: it parses the command name and hands over.

Each subcommand lives in its own module, imported only when that command runs, so `kiln
validate` starts in a fraction of a second and never imports torch or vLLM. A command module
provides `register(subparsers)`, which adds its parser and sets `func` (args -> exit code).
"""
from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line help). The module is imported only when its command is chosen.
COMMANDS: dict[str, tuple[str, str]] = {
    "validate": ("kiln.services.manifests", "check RLJob manifests against the schema"),
    "crd": ("kiln.services.manifests", "print the RLJob CustomResourceDefinition"),
    "run": ("kiln.services.launcher", "run an RLJob on this machine, every service a process"),
    "trajectories": ("kiln.services.inspect", "print trajectories of a run human-readably"),
    "sandbox": ("kiln.services.sandbox.cli", "run commands and verifiers in sandboxes"),
    "consistency": ("kiln.services.consistency", "compare rollout and trainer log-probs"),
}


def _top_parser() -> argparse.ArgumentParser:
    lines = "\n".join(f"  {name:<14} {help_}" for name, (_, help_) in COMMANDS.items())
    return argparse.ArgumentParser(
        prog="kiln",
        description="Kiln: reinforcement learning for LLM agents.",
        epilog=f"commands:\n{lines}\n\nRun 'kiln COMMAND --help' for a command's options.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    top = _top_parser()
    top.add_argument("command", choices=sorted(COMMANDS), metavar="COMMAND")
    if not argv or argv[0] in ("-h", "--help"):
        top.print_help()
        return 0 if argv else 2
    name = argv[0]
    if name not in COMMANDS:
        top.parse_args(argv[:1])  # prints the usage error and exits 2
    module = importlib.import_module(COMMANDS[name][0])
    parser = argparse.ArgumentParser(prog="kiln")
    sub = parser.add_subparsers(dest="command", required=True)
    module.register(sub)
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
