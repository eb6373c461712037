"""The exit codes of every `kiln` command: one table, so a script can tell "fix the input" from
"look at the logs" whatever command it ran.

The split that matters to a caller is whether running the same command again can help: a
refused input (1) fails the same way until the input changes, a runtime failure (2) may not
(a service that died, a download that stopped: `kiln run --resume` and a rerun of
`kiln prepare-model` continue). argparse's own usage errors exit 2 by default; `KilnParser`
makes them 1, since a misspelt flag is refused input like a misspelt manifest key.

Not covered: `kiln sandbox exec` exits with the sandboxed command's own code (124 after its
timeout, 137 after an OOM kill), as `timeout` and `env` do; its own refusals, before the
command runs, are 1 like every command's. The services' entry points
(`python -m kiln.services.<name>.main`) are processes of a pod, not commands, and keep their
own codes.
"""
from __future__ import annotations

import argparse
import enum
import sys
from typing import NoReturn


class Exit(enum.IntEnum):
    OK = 0
    """Done."""
    REFUSED = 1
    """Refused input, nothing run: a usage error, an invalid manifest or `--set`, a file that is
    not there or not what was expected. The message names the flag, file or field."""
    FAILED = 2
    """Runtime failure: the input was accepted but a service, stage or download failed; the
    message (and the logs it names) say why. Running again may help."""
    PROBLEMS_FOUND = 3
    """A check ran to its end and found problems: `buffer check` found damage, `buffer repair`
    found some but wrote nothing without --yes, `sandbox verify` a task that fails, `consistency`
    a mismatch, `simulate --accelerators` no configuration within `--max-staleness`."""
    INTERRUPTED = 130
    """Stopped by Ctrl-C or SIGTERM (128 + SIGINT, as a shell reports it); `kiln run --resume`
    continues a run."""
    BROKEN_PIPE = 141
    """The reader of stdout went away (`kiln trajectories RUN | head`); 128 + SIGPIPE."""


class KilnParser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors exit `Exit.REFUSED` instead of argparse's 2.
    Subparsers inherit the class, so every command's parser refuses the same way."""

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(Exit.REFUSED, f"{self.prog}: error: {message}\n")


def deprecated_flag(flag: str, instead: str) -> str:
    """The one line a deprecated flag prints to stderr (the flag still works this release)."""
    return f"kiln: {flag} is deprecated and will be removed in the next release; {instead}"
