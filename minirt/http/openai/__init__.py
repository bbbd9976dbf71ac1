"""OpenAI's completions and chat completions: request schemas, conversion into the front
door's messages, response shapes and server-sent events."""
