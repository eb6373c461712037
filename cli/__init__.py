"""The `kiln` command: one module per subcommand (`main.py` dispatches), and the local run of a
job (`local/`: launcher, stage driver, service processes, run report). The top floor: it may use
every service's client, and nothing below imports it."""
