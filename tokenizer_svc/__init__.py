"""The tokenizer actor, minirt's front door and one trust boundary: it validates and tokenizes
every request, streams detokenized output back, and resumes clients across a crash."""
