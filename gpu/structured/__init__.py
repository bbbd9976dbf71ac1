"""Structured output (constrained decoding) on llguidance.

``grammar`` (no torch: the front door imports it to refuse what cannot compile) turns a wire
``StructuredOutput`` into an llguidance grammar and compiles it once per distinct constraint in a
bounded cache. ``masks`` (torch) holds each request's matcher and builds and applies the
per-step token bitmask of the constrained rows. Why llguidance and not xgrammar:
docs/benchmarks/structured/README.md.
"""
