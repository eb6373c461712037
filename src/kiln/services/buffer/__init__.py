"""The trajectory buffer service: durable store (store.py, records.py), groups and freshness
(groups.py), leases on served batches and their acknowledgement (leases.py), the in-memory
index (index.py), the rules at its door (admission.py), the buffer itself (buffer.py), its
types (types.py), wire converters (wire.py), gRPC servicer and process entry point
(servicer.py, main.py), and the client every other component uses (client.py)."""
