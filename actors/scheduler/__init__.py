"""The scheduler actor: waiting queue, admission, budgets and preemption decisions.

``actor`` wires it to ZMQ (sockets and dispatch only); everything else is pure and testable
without sockets: ``core`` (``SchedulerCore``, a request's life cycle and the public API),
``admission`` (who is offered to the KV manager next), ``preemption`` (who makes room),
``queue`` (the policies' waiting queues), ``prefix_defer`` (prefix-aware holding back),
``state`` (a request as the scheduler sees it), ``base`` (shared state and send primitives),
``metrics`` (Prometheus).
"""
