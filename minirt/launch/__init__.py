"""Launching: `minirt up` (one runtime, its processes supervised) and `minirt up --replicas`
(several behind a router, on one host or placed by Ray)."""
