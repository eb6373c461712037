"""`kiln`: the command-line entry point. Thin: it parses the command name and hands over.

Each subcommand lives in its own module, imported only when that command runs, so `kiln
validate` starts in a fraction of a second and never imports torch or vLLM. A command module
provides `register(subparsers)`, which adds its parser (with a description and help on every
option) and sets `func` (args -> exit code). Every command's exit codes come from one table,
`kiln.cli.exits.Exit`.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
from importlib import metadata

from kiln.cli.exits import Exit, KilnParser

# name -> (module, one-line help). The module is imported only when its command is chosen.
COMMANDS: dict[str, tuple[str, str]] = {
    "run": ("kiln.cli.run", "run an RLJob on this machine, every service a local process"),
    "validate": ("kiln.cli.validate", "check RLJob manifests against the schema"),
    "crd": ("kiln.cli.crd", "print the RLJob CustomResourceDefinition"),
    "trajectories": ("kiln.cli.trajectories", "print trajectories of a run human-readably"),
    "report": ("kiln.cli.report", "(re)make a run's report/*.png from its recorded metrics"),
    "export": ("kiln.cli.export", "write a run's trained policy as a Hugging Face checkpoint"),
    "sandbox": ("kiln.cli.sandbox", "run commands and verifiers in sandboxes"),
    "consistency": ("kiln.cli.consistency", "compare rollout and trainer log-probs"),
    "serve": ("kiln.cli.serve", "serve a checkpoint behind the OpenAI chat-completions API"),
    "eval": ("kiln.cli.evaluate", "evaluate a checkpoint on a job's task set (pass@k)"),
    "prepare-model": ("kiln.cli.prepare_model", "create the job's model (spec.model.init) if missing"),
    "fetch-tasks": ("kiln.cli.hf_tasks", "write the job's Hub dataset task sets (hfDataset) as task files"),
    "buffer": ("kiln.cli.buffer", "check or repair a buffer directory"),
    "simulate": ("kiln.cli.simulate", "simulate an RL stage's throughput and staleness"),
    "synth": ("kiln.cli.synth.command", "build verified agentic task sets (swe, terminal, search)"),
    "dev-cluster": ("kiln.cli.devcluster.command",
                    "a local stand-in cluster: fake API, the operator, pods as processes"),
}

DESCRIPTION = ("Kiln trains LLM agents with reinforcement learning: the same RLJob manifest "
               "runs on Kubernetes (kubectl apply) or on this machine (kiln run).")


def version() -> str:
    try:
        return metadata.version("kiln")
    except metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


def top_parser() -> argparse.ArgumentParser:
    lines = "\n".join(f"  {name:<14} {help_}" for name, (_, help_) in COMMANDS.items())
    p = KilnParser(
        prog="kiln", description=DESCRIPTION,
        epilog=f"commands:\n{lines}\n\nRun 'kiln COMMAND --help' for a command's options.\n\n"
               "exit codes (every command): 0 done, 1 refused input (nothing ran), 2 failed at "
               "run time,\n3 a check found problems, 130 interrupted.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"kiln {version()}",
                   help="print Kiln's version and exit")
    return p


def command_parser(name: str) -> argparse.ArgumentParser:
    """The full parser of one command (its module imported)."""
    module = importlib.import_module(COMMANDS[name][0])
    parser = KilnParser(prog="kiln", description=DESCRIPTION)
    module.register(parser.add_subparsers(dest="command", required=True))
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    top = top_parser()
    if not argv or argv[0] in ("-h", "--help", "--version"):
        if not argv:
            top.print_help()
            return Exit.REFUSED
        top.parse_args(argv)  # prints help or the version and exits 0
    name = argv[0]
    if name not in COMMANDS:
        top.add_argument("command", choices=sorted(COMMANDS), metavar="COMMAND")
        top.parse_args(argv[:1])  # prints the usage error and exits Exit.REFUSED
    from kiln.cli.conventions import take_job

    parser = command_parser(name)
    args = parser.parse_args(argv)
    # Usage errors about the job are the command's own, with its usage line.
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    take_job(args, sub.choices[name])
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        # Commands that stop services catch it themselves; any other just ends, without a
        # traceback, with the code a shell gives a Ctrl-C.
        print("\nkiln: interrupted", file=sys.stderr)
        return Exit.INTERRUPTED
    except BrokenPipeError:
        # The reader went away (`kiln trajectories RUN | head`): stop quietly, as a pipeline
        # expects. Python would otherwise fail again flushing stdout at exit, so stdout is
        # pointed at /dev/null first. 141 is what a shell reports for a SIGPIPE death.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return Exit.BROKEN_PIPE


if __name__ == "__main__":
    sys.exit(main())
