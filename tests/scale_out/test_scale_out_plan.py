"""`minirt up --replicas N`, the plan (no processes): CPUs and ports split between replicas, the
router's command line fit for failover, and the flags every replica inherits."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from minirt.launch.replicas import passthrough_flags, plan, split_cpus
from minirt.launch.router import RouterMissing, RouterSpec, find_router


def test_cpus_split_into_disjoint_slices_or_shared_one_each():
    assert split_cpus(range(8), 2) == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert split_cpus([3, 1, 2, 0, 4], 2) == [(0, 1, 2), (3, 4)]
    assert split_cpus([0, 1], 3) == [(0,), (1,), (0,)]  # fewer CPUs than replicas: shared
    with pytest.raises(ValueError, match="at least 1"):
        split_cpus([0], 0)


def test_plan_gives_each_replica_its_run_dir_port_threads_and_name(tmp_path):
    c = plan(2, tmp_path, http_port=8000, cpus=[0, 1, 2, 3], api_key="k")
    assert [r.name for r in c.replicas] == ["replica-0", "replica-1"]
    assert [r.run_dir for r in c.replicas] == [tmp_path / "replica-0", tmp_path / "replica-1"]
    assert c.router.workers == ["http://127.0.0.1:8001", "http://127.0.0.1:8002"]
    assert (c.router.host, c.router.port, c.router.api_key) == ("127.0.0.1", 8000, "k")
    argv = c.replicas[1].argv(["--model", "/m"], "py")
    assert argv[:6] == ["py", "-m", "minirt.cli", "up", "--model", "/m"]
    joined = " ".join(argv)
    assert f"--run-dir {tmp_path / 'replica-1'}" in joined
    assert "--http-host 127.0.0.1 --http-port 8002" in joined
    assert "--threads 2" in joined  # its share of the CPUs
    assert "--threads 7" in " ".join(c.replicas[0].argv(["--threads", "7"], "py"))
    assert all(r.pin for r in c.replicas)  # 2 CPUs each: pinned
    assert not any(r.pin for r in plan(2, tmp_path, cpus=[0, 1]).replicas)  # 1 each: shared
    assert "--replica replica-1" in joined  # its name, in every event its actors write
    assert c.replicas[1].env({})["MINIRT_REPLICA"] == "replica-1"


def test_plan_refuses_ports_that_collide_with_the_router(tmp_path):
    with pytest.raises(ValueError, match="overlap the router"):
        plan(3, tmp_path, http_port=8000, base_port=7999, cpus=[0])
    with pytest.raises(ValueError, match="metrics port"):
        plan(2, tmp_path, http_port=8000, metrics_port=8002, cpus=[0])
    c = plan(2, tmp_path, replica_metrics_port=9100, cpus=[0])
    assert [r.metrics_port for r in c.replicas] == [9100, 9101]


def test_router_command_binds_loopback_and_fails_over_fast():
    spec = RouterSpec(["http://127.0.0.1:8001"], port=8000, metrics_port=29001, api_key="s3")
    argv = spec.argv("/venv/bin/python")
    opts = dict(zip(argv[3::2], argv[4::2], strict=False))
    assert argv[:3] == ["/venv/bin/python", "-m", "sglang_router.launch_router"]
    # The router's own defaults: 0.0.0.0 for both, health every 60 s, circuit breaker 60 s.
    assert opts["--host"] == opts["--prometheus-host"] == "127.0.0.1"
    assert opts["--prometheus-port"] == "29001"
    assert int(opts["--health-check-interval-secs"]) <= 2
    assert int(opts["--cb-timeout-duration-secs"]) <= 5
    assert argv[argv.index("--api-key") + 1] == "s3"
    assert "--api-key" not in RouterSpec(["http://h:1"]).argv("p")
    assert spec.url == "http://127.0.0.1:8000"


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"workers": []}, "at least one worker"),
        ({"workers": ["127.0.0.1:8001"]}, "not an http"),
        ({"workers": ["http://h:1"], "policy": "nearest"}, "policy must be one of"),
    ],
)
def test_router_spec_names_the_bad_field(kw, match):
    with pytest.raises(ValueError, match=match):
        RouterSpec(**kw)


def test_missing_router_says_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setenv("MINIRT_ROUTER_VENV", str(tmp_path / "nowhere"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("minirt.launch.router._REPO", tmp_path)
    with pytest.raises(RouterMissing, match="scripts/install-router"):
        find_router()
    site = tmp_path / "nowhere" / "lib" / "python3.11" / "site-packages" / "sglang_router"
    site.mkdir(parents=True)
    (tmp_path / "nowhere" / "bin").mkdir()
    (tmp_path / "nowhere" / "bin" / "python").touch()
    assert find_router() == Path(tmp_path / "nowhere" / "bin" / "python")


def _setup(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model")
    p.add_argument("--run-dir")
    p.add_argument("--num-blocks", type=int)
    p.add_argument("--curve", action=argparse.BooleanOptionalAction)
    p.add_argument("--prefill-first", dest="decode_first", action="store_const", const=False)
    p.add_argument("--client-endpoint")


def test_every_replica_inherits_the_flags_given_except_per_instance_ones():
    p = argparse.ArgumentParser()
    _setup(p)
    args = p.parse_args(["--model", "/m", "--run-dir", "/r", "--num-blocks", "64", "--no-curve"])
    assert passthrough_flags(_setup, args) == ["--model", "/m", "--num-blocks", "64", "--no-curve"]
    args = p.parse_args(["--prefill-first", "--curve"])
    assert passthrough_flags(_setup, args) == ["--curve", "--prefill-first"]
    with pytest.raises(ValueError, match="--client-endpoint"):
        passthrough_flags(_setup, p.parse_args(["--client-endpoint", "tcp://127.0.0.1:1"]))


def test_minirt_up_flags_pass_through_to_each_replica():
    from minirt.cli import _config_args

    p = argparse.ArgumentParser()
    _config_args(p)
    args = p.parse_args(
        [
            "--model",
            "/m",
            "--run-dir",
            "/r",
            "--kv-mode",
            "full",
            "--prefill-first",
            "--metrics-port",
            "9100",
        ]
    )
    words = passthrough_flags(_config_args, args)
    assert words[:4] == ["--model", "/m", "--kv-mode", "full"]
    assert "--run-dir" not in words and "--metrics-port" not in words  # set per replica
    assert len(words) == 5  # and the prefill-first setting, in whichever spelling


def _interpolate(text: str) -> str:
    """compose's ``${VAR:-default}`` with every variable unset; ``$$`` is a literal ``$``."""
    import re

    text = re.sub(r"\$\{[A-Z0-9_]+:-([^}]*)\}", r"\1", text)
    return text.replace("$$", "$")


