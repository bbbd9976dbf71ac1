"""What-if replay: rerun a recorded event log through every actor's real core (the scheduler's,
the KV manager's, the executor's and the front door's) on a virtual clock, the model's forward
replaced by a step-time model fitted from the log's own ``executor.step`` events. No model, no
sockets, no sleeping.

- ``blockhash``: the per-block prefix hashes that events carry instead of token ids.
- ``runlog`` / ``workload``: a run's events (or a ``minirt bench serve`` report) -> the workload,
  its configuration, decisions and outcome.
- ``stepmodel``: step time as a function of the step's shape (least squares), fit quality.
- ``loop`` (the virtual clock), ``cores`` (``SchedulerCore`` and ``KVManagerCore`` on it), ``execsim``
  (``ExecutorCore`` around scripted tokens) and ``frontsim`` (``TokenizerCore`` with the recorded
  arrivals, cancels and stop strings); ``sim`` runs one replay.
- ``report``: numbers, plots, the replayed event log; ``cli``: ``minirt replay``;
  ``acceptance``: ``minirt bench replay``; ``synth``: synthetic logs for tests and speed.
"""
