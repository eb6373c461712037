"""The chain environment's tool: an integer calculator, run in the sandbox as coreutils `expr`,
and the same arithmetic in-process (for the scripted solver, tests and the CPU trial)."""
from __future__ import annotations

import re

from .protocol import MAX_EXPR_CHARS, Call

#: The calculator is coreutils `expr`: integers, `+ - * / %` (C semantics: `/` truncates toward
#: zero, `%` takes the dividend's sign), parentheses. Each token is its own argv element, never
#: spliced into a shell line; a binary start (~1 ms) keeps a sandboxed call cheap.
_TOKEN_RE = re.compile(r"\d+|[-+*/%()]|[^\s\d()+\-*/%]+")


def tokenize(expr: str) -> list[str]:
    """`37*7%97+5` -> `['37', '*', '7', '%', '97', '+', '5']`; a `-` that starts an operand is
    folded into its number (`-3+1` -> `['-3', '+', '1']`), as `expr` reads negative integers."""
    raw = _TOKEN_RE.findall(expr)
    out: list[str] = []
    for tok in raw:
        if tok.isdigit() and out and out[-1] == "-" and (len(out) == 1 or out[-2] in "(+-*/%"):
            out[-1] = "-" + tok
        else:
            out.append(tok)
    return out


def tool_command(call: Call) -> list[str]:
    """The argv the sandbox runs to evaluate `call` (needs coreutils in the image)."""
    return ["expr", *tokenize(call.expr)]


def evaluate_expression(expr: str) -> int:
    """The calculator in-process, with `expr`'s semantics; raises ValueError (syntax, too long)
    or ZeroDivisionError where the tool would fail."""
    if len(expr) > MAX_EXPR_CHARS:
        raise ValueError("expression too long")
    toks = tokenize(expr)
    pos = 0

    def atom() -> int:
        nonlocal pos
        if pos < len(toks) and toks[pos] == "(":
            pos += 1
            v = sum_()
            if pos >= len(toks) or toks[pos] != ")":
                raise ValueError("unbalanced parenthesis")
            pos += 1
            return v
        if pos < len(toks) and re.fullmatch(r"-?\d+", toks[pos]):
            pos += 1
            return int(toks[pos - 1])
        raise ValueError(f"syntax error at {toks[pos] if pos < len(toks) else 'end'!r}")

    def product() -> int:
        nonlocal pos
        v = atom()
        while pos < len(toks) and toks[pos] in ("*", "/", "%"):
            op = toks[pos]
            pos += 1
            w = atom()
            if op == "*":
                v = v * w
            elif w == 0:
                raise ZeroDivisionError("division by zero")
            else:
                q = abs(v) // abs(w) * (1 if (v >= 0) == (w >= 0) else -1)
                v = q if op == "/" else v - q * w
        return v

    def sum_() -> int:
        nonlocal pos
        v = product()
        while pos < len(toks) and toks[pos] in ("+", "-"):
            op = toks[pos]
            pos += 1
            w = product()
            v = v + w if op == "+" else v - w
        return v

    value = sum_()
    if pos != len(toks):
        raise ValueError(f"syntax error at {toks[pos]!r}")
    return value


def tool_output(stdout: str, exit_code: int) -> str:
    """The tool's result as the model sees it: the integer, or `error`. Errors are one word, so
    a model cannot be fed arbitrary text through the observation. (`expr` exits 1 when the
    result is 0.)"""
    value = stdout.strip()
    if exit_code in (0, 1) and re.fullmatch(r"-?[0-9]{1,40}", value):
        return value
    return "error"


def format_observation(stdout: str, exit_code: int) -> str:
    """`tool_output` as it appears in the text protocol: `<obs>70</obs>`."""
    return f"<obs>{tool_output(stdout, exit_code)}</obs>"


def run_tool_locally(call: Call) -> str:
    """`format_observation` of the calculator run in-process (tests and the CPU trial)."""
    try:
        return format_observation(str(evaluate_expression(call.expr)), 0)
    except (ValueError, ZeroDivisionError, RecursionError):
        return format_observation("", 2)
