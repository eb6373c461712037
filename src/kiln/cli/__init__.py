"""The `kiln` command: one module per subcommand (`main.py` dispatches), and the local run of a
job (`local/`: launcher, progress display, service processes, run report; the stage driver
itself is `kiln.control.driver`, shared with the operator). The top floor: it may use
every service's client, and nothing below imports it."""
