"""Rollout: the agent loop (agent.py), the producer that keeps episodes in flight and ships them
to the buffer (producer.py), the features that play a stage's episodes their own way beside it
(extensions.py; an agent swarm's: swarm.py, swarm_run.py), the inference engines behind one protocol and factory (engine.py:
vLLM, megatron, torch), the gRPC servicer and process entry point (servicer.py, main.py), and
the client the stage driver uses (client.py, wire.py)."""
