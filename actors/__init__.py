"""The actor framework (runtime/), what actors share (shared/), and two of the actors: the
scheduler (scheduler/) and the KV manager (kv/)."""
