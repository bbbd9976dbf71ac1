"""The disk tier's files: block files written and read off the step loop, checked on load."""
