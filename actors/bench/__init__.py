"""``minirt bench serve``: drive a running runtime with a workload and write a report directory."""
