#!/usr/bin/env python3
"""What kubectl and the schemas do not check in a rendered overlay: every
selector selects the relays' pods, the ServiceMonitor finds the Service and
its port, the probes name ports that exist, and the termination grace covers
the relay's own shutdown, read from the overlay's switchyard.toml.

    k8s-check.py RENDERED.yaml OVERLAY/switchyard.toml

Prints one line per object it checked; exits 1 naming every fault."""
import math
import sys
import tomllib

import yaml

rendered, config_path = sys.argv[1], sys.argv[2]
docs = [d for d in yaml.safe_load_all(open(rendered)) if d]
with open(config_path, "rb") as f:
    config = tomllib.load(f)
faults = []


def of_kind(kind):
    return [d for d in docs if d.get("kind") == kind]


def selects(selector, labels):
    """A LabelSelector selects `labels`; an empty or missing one selects
    nothing here: for a PodDisruptionBudget or a ServiceMonitor that is the
    fault this check exists for."""
    match = (selector or {}).get("matchLabels") or {}
    expressions = (selector or {}).get("matchExpressions") or []
    if not match and not expressions:
        return False
    if any(labels.get(k) != v for k, v in match.items()):
        return False
    for e in expressions:
        value, op, values = labels.get(e["key"]), e["operator"], e.get("values") or []
        if (op == "In" and value not in values) or (op == "NotIn" and value in values):
            return False
        if (op == "Exists" and value is None) or (op == "DoesNotExist" and value is not None):
            return False
    return True


deployments = of_kind("Deployment")
if len(deployments) != 1:
    faults.append(f"expected one Deployment, found {len(deployments)}")
    deployment = {"metadata": {}, "spec": {"template": {"metadata": {}, "spec": {"containers": [{}]}}}}
else:
    deployment = deployments[0]
pod = deployment["spec"]["template"]
pod_labels = pod["metadata"].get("labels") or {}
pod_spec = pod["spec"]
container = pod_spec["containers"][0]
ports = {p.get("name") for p in container.get("ports") or []} | {p.get("containerPort") for p in container.get("ports") or []}

if not selects(deployment["spec"].get("selector"), pod_labels):
    faults.append("the Deployment's selector does not select its own pods")

budgets = of_kind("PodDisruptionBudget")
if not budgets:
    faults.append("no PodDisruptionBudget")
for budget in budgets:
    if not selects(budget["spec"].get("selector"), pod_labels):
        faults.append(f"PodDisruptionBudget {budget['metadata']['name']} selects none of the relays' pods: a drain may evict them all")
    elif budget["spec"].get("maxUnavailable") != 1:
        faults.append("the PodDisruptionBudget lets a drain take more than one relay")
    else:
        print(f"  PodDisruptionBudget selects the relays ({pod_labels}), maxUnavailable 1")

for constraint in pod_spec.get("topologySpreadConstraints") or []:
    if not selects(constraint.get("labelSelector"), pod_labels):
        faults.append(f"the spread over {constraint.get('topologyKey')} counts none of the relays' pods")
if not any(c.get("topologyKey") == "kubernetes.io/hostname" for c in pod_spec.get("topologySpreadConstraints") or []):
    faults.append("nothing spreads the relays over nodes")

services = of_kind("Service")
for service in services:
    # A Service's selector is a plain map of labels, not a LabelSelector.
    if not selects({"matchLabels": service["spec"].get("selector")}, pod_labels):
        faults.append(f"Service {service['metadata']['name']} selects none of the relays' pods")
for monitor in of_kind("ServiceMonitor"):
    matched = [s for s in services if selects(monitor["spec"].get("selector"), s["metadata"].get("labels") or {})]
    if not matched:
        faults.append("the ServiceMonitor's selector matches no Service")
    for endpoint in monitor["spec"].get("endpoints") or []:
        if not any(endpoint.get("port") in {p.get("name") for p in s["spec"]["ports"]} for s in matched):
            faults.append(f"the ServiceMonitor scrapes port {endpoint.get('port')!r}, which its Service does not name")
    if not faults:
        print("  ServiceMonitor selects the Service and its admin port")

for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
    spec = container.get(probe)
    if spec is None:
        faults.append(f"no {probe}: " + {
            "startupProbe": "liveness may kill a relay still compiling a plugin",
            "livenessProbe": "a wedged relay is never restarted",
            "readinessProbe": "an unready relay looks ready",
        }[probe])
    elif spec.get("httpGet", {}).get("port") not in ports:
        faults.append(f"the {probe} asks port {spec['httpGet'].get('port')!r}, which the container does not name")
startup = container.get("startupProbe") or {}
if startup and startup.get("periodSeconds", 10) * startup.get("failureThreshold", 3) < 120:
    faults.append("the startupProbe gives a relay less than 2 minutes to compile its plugins")

# The relay stops claiming at SIGTERM, waits up to shutdown_timeout_ms for
# in-flight batches, each bounded by publish_timeout_ms, then records what
# was published: the kubelet's SIGKILL must come after all of it.
relay = config.get("relay", {})
needed = math.ceil((relay.get("shutdown_timeout_ms", 15000) + relay.get("publish_timeout_ms", 10000)) / 1000) + 5
grace = pod_spec.get("terminationGracePeriodSeconds", 30)
if grace < needed:
    faults.append(
        f"terminationGracePeriodSeconds is {grace}; shutdown_timeout_ms + publish_timeout_ms + 5 s "
        f"in {config_path} needs at least {needed}"
    )
else:
    print(f"  termination grace {grace} s covers shutdown + publish timeout + 5 s ({needed} s)")

for fault in faults:
    print(f"k8s-check: {rendered}: {fault}", file=sys.stderr)
sys.exit(1 if faults else 0)
