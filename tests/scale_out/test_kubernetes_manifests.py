"""deploy/kubernetes/*.yaml checked offline, no cluster and no network: every document against the
Kubernetes OpenAPI schemas (kubernetes-validate's bundled copies, strict: an unknown field is an
error), the LeaderWorkerSet against the schema generated from the LWS CRD
(deploy/kubernetes/schemas/, its pod templates as core PodTemplateSpecs); broken copies refused;
every minirt command line in them accepted by minirt's own parser; and the LeaderWorkerSet's split
instance consistent: each actor once, bound where the shared endpoints TOML says its peers find
it, the CURVE keys laid out as minirt reads them. None of it says the manifests run on a cluster."""

from __future__ import annotations

import argparse
import copy
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import jsonschema
import kubernetes_validate
import pytest
import yaml

from actors.runtime.config import ACTORS, load
from minirt.cli import build_parser, config_from_args

K8S = "1.33"  # the Kubernetes version validated against (kubernetes-validate bundles its schemas)
DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
LWS_API = "leaderworkerset.x-k8s.io/v1"
POD_TEMPLATES = ("leaderTemplate", "workerTemplate")


def documents(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def lws_schema() -> dict[str, Any]:
    schema = json.loads((DEPLOY / "schemas" / "leaderworkerset-v1.json").read_text())
    jsonschema.validators.validator_for(schema).check_schema(schema)
    return schema


def validate(doc: dict[str, Any]) -> None:
    """Raise ``jsonschema.ValidationError`` when ``doc`` is not a valid object of its kind, and
    ``kubernetes_validate.SchemaNotFoundError`` for a kind no schema here knows."""
    if (doc.get("apiVersion"), doc.get("kind")) != (LWS_API, "LeaderWorkerSet"):
        kubernetes_validate.validate(doc, K8S, strict=True)
        return
    schema = lws_schema()
    jsonschema.validators.validator_for(schema)(schema).validate(doc)
    template = doc["spec"]["leaderWorkerTemplate"]
    for name in POD_TEMPLATES:  # bare objects in the generated schema: the core kind checks them
        if name in template:
            pod = {"apiVersion": "v1", "kind": "PodTemplate", "template": template[name]}
            pod["metadata"] = {"name": f"{doc['metadata']['name']}-{name.lower()}"}
            kubernetes_validate.validate(pod, K8S, strict=True)


MANIFESTS = sorted(DEPLOY.glob("*.yaml"))
DOCS = [
    pytest.param(doc, id=f"{path.name}:{doc['kind']}/{doc['metadata']['name']}")
    for path in MANIFESTS
    for doc in documents(path)
]


def test_the_manifests_are_found():
    assert {p.name for p in MANIFESTS} >= {"scale-out.yaml", "leaderworkerset.yaml"}


@pytest.mark.parametrize("doc", DOCS)
def test_every_document_is_valid_for_its_kind(doc):
    validate(doc)


def _first(file: str, kind: str) -> dict[str, Any]:
    return next(d for d in documents(DEPLOY / file) if d["kind"] == kind)


_TMPL = ("spec", "leaderWorkerTemplate")
_EXECUTOR = (*_TMPL, "workerTemplate", "spec", "containers", 0)


@pytest.mark.parametrize(
    ("file", "kind", "path", "value"),
    [
        ("scale-out.yaml", "Deployment", ("spec", "replicas"), "two"),  # wrong type
        ("scale-out.yaml", "Service", ("spec", "ports", 0, "port"), "http"),
        ("scale-out.yaml", "Deployment", ("spec", "replica"), 2),  # unknown field (strict)
        ("leaderworkerset.yaml", "ConfigMap", ("data", "minirt.toml"), 1),
        ("leaderworkerset.yaml", "LeaderWorkerSet", (*_TMPL, "size"), "2"),
        ("leaderworkerset.yaml", "LeaderWorkerSet", (*_TMPL, "restartPolicy"), "Always"),
        ("leaderworkerset.yaml", "LeaderWorkerSet", (*_TMPL, "sizes"), 2),
        ("leaderworkerset.yaml", "LeaderWorkerSet", ("spec", "networkConfig"), {}),  # required
        ("leaderworkerset.yaml", "LeaderWorkerSet", (*_EXECUTOR, "args"), "actor executor"),
        ("leaderworkerset.yaml", "LeaderWorkerSet", (*_EXECUTOR, "ports", 0, "containerPort"), "1"),
    ],
)
def test_a_broken_copy_is_refused(file, kind, path, value):
    doc = copy.deepcopy(_first(file, kind))
    validate(doc)  # the original passes
    node: Any = doc
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    with pytest.raises(jsonschema.ValidationError) as refused:
        validate(doc)
    why = refused.value  # and for the field broken, not for something else
    assert path[-1] in why.absolute_path or f"'{path[-1]}'" in why.message, why.message


def test_a_kind_with_no_schema_is_an_error_not_a_pass():
    with pytest.raises(kubernetes_validate.SchemaNotFoundError):
        validate({"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": "w"}})


