"""minirt's tests, one folder per role; the helpers they share in ``tests/support``.

- ``kv``: the KV manager (pool, radix cache, core, actor, stateful model test)
- ``scheduler``: the scheduler's core, policies and step plans
- ``executor``: the forward, kernels, models and sampling, exactness against transformers
- ``tokenizer_svc``: the tokenizer (the front door: the ZMQ trust boundary) and its clients
- ``http``: the OpenAI API, its errors and streams, metrics, the dashboard, security
- ``structured``: structured output (grammars, end to end, over HTTP)
- ``runtime``: the transport, liveness, config, launch (``minirt up``) and the docs checks
- ``reliability``: crash-resume, dead actors, slow-not-dead, soak and chaos
- ``replay``: the replay against recorded runs
- ``scale_out``: replicas behind the router, on one host and across network namespaces
- ``bench``: the benchmark tools run small (no timing assertions)
"""
