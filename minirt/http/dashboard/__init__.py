"""The live dashboard: its page, the event-log tail it streams, and the static export."""
