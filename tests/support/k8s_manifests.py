"""The Kubernetes manifests in deploy/kubernetes/, read and validated offline.

Kubernetes' own kinds are validated by `kubernetes-validate` against the API's JSON
schemas for `KUBERNETES_VERSION`, in strict mode: a field the API does not define is an
error (as `kubectl apply --validate=strict` would refuse it), not silently dropped.

KEDA's ScaledObject is a custom resource that those schemas do not hold. It is validated
against `KEDA_SCALEDOBJECT_SCHEMA`, written here from KEDA 2.16's CRD
(kedacore/keda config/crd/bases/keda.sh_scaledobjects.yaml, keda.sh/v1alpha1) and its
documentation (keda.sh/docs/2.16/reference/scaledobject-spec/ and
keda.sh/docs/2.16/scalers/prometheus/). It allows a subset of the CRD's fields, each with
the CRD's type, and nothing else: stricter than KEDA (a field it lists but we do not is
refused too), never looser, so a misspelt field (which the API server would prune and
KEDA then ignore) fails here. The HPA behavior the CRD embeds is Kubernetes' own
HorizontalPodAutoscalerBehavior, taken from the same Kubernetes schemas. A `prometheus`
trigger's metadata holds only the scaler's documented parameters, each a string (the CRD
types metadata as map[string]string), including the three it requires.
"""

import copy
import json
from pathlib import Path
from typing import Any

import jsonschema
import yaml
from referencing import Registry, Resource

REPO_ROOT = Path(__file__).resolve().parents[2]
MANIFEST_DIR = REPO_ROOT / "deploy" / "kubernetes"
KUBERNETES_VERSION = "1.33.0"
K8S_DEFS = "https://kubernetes.io/api/_definitions.json#/$defs/"

_INT32 = {"type": "integer", "minimum": -(2**31), "maximum": 2**31 - 1}
_STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}

# keda.sh/docs/2.16/scalers/prometheus/: the trigger's parameters (all strings).
PROMETHEUS_TRIGGER_PARAMS = [
    "serverAddress",
    "query",
    "queryParameters",
    "threshold",
    "activationThreshold",
    "namespace",
    "customHeaders",
    "ignoreNullValues",
    "unsafeSsl",
    "authModes",
]

KEDA_SCALEDOBJECT_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "additionalProperties": False,
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "keda.sh/v1alpha1"},
        "kind": {"const": "ScaledObject"},
        "metadata": {"$ref": K8S_DEFS + "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"},
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["scaleTargetRef", "triggers"],
            "properties": {
                "scaleTargetRef": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["name"],
                    "properties": {
                        "apiVersion": {"type": "string"},
                        "kind": {"type": "string"},
                        "name": {"type": "string", "minLength": 1},
                        "envSourceContainerName": {"type": "string"},
                    },
                },
                "pollingInterval": _INT32,
                "cooldownPeriod": _INT32,
                "initialCooldownPeriod": _INT32,
                "idleReplicaCount": _INT32,
                "minReplicaCount": _INT32,
                "maxReplicaCount": _INT32,
                "fallback": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["failureThreshold", "replicas"],
                    "properties": {
                        "failureThreshold": _INT32,
                        "replicas": _INT32,
                    },
                },
                "advanced": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "restoreToOriginalReplicaCount": {"type": "boolean"},
                        "horizontalPodAutoscalerConfig": {
                            "type": "object",
                            "additionalProperties": False,
                            "properties": {
                                "name": {"type": "string"},
                                "behavior": {
                                    "$ref": K8S_DEFS
                                    + "io.k8s.api.autoscaling.v2.HorizontalPodAutoscalerBehavior"
                                },
                            },
                        },
                    },
                },
                "triggers": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "required": ["type", "metadata"],
                        "properties": {
                            "type": {"type": "string", "minLength": 1},
                            "name": {"type": "string"},
                            "useCachedMetrics": {"type": "boolean"},
                            # KEDA refuses Utilization for any scaler but cpu and memory.
                            "metricType": {"enum": ["AverageValue", "Value"]},
                            "metadata": _STRING_MAP,
                            "authenticationRef": {
                                "type": "object",
                                "additionalProperties": False,
                                "required": ["name"],
                                "properties": {
                                    "name": {"type": "string"},
                                    "kind": {
                                        "enum": [
                                            "TriggerAuthentication",
                                            "ClusterTriggerAuthentication",
                                        ]
                                    },
                                },
                            },
                        },
                        "if": {"properties": {"type": {"const": "prometheus"}}},
                        "then": {
                            "properties": {
                                "metadata": {
                                    "required": ["serverAddress", "query", "threshold"],
                                    "propertyNames": {"enum": PROMETHEUS_TRIGGER_PARAMS},
                                }
                            }
                        },
                    },
                },
            },
        },
    },
}


class UnknownKind(Exception):
    """A document of a kind neither the Kubernetes schemas nor KEDA's hold."""


def manifest_files() -> list[Path]:
    return sorted(MANIFEST_DIR.glob("*.yaml"))


def documents(path: Path) -> list[dict[str, Any]]:
    """The non-empty YAML documents of one manifest file."""
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def all_documents() -> list[tuple[str, dict[str, Any]]]:
    """(`file: Kind/name`, document) for every document of every manifest."""
    out = []
    for path in manifest_files():
        for doc in documents(path):
            out.append((f"{path.name}: {doc.get('kind')}/{doc['metadata']['name']}", doc))
    return out


def _kubernetes_definitions() -> dict[str, Any]:
    import importlib.resources

    base = importlib.resources.files("kubernetes_validate") / "kubernetes-json-schema"
    folder = f"v{KUBERNETES_VERSION}-local-strict"
    return json.loads((base / folder / "_definitions.json").read_text())


def validate_keda(doc: dict[str, Any]) -> None:
    """jsonschema.ValidationError when `doc` is not a ScaledObject KEDA 2.16 accepts."""
    definitions = Resource.from_contents(_kubernetes_definitions())
    registry = definitions @ Registry()
    validator = jsonschema.Draft202012Validator(KEDA_SCALEDOBJECT_SCHEMA, registry=registry)
    validator.validate(doc)


def validate_document(doc: dict[str, Any]) -> None:
    """Validate one manifest document (strict): jsonschema.ValidationError when it is not
    valid, UnknownKind when no schema here holds its kind."""
    import kubernetes_validate

    if doc.get("apiVersion", "").startswith("keda.sh/"):
        if doc.get("kind") != "ScaledObject":
            raise UnknownKind(f"{doc.get('apiVersion')} {doc.get('kind')}: only ScaledObject")
        validate_keda(doc)
        return
    try:
        kubernetes_validate.validate(copy.deepcopy(doc), KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.SchemaNotFoundError as exc:
        raise UnknownKind(exc.message) from None
