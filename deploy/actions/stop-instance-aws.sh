#!/bin/sh
# gpuledger action: stop this EC2 instance (a trigger with `flag: idle` and `scope: node`: every
# GPU of the node idle, nobody holding any, for `after`). The instance id and region come from
# the instance metadata service (IMDSv2); stopping needs the AWS CLI and an instance profile that
# allows ec2:StopInstances on this instance. Its disks are kept; start it again to resume.
set -eu

imds=${IMDS_ENDPOINT:-http://169.254.169.254}

if [ "${GPULEDGER_SCOPE:-}" != node ]; then
    echo "stop-instance-aws: acts on a whole node (scope: node), not on scope '${GPULEDGER_SCOPE:-}'" >&2
    exit 2
fi

token=$(curl -sSf -m 5 -X PUT "$imds/latest/api/token" -H "X-aws-ec2-metadata-token-ttl-seconds: 60")
meta() {
    curl -sSf -m 5 -H "X-aws-ec2-metadata-token: $token" "$imds/latest/meta-data/$1"
}
instance=$(meta instance-id)
region=$(meta placement/region)
case $instance in
    i-*) ;;
    *) echo "stop-instance-aws: the metadata service gave no instance id (got '$instance')" >&2; exit 1 ;;
esac

echo "stopping $instance in $region: ${GPULEDGER_SUMMARY:-}"
exec aws ec2 stop-instances --region "$region" --instance-ids "$instance" --output text
