"""minirt's OpenAI-compatible HTTP API: the ``http`` actor (see ``actor.py``), a Starlette app
under hypercorn's trio worker that talks to the front door over ZeroMQ."""
