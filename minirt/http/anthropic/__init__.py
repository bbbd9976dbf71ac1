"""Anthropic's Messages API (``POST /v1/messages``) on the same front door and chat template as
chat completions: ``schema`` (the request), ``convert`` (into a chat completions plan),
``routes`` (the answer, whole or as Anthropic's stream of events)."""
