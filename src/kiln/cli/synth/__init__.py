"""`kiln synth`: build agentic task sets (SWE from git history, terminal, search) and import the
field's formats, every task verified in Kiln's own sandboxes before it is written out.

`command.py` is the CLI; `swe.py` mines commits, `pyenv.py` detects how a Python project runs
its tests, `pytest_run.py` runs them in a sandbox and reads per-test outcomes; `terminal.py` and
`search.py` are the model-drafted and corpus-built pipelines; `imports.py` reads SWE-bench and
Terminal-Bench; `filters.py` holds what every pipeline shares (near-duplicates); `report.py`
writes each run's funnel and rejection reasons.
"""
