"""Helpers the tests share (imported as `helpers.<module>`; pytest puts tests/ on the path)."""
