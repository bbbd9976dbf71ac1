"""What more than one actor decides the same way, below all of them: the KV reservation and
preemption-victim policies, prefix block hashes, the grammar compiler and the step-time fit."""
