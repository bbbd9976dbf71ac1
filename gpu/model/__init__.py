"""The model and what it runs on: the Llama-family forward, attention over the paged KV cache,
linear layers, weight loading and model sources, and the Python faces of the C++ kernels."""
