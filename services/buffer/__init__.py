"""The trajectory buffer service: durable store (store.py, records.py), groups and freshness
(groups.py), leases on served batches and their acknowledgement (leases.py), the buffer logic
(buffer.py), its gRPC servicer and process entry point (servicer.py, main.py), and the clients
rollout and trainer use (client.py)."""
