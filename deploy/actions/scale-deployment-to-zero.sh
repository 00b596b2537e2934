#!/bin/sh
# gpuledger action: scale the Deployment whose pod holds GPUs and leaves them idle to zero
# replicas (a trigger with `flag: allocated_idle` and `scope: workload`, allowed only for the
# namespaces it may touch). The Deployment is found from the pod's ReplicaSet and annotated
# with why; scale it back up to resume. Needs kubectl and RBAC to get pods and replicasets and
# to patch deployments and deployments/scale in those namespaces.
set -eu

namespace=${GPULEDGER_NAMESPACE:-}
pod=${GPULEDGER_POD:-}
# Kubernetes object names (RFC 1123): nothing else reaches kubectl.
valid() {
    printf '%s' "$1" | grep -Eq '^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$'
}
if ! valid "$namespace" || ! valid "$pod"; then
    echo "scale-deployment-to-zero: not a pod: '$namespace/$pod' (scope it to namespaces: allow: {namespaces: [...]})" >&2
    exit 2
fi

owner() {  # owner KIND OBJECT-KIND NAME: the name of NAME's owner of kind KIND
    kubectl get "$2" --namespace "$namespace" "$3" \
        -o "jsonpath={.metadata.ownerReferences[?(@.kind==\"$1\")].name}"
}
replicaset=$(owner ReplicaSet pod "$pod")
if [ -z "$replicaset" ]; then
    echo "scale-deployment-to-zero: pod $namespace/$pod has no ReplicaSet owner: not a Deployment's pod" >&2
    exit 1
fi
deployment=$(owner Deployment replicaset "$replicaset")
if [ -z "$deployment" ]; then
    echo "scale-deployment-to-zero: ReplicaSet $namespace/$replicaset has no Deployment owner" >&2
    exit 1
fi

kubectl annotate deployment --namespace "$namespace" "$deployment" --overwrite \
    "gpuledger.io/scaled-to-zero=${GPULEDGER_AT:-}: ${GPULEDGER_SUMMARY:-idle GPUs}"
echo "scaling deployment $namespace/$deployment to zero: ${GPULEDGER_SUMMARY:-}"
exec kubectl scale deployment --namespace "$namespace" "$deployment" --replicas=0
