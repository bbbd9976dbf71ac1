"""Speculative decoding in the executor: n-gram (prompt-lookup) drafts verified in the step's
one forward, lossless (``gpu/spec/verify.py`` says why).

- ``config``: ``--speculative-config`` (vLLM's JSON) parsed into a frozen ``SpecConfig``;
- ``ngram``: the proposer, per request, over its prompt and outputs (numpy, no torch);
- ``cost``: how many rows a step may run before extra rows cost real compute (measured once);
- ``plan``: which decodes of a step verify drafts, and how many;
- ``verify``: accepted drafts from the step's target tokens; the step's counters.
"""
