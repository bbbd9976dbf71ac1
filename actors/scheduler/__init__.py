"""The scheduler actor: waiting queue, admission, budgets and preemption decisions.

``core`` holds the policy (pure, synchronous, testable without sockets); ``actor`` wires it to ZMQ.
"""
