"""`kiln run` on one machine: the launcher starts every service as a local process
(`processes.py`), the stage driver runs the job's stages through the services' clients
(`driver.py`), and the run report turns the driver's records into `summary.json` and plots
(`report.py`)."""