def test_compose_scale_out_services_match_the_launchers_layout():
    import re
    import shlex

    import yaml

    compose = Path(__file__).resolve().parents[2] / "compose.yaml"
    services = yaml.safe_load(_interpolate(compose.read_text()))["services"]
    replicas = {n: s for n, s in services.items() if n.startswith("replica-")}
    router = services["router"]
    assert set(replicas) == {"replica-0", "replica-1"}
    assert all(s["profiles"] == ["scale-out"] for s in (*replicas.values(), router))
    envs = [s["environment"] for s in replicas.values()]
    assert len({e["MINIRT_RUN_DIR"] for e in envs}) == len({e["MINIRT_REPLICA"] for e in envs}) == 2
    for e in envs:  # ipc:// sockets in each replica's run dir, not the shared tcp ports
        assert all(e[f"MINIRT_{n}_ENDPOINT"] == "" for n in ("CLIENT", "TOKENIZER", "HTTP"))
    command = re.sub(r"\$\{MINIRT_API_KEY:\+[^}]*\}", "", router["command"][0])
    words = shlex.split(command)
    urls = [f"http://{e['MINIRT_HTTP_HOST']}:{e['MINIRT_HTTP_PORT']}" for e in envs]
    # The same flags minirt up --replicas gives the router (minus the key, when none is set).
    want = RouterSpec(urls, port=8000, metrics_port=29000).argv("/opt/router/bin/python")
    assert words[1:] == want, (words, want)


