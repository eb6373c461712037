"""Task environments of the sandbox service: terminal, swe, search, code."""
