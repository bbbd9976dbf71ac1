"""The scheduler actor: waiting queue, admission, budgets and preemption decisions.

``actor`` wires it to ZMQ (sockets and dispatch only); everything else is pure and testable
without sockets: ``core`` (``SchedulerCore``, a request's life cycle and the public API, composed
of the managers below), ``base`` (``CoreState``, the state the managers share, and its send /
free / fail / drop primitives), ``intake`` (a request arrives or is cancelled), ``admission``
(who is offered to the KV manager next), ``preemption`` (who makes room), ``reconcile`` (a
restarted scheduler rebuilds its state), ``recovery`` (a peer died), ``queue`` (the policies'
waiting queues), ``prefix_defer`` (prefix-aware holding back), ``state`` (a request as the
scheduler sees it), ``metrics`` (Prometheus).
"""