def test_kubernetes_manifest_finds_the_replicas_it_runs_with_the_launchers_settings():
    import yaml

    path = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes" / "scale-out.yaml"
    docs = {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(path.read_text())}
    replica = docs[("Deployment", "minirt-replica")]["spec"]["template"]
    router = docs[("Deployment", "minirt-router")]["spec"]["template"]["spec"]["containers"][0]
    args = dict(a.removeprefix("--").split("=", 1) for a in router["args"] if "=" in a)
    selector = router["args"][router["args"].index("--selector") + 1]
    assert selector == "=".join(next(iter(replica["metadata"]["labels"].items())))
    port = replica["spec"]["containers"][0]["ports"][0]["containerPort"]
    assert int(args["service-discovery-port"]) == port
    assert replica["spec"]["containers"][0]["readinessProbe"]["httpGet"]["path"] == "/health"
    launcher = RouterSpec(["http://x:1"]).argv("python")
    for flag in (
        "health-check-interval-secs",
        "health-failure-threshold",
        "cb-timeout-duration-secs",
    ):
        assert args[flag] == launcher[launcher.index(f"--{flag}") + 1], flag
    assert args["api-key"] == "$(MINIRT_API_KEY)"


def test_health_poll_reads_a_non_http_answer_as_nothing_answering():
    """A loopback connect to a port nobody listens on yet can meet itself (TCP self-connect) and
    read back its own request line; the launcher's health poll must see "not up yet" and go on
    polling, not crash the launch."""
    import socket
    import threading

    from minirt.launch.router import http_get

    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]

    def echo() -> None:  # answers with the request itself, as a self-connected socket does
        conn, _ = srv.accept()
        with conn:
            conn.sendall(conn.recv(4096))

    t = threading.Thread(target=echo)
    t.start()
    try:
        assert http_get(f"http://127.0.0.1:{port}/health", timeout=5.0) == (0, b"")
    finally:
        t.join(timeout=5)
        srv.close()


@pytest.mark.parametrize(
    "flags,env,says",
    [
        ([], {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "t"}, "--ray-address"),
        (
            ["--ray-address", "h:6379", "--api-key", "k"],
            {"RAY_AUTH_MODE": "token"},
            "RAY_AUTH_TOKEN",
        ),
        (["--ray-address", "10.0.0.1:6379", "--api-key", "k"], {}, "RAY_AUTH_MODE=token"),
        (
            ["--ray-address", "10.0.0.1:6379"],
            {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "t"},
            "--api-key",
        ),
    ],
)
def test_ray_placement_refuses_to_start_without_address_key_or_ray_token(
    flags, env, says, tmp_path
):
    """``--placement ray`` names what is missing and starts nothing (exit 2)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")} | env
    cmd = [sys.executable, "-m", "minirt.cli", "up", "--replicas", "2", "--placement", "ray"]
    cmd += ["--model", str(tmp_path), "--run-dir", str(tmp_path / "run"), *flags]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 2 and says in out.stderr, (out.returncode, out.stderr)
    assert not (tmp_path / "run" / "logs").exists()


def test_ray_plan_gives_each_replica_its_command_without_an_address(tmp_path):
    from minirt.launch.ray_cluster import ray_plan

    c = plan(2, tmp_path / "c", http_port=8000, api_key="k", flags=["--model", "/m"])
    p = ray_plan(c, "10.0.0.1:6379", "/venv/bin/python", 60.0)
    assert p["address"] == "10.0.0.1:6379" and p["timeout"] == 60.0
    assert [(r["name"], r["port"]) for r in p["replicas"]] == [
        ("replica-0", 8001),
        ("replica-1", 8002),
    ]
    argv = p["replicas"][1]["argv"]
    assert argv[:6] == ["/venv/bin/python", "-m", "minirt.cli", "up", "--model", "/m"]
    assert "--allow-remote" in argv and "--http-host" not in argv  # its actor adds its node's
    assert argv[-4:] == ["--replica", "replica-1", "--run-dir", str(tmp_path / "c" / "replica-1")]
    assert p["replicas"][1]["env"] == {"MINIRT_REPLICA": "replica-1"}