# ------------------------------------------------------------------ minirt's own command lines


def pod_templates(doc: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    spec = doc.get("spec", {})
    if "template" in spec:  # Deployment, StatefulSet, ...
        yield doc["metadata"]["name"], spec["template"]
    for name in POD_TEMPLATES:
        if name in spec.get("leaderWorkerTemplate", {}):
            yield f"{doc['metadata']['name']}/{name}", spec["leaderWorkerTemplate"][name]


def minirt(argv: list[str]) -> argparse.Namespace:
    """``argv`` as ``minirt`` parses it (the image's entry point); fails the test when refused."""
    try:
        return build_parser().parse_args(argv)
    except SystemExit:  # argparse has printed why
        pytest.fail(f"minirt refuses: {' '.join(argv)}")


def minirt_lines() -> Iterator[tuple[str, list[str]]]:
    """Every minirt command line: containers of the minirt image, exec probes running minirt."""
    for path in MANIFESTS:
        for doc in documents(path):
            for where, template in pod_templates(doc):
                for c in template["spec"]["containers"]:
                    if c["image"].split(":")[0] == "minirt":
                        yield f"{path.name}:{where}/{c['name']}", c["args"]
                    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
                        command = c.get(probe, {}).get("exec", {}).get("command", [])
                        if command[:1] == ["minirt"]:
                            yield f"{path.name}:{where}/{c['name']}/{probe}", command[1:]


def test_every_minirt_command_line_is_accepted_by_minirt():
    lines = list(minirt_lines())
    assert len(lines) >= 1 + 5 + 6  # up; the five actors and their ping probes
    for _, argv in lines:
        minirt(argv)
    with pytest.raises(pytest.fail.Exception, match="minirt refuses"):
        minirt(["actor", "executor", "--no-such-flag"])  # the check can fail


# ------------------------------------------------------------------ the split instance


def _lws_parts() -> tuple[dict[str, Any], str, dict[str, Any]]:
    found = documents(DEPLOY / "leaderworkerset.yaml")
    docs = {(d["kind"], d["metadata"]["name"]): d for d in found}
    lws = docs[("LeaderWorkerSet", "minirt-split")]
    return lws, docs[("ConfigMap", "minirt-split")]["data"]["minirt.toml"], docs


def _mount(container: dict[str, Any], volume: str) -> dict[str, Any]:
    return next(m for m in container["volumeMounts"] if m["name"] == volume)


def _actors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Each actor of the group: (its pod template, its container, its RuntimeConfig as
    ``minirt actor`` builds it from the ConfigMap's TOML, its flags and its environment)."""
    import os

    lws, toml, _ = _lws_parts()
    conf = tmp_path / "minirt.toml"
    conf.write_text(toml)
    out = {}
    for role in POD_TEMPLATES:
        for c in lws["spec"]["leaderWorkerTemplate"][role]["spec"]["containers"]:
            for key in [k for k in os.environ if k.startswith("MINIRT_")]:
                monkeypatch.delenv(key)
            for e in c.get("env", []):  # a Secret's value stands in as "from-secret"
                monkeypatch.setenv(e["name"], e.get("value", "from-secret"))
            args = minirt(c["args"])
            assert args.command == "actor"
            m = _mount(c, "config")
            assert (args.config, m.get("subPath")) == (m["mountPath"], "minirt.toml")
            args.config = str(conf)
            assert args.name not in out, f"{args.name} runs twice"
            out[args.name] = (role, c, config_from_args(args))
    return out


def test_split_instance_runs_each_actor_once_the_executor_on_the_worker(tmp_path, monkeypatch):
    lws, _, _ = _lws_parts()
    actors = _actors(tmp_path, monkeypatch)
    assert set(actors) == {*ACTORS, "http"}
    assert {n for n, (role, _, _) in actors.items() if role == "workerTemplate"} == {"executor"}
    spec = lws["spec"]
    # One instance: the group's pods are the leader and one worker (the TOML's names are group 0's).
    assert (spec["replicas"], spec["leaderWorkerTemplate"]["size"]) == (1, 2)
    assert spec["networkConfig"]["subdomainPolicy"] == "Shared"
    blocks = {actors[n][2].kv.num_blocks for n in ("kv_manager", "executor")}
    assert len(blocks) == 1 and None not in blocks  # the KV manager and the executor agree


def test_split_endpoints_name_the_pods_and_ports_the_actors_listen_on(tmp_path, monkeypatch):
    from actors.runtime.security import check_bind

    lws, _, _ = _lws_parts()
    name = lws["metadata"]["name"]
    # LWS: a headless Service named after the set; pods <name>-<group> and <name>-<group>-<i>.
    hosts = {"leaderTemplate": f"{name}-0.{name}", "workerTemplate": f"{name}-0-1.{name}"}
    actors = _actors(tmp_path, monkeypatch)
    shared = load(tmp_path / "minirt.toml", environ={}).endpoints  # what the peers read
    ports = [urlsplit(shared.of(n)).port for n in ("client", *ACTORS, "http")]
    assert len(set(ports)) == len(ports)  # the leader's containers share one network namespace
    for actor, (role, c, cfg) in actors.items():
        own, theirs = urlsplit(cfg.endpoints.of(actor)), urlsplit(shared.of(actor))
        check_bind(cfg.endpoints.of(actor), cfg.security.allow_remote, bool(cfg.security.curve_dir))
        assert cfg.security.curve_dir == _mount(c, "curve")["mountPath"]
        assert own.port == theirs.port, actor  # peers connect where it listens
        if theirs.hostname == "127.0.0.1":  # the HTTP actor's inbox: only its own pod pings it
            assert own == theirs and role == "leaderTemplate"
        else:  # every address of its pod, reached at the pod's name
            assert (own.hostname, theirs.hostname) == ("0.0.0.0", hosts[role]), actor
            assert own.port in {p["containerPort"] for p in c["ports"]}
        for probe in ("readinessProbe", "livenessProbe"):
            command = c.get(probe, {}).get("exec", {}).get("command")
            if command:  # `minirt ping` of this actor's own inbox, with the keys
                ping = minirt(command[1:])
                assert urlsplit(ping.target).port == own.port, (actor, probe)
                assert ping.curve_dir == cfg.security.curve_dir
    # The front door's client socket on loopback: the HTTP actor, its one user, is in its pod.
    assert urlsplit(shared.client).hostname == "127.0.0.1"
    assert actors["tokenizer"][0] == actors["http"][0] == "leaderTemplate"


def test_split_http_api_is_served_from_the_leader(tmp_path, monkeypatch):
    from minirt.http.actor import check_bind

    lws, _, docs = _lws_parts()
    _, c, cfg = _actors(tmp_path, monkeypatch)["http"]
    check_bind(cfg.http, cfg.security.allow_remote)  # 0.0.0.0: allow-remote and the key
    assert cfg.http.api_key == "from-secret"
    port = next(p for p in c["ports"] if p["name"] == "http")
    assert port["containerPort"] == cfg.http.port
    assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    service = docs[("Service", "minirt-split-http")]["spec"]
    tmpl = lws["spec"]["leaderWorkerTemplate"]
    labels = {r: tmpl[r]["metadata"]["labels"] for r in POD_TEMPLATES}
    assert service["selector"].items() <= labels["leaderTemplate"].items()
    assert not service["selector"].items() <= labels["workerTemplate"].items()
    assert service["ports"][0]["targetPort"] == "http"


def test_split_curve_secret_is_laid_out_as_minirt_keys_makes_it(tmp_path):
    """`kubectl create secret generic --from-file=keys/` takes the files at the top of keys/; the
    volume's items put them back where `minirt keys` put them, authorized/ included."""
    from actors.runtime.security import CurveKeys, make_keys

    lws, _, _ = _lws_parts()
    keys = tmp_path / "keys"
    make_keys(keys)
    made = {str(p.relative_to(keys)) for p in keys.rglob("*") if p.is_file()}
    for role in POD_TEMPLATES:
        volumes = lws["spec"]["leaderWorkerTemplate"][role]["spec"]["volumes"]
        secret = next(v for v in volumes if v["name"] == "curve")["secret"]
        assert {i["path"] for i in secret["items"]} == made
        mount = tmp_path / role
        for item in secret["items"]:
            assert (keys / item["key"]).is_file()  # a file --from-file=keys/ takes
            (mount / item["path"]).parent.mkdir(parents=True, exist_ok=True)
            (mount / item["path"]).write_bytes((keys / item["key"]).read_bytes())
        loaded = CurveKeys.load(mount)
        assert loaded.server_secret is not None  # every actor serves an inbox
        assert (loaded.authorized / "client.key").read_bytes() == (keys / "client.key").read_bytes()
