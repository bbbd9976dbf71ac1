"""OpenAI's Responses API, run as a chat turn through the same front door."""
