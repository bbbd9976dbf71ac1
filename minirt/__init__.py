"""What users run, above every actor: the `minirt` command (cli.py), launching (launch/), the
Python client (client/), the HTTP server process with the OpenAI and Responses APIs and the dashboard
(http/), the replay (replay/), benchmarks (bench/) and the event-log tools (eventlog/)."""
