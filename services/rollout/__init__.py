"""Rollout: the agent loop and the inference engines it samples from.

`engine` defines `EngineProtocol` and the vLLM-backed `RolloutEngine`; `torch_engine` is the
same protocol over a plain transformers model, for fast tests.
"""
