"""parse_cgroup: which workload owns a process, from the text of its /proc/<pid>/cgroup.

Each row is a whole file as the kernel writes it for a process placed by a real manager; the
comment says whose naming produced the shape. Ids are realistic: 36-character pod UIDs (or a
static pod's 32-hex hash) and 64-hex container ids.
"""

from __future__ import annotations

import re
from textwrap import dedent

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent.attribution.cgroup import CgroupOwner, parse_cgroup

POD = "8604b74f-c233-425a-b081-ed0ec7a31fc9"
POD_ = POD.replace("-", "_")  # how the kubelet's systemd driver escapes it in a slice name
POD2 = "c87058e0-e42a-42e9-9b7a-c8e80fde78e7"
POD2_ = POD2.replace("-", "_")
STATIC_POD = "2634d75337e2527e95c4a7439d9d6f21"  # the kubelet hashes a static pod's manifest into its UID
CTR = "3fe6841ae3ce6afaf4b8fa8cac84b3a61addb2b3ff5033b32c95528a76270c17"
CTR2 = "f457752a0acd4e902bb7543afdb1441475ad6a67751b1e9c7eac0ab450678940"
NODE_CTR = "288bf255389a4c33a4364239aeec992cdc5878abe3a41eb12aeda87686df2840"  # a kind/minikube node


def v1(text: str) -> str:
    return dedent(text).lstrip("\n")


SHAPES = [
    # --- Kubernetes, systemd cgroup driver. kubelet's cgroup_manager_linux.go turns
    # /kubepods/<qos>/pod<uid> into nested slices and escapes '-' in the uid as '_'; containerd's
    # CRI plugin asks runc for "<pod slice>:cri-containerd:<id>", which becomes a scope.
    pytest.param(
        f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{POD_}.slice/cri-containerd-{CTR}.scope\n",
        CgroupOwner("pod", pod_uid=POD, container_id=CTR, runtime="containerd"),
        id="k8s_systemd_burstable_containerd_v2",
    ),
    # Guaranteed pods have no QoS slice: they sit right under kubepods.slice.
    pytest.param(
        f"0::/kubepods.slice/kubepods-pod{POD_}.slice/cri-containerd-{CTR}.scope\n",
        CgroupOwner("pod", pod_uid=POD, container_id=CTR, runtime="containerd"),
        id="k8s_systemd_guaranteed_containerd_v2",
    ),
    # CRI-O's systemd manager names the scope crio-<id>.scope (OpenShift / RHCOS).
    pytest.param(
        f"0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{POD_}.slice/crio-{CTR}.scope\n",
        CgroupOwner("pod", pod_uid=POD, container_id=CTR, runtime="crio"),
        id="k8s_systemd_besteffort_crio_v2",
    ),
    # crun (crun(1), run.oci.systemd.subgroup) adds a "container" child below the scope on v2.
    pytest.param(
        f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{POD_}.slice/crio-{CTR}.scope/container\n",
        CgroupOwner("pod", pod_uid=POD, container_id=CTR, runtime="crio"),
        id="k8s_systemd_crio_crun_subgroup_v2",
    ),
    # Docker via dockershim / cri-dockerd with the systemd driver on cgroup v1 (CentOS 7 era):
    # every controller shows the same docker-<id>.scope.
    pytest.param(
        v1(f"""
            11:cpuacct,cpu:/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{POD_}.slice/docker-{CTR}.scope
            10:perf_event:/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{POD_}.slice/docker-{CTR}.scope
            9:pids:/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{POD_}.slice/docker-{CTR}.scope
            8:devices:/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{POD_}.slice/docker-{CTR}.scope
            7:blkio:/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{POD_}.slice/docker-{CTR}.scope
            6:memory:/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{POD_}.slice/docker-{CTR}.scope
            5:cpuset:/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{POD_}.slice/docker-{CTR}.scope
            4:net_prio,net_cls:/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{POD_}.slice/docker-{CTR}.scope
            3:hugetlb:/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{POD_}.slice/docker-{CTR}.scope
            2:freezer:/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{POD_}.slice/docker-{CTR}.scope
            1:name=systemd:/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{POD_}.slice/docker-{CTR}.scope
        """),
        CgroupOwner("pod", pod_uid=POD, container_id=CTR, runtime="docker"),
        id="k8s_systemd_docker_v1",
    ),
    # A static pod (kube-apiserver, etcd): its UID is the kubelet's 32-hex manifest hash.
    pytest.param(
        f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{STATIC_POD}.slice/cri-containerd-{CTR}.scope\n",
        CgroupOwner("pod", pod_uid=STATIC_POD, container_id=CTR, runtime="containerd"),
        id="k8s_static_pod_hash_uid",
    ),
    # CRI-O with conmon_cgroup = "pod" puts the monitor into the pod's slice next to the
    # container: still the pod's, but not a container of its own.
    pytest.param(
        f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{POD_}.slice/crio-conmon-{CTR}.scope\n",
        CgroupOwner("pod", pod_uid=POD),
        id="k8s_crio_conmon_in_pod_slice",
    ),
    # --- Kubernetes, cgroupfs driver: /kubepods/<qos>/pod<uid> with the uid as issued and the
    # container's directory named by its bare id (containerd, dockershim). GKE COS on a hybrid
    # host: the unified line shows where systemd put containerd, the v1 lines show the pod.
    pytest.param(
        v1(f"""
            12:hugetlb:/kubepods/burstable/pod{POD}/{CTR}
            11:freezer:/kubepods/burstable/pod{POD}/{CTR}
            10:devices:/kubepods/burstable/pod{POD}/{CTR}
            9:memory:/kubepods/burstable/pod{POD}/{CTR}
            8:cpuset:/kubepods/burstable/pod{POD}/{CTR}
            7:blkio:/kubepods/burstable/pod{POD}/{CTR}
            6:pids:/kubepods/burstable/pod{POD}/{CTR}
            5:net_cls,net_prio:/kubepods/burstable/pod{POD}/{CTR}
            4:perf_event:/kubepods/burstable/pod{POD}/{CTR}
            3:cpu,cpuacct:/kubepods/burstable/pod{POD}/{CTR}
            2:rdma:/
            1:name=systemd:/kubepods/burstable/pod{POD}/{CTR}
            0::/system.slice/containerd.service
        """),
        CgroupOwner("pod", pod_uid=POD, container_id=CTR),
        id="k8s_cgroupfs_burstable_hybrid",
    ),
    pytest.param(
        f"0::/kubepods/pod{POD}/{CTR}\n",
        CgroupOwner("pod", pod_uid=POD, container_id=CTR),
        id="k8s_cgroupfs_guaranteed_v2",
    ),
    # CRI-O's cgroupfs manager prefixes the directory: crio-<id> (cri-o/cri-o#812).
    pytest.param(
        f"0::/kubepods/besteffort/pod{POD}/crio-{CTR}\n",
        CgroupOwner("pod", pod_uid=POD, container_id=CTR, runtime="crio"),
        id="k8s_cgroupfs_besteffort_crio",
    ),
    # --- Kubernetes nested in a node container. kind runs the kubelet with cgroupRoot /kubelet,
    # so the systemd driver prefixes every slice with "kubelet-" (seen in containerd/nri#227).
    pytest.param(
        "0::/kubelet.slice/kubelet-kubepods.slice/kubelet-kubepods-besteffort.slice/"
        f"kubelet-kubepods-besteffort-pod{POD_}.slice/cri-containerd-{CTR}.scope\n",
        CgroupOwner("pod", pod_uid=POD, container_id=CTR, runtime="containerd"),
        id="kind_systemd_kubelet_root",
    ),
    pytest.param(
        f"0::/kubelet/kubepods/burstable/pod{POD}/{CTR}\n",
        CgroupOwner("pod", pod_uid=POD, container_id=CTR),
        id="kind_cgroupfs_kubelet_root",
    ),
    # The same kind pod read from the host: the node is a Docker container, the pod inside it
    # owns the process, and the container id is the pod's, not the node's.
    pytest.param(
        f"0::/system.slice/docker-{NODE_CTR}.scope/kubelet.slice/kubelet-kubepods.slice/"
        f"kubelet-kubepods-besteffort.slice/kubelet-kubepods-besteffort-pod{POD_}.slice/cri-containerd-{CTR}.scope\n",
        CgroupOwner("pod", pod_uid=POD, container_id=CTR, runtime="containerd"),
        id="kind_pod_seen_from_host",
    ),
    # minikube's docker driver on a v1 host running CRI-O (kubernetes/minikube#11280).
    pytest.param(
        v1(f"""
            4:memory:/docker/{NODE_CTR}/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{POD_}.slice/crio-{CTR}.scope
            3:cpu,cpuacct:/docker/{NODE_CTR}/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{POD_}.slice/crio-{CTR}.scope
            2:pids:/docker/{NODE_CTR}/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{POD_}.slice/crio-{CTR}.scope
            1:name=systemd:/docker/{NODE_CTR}/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{POD_}.slice/crio-{CTR}.scope
        """),
        CgroupOwner("pod", pod_uid=POD, container_id=CTR, runtime="crio"),
        id="minikube_docker_driver_v1",
    ),
    # A DaemonSet agent with its own cgroup namespace reads host processes' paths relative to
    # its own root: the kernel climbs out with leading "..".
    pytest.param(
        "0::/../../../kubepods.slice/kubepods-burstable.slice/"
        f"kubepods-burstable-pod{POD2_}.slice/cri-containerd-{CTR2}.scope\n",
        CgroupOwner("pod", pod_uid=POD2, container_id=CTR2, runtime="containerd"),
        id="k8s_seen_from_another_cgroup_namespace",
    ),
    # proc_cgroup_show() (kernel/cgroup/cgroup.c) marks a removed v2 cgroup "(deleted)": a
    # zombie of a pod that is being torn down.
    pytest.param(
        f"0::/kubepods.slice/kubepods-pod{POD_}.slice/cri-containerd-{CTR}.scope (deleted)\n",
        CgroupOwner("pod", pod_uid=POD, container_id=CTR, runtime="containerd"),
        id="k8s_deleted_cgroup",
    ),
    # Slinky (SchedMD's slurm-operator) runs slurmd in a pod; the job's cgroup is inside the
    # pod's container. The pod is the owner and the job comes along.
    pytest.param(
        f"0::/kubepods.slice/kubepods-pod{POD_}.slice/cri-containerd-{CTR}.scope/"
        "system.slice/slurmstepd.scope/job_4242/step_0/user/task_0\n",
        CgroupOwner(
            "pod",
            pod_uid=POD,
            container_id=CTR,
            runtime="containerd",
            slurm_job="4242",
            slurm_step="0",
            job_nested=True,
        ),
        id="slinky_slurm_job_inside_pod",
    ),
    # --- Slurm, cgroup/v1 (proctrack/cgroup + task/cgroup): slurm/uid_<uid>/job_<id>/step_<step>/
    # task_<n> in each controller Slurm uses; systemd still has slurmd's service in name=systemd.
    pytest.param(
        v1("""
            11:cpuset:/slurm/uid_1000/job_1234/step_0/task_0
            10:memory:/slurm/uid_1000/job_1234/step_0/task_0
            9:devices:/slurm/uid_1000/job_1234/step_0/task_0
            8:freezer:/slurm/uid_1000/job_1234/step_0
            7:cpu,cpuacct:/system.slice/slurmd.service
            6:pids:/system.slice/slurmd.service
            1:name=systemd:/system.slice/slurmd.service
        """),
        CgroupOwner("slurm", slurm_job="1234", slurm_step="0", uid=1000),
        id="slurm_v1_task",
    ),
    # --enable-multiple-slurmd puts each node's tree under slurm_<nodename>; batch scripts run
    # in step_batch.
    pytest.param(
        v1("""
            5:memory:/slurm_node01/uid_1000/job_1234/step_batch
            4:freezer:/slurm_node01/uid_1000/job_1234/step_batch
            1:name=systemd:/system.slice/slurmd-node01.service
        """),
        CgroupOwner("slurm", slurm_job="1234", slurm_step="batch", uid=1000),
        id="slurm_v1_multiple_slurmd_batch",
    ),
    # --- Slurm, cgroup/v2 plugin (slurm.schedmd.com/cgroup_v2.html): slurmd starts
    # system.slice/slurmstepd.scope and builds job_<id>/step_<step>/user/task_<n> inside it.
    pytest.param(
        "0::/system.slice/slurmstepd.scope/job_1234/step_0/user/task_0\n",
        CgroupOwner("slurm", slurm_job="1234", slurm_step="0"),
        id="slurm_v2_task",
    ),
    pytest.param(
        "0::/system.slice/node01_slurmstepd.scope/job_77/step_extern/user/task_0\n",
        CgroupOwner("slurm", slurm_job="77", slurm_step="extern"),
        id="slurm_v2_multiple_slurmd_extern",
    ),
    # The step's own slurmstepd lives in step_<step>/slurm: it is the job's too.
    pytest.param(
        "0::/system.slice/slurmstepd.scope/job_3385/step_interactive/slurm\n",
        CgroupOwner("slurm", slurm_job="3385", slurm_step="interactive"),
        id="slurm_v2_stepd_of_interactive_step",
    ),
    # The "slurmstepd infinity" keeper waits in slurmstepd.scope/system: no job's.
    pytest.param("0::/system.slice/slurmstepd.scope/system\n", None, id="slurm_v2_stepd_waiting_area"),
    pytest.param(
        "0::/system.slice/slurmd.service\n",
        CgroupOwner("service", unit="slurmd.service"),
        id="slurmd_itself_is_a_service",
    ),
    # The slurm-docker-cluster shape: Slurm inside a Docker container, seen from the host.
    pytest.param(
        f"0::/system.slice/docker-{NODE_CTR}.scope/system.slice/slurmstepd.scope/job_9/step_batch/user/task_0\n",
        CgroupOwner(
            "slurm", container_id=NODE_CTR, runtime="docker", slurm_job="9", slurm_step="batch", job_nested=True
        ),
        id="slurm_inside_docker_container",
    ),
    # The other way round: a job's step that starts a container of its own (rootless Podman under
    # the job's task). The job was there first: its directories are slurmd's, not the container's.
    pytest.param(
        f"0::/system.slice/slurmstepd.scope/job_9/step_0/user/task_0/libpod-{NODE_CTR}.scope\n",
        CgroupOwner("slurm", container_id=NODE_CTR, runtime="podman", slurm_job="9", slurm_step="0"),
        id="container_inside_slurm_job",
    ),
    # A directory called job_<n> is a Slurm job only below Slurm's own root.
    pytest.param(
        "0::/system.slice/batch-runner.service/job_1234/step_0\n",
        CgroupOwner("service", unit="batch-runner.service"),
        id="job_dir_outside_slurm_is_not_slurm",
    ),
    # --- Docker. cgroupfs driver on v1: /docker/<id> in every controller.
    pytest.param(
        v1(f"""
            12:blkio:/docker/{CTR}
            11:memory:/docker/{CTR}
            10:cpu,cpuacct:/docker/{CTR}
            9:devices:/docker/{CTR}
            8:freezer:/docker/{CTR}
            7:net_cls,net_prio:/docker/{CTR}
            6:perf_event:/docker/{CTR}
            5:pids:/docker/{CTR}
            4:cpuset:/docker/{CTR}
            3:hugetlb:/docker/{CTR}
            2:rdma:/
            1:name=systemd:/docker/{CTR}
            0::/system.slice/containerd.service
        """),
        CgroupOwner("container", container_id=CTR, runtime="docker"),
        id="docker_cgroupfs_v1",
    ),
    # systemd driver (the default on cgroup v2): system.slice/docker-<id>.scope.
    pytest.param(
        f"0::/system.slice/docker-{CTR}.scope\n",
        CgroupOwner("container", container_id=CTR, runtime="docker"),
        id="docker_systemd_v2",
    ),
    # A container that runs systemd: its services are the container's.
    pytest.param(
        f"0::/system.slice/docker-{CTR}.scope/system.slice/nginx.service\n",
        CgroupOwner("container", container_id=CTR, runtime="docker"),
        id="docker_container_running_systemd",
    ),
    # Docker-in-Docker on cgroupfs: the inner container is the one running the process.
    pytest.param(
        f"0::/docker/{NODE_CTR}/docker/{CTR}\n",
        CgroupOwner("container", container_id=CTR, runtime="docker"),
        id="docker_in_docker",
    ),
    # --- Podman. Rootful, systemd manager: machine.slice/libpod-<id>.scope, and crun's
    # "container" sub-cgroup on v2.
    pytest.param(
        f"0::/machine.slice/libpod-{CTR}.scope/container\n",
        CgroupOwner("container", container_id=CTR, runtime="podman"),
        id="podman_rootful_v2",
    ),
    # A Podman pod is a slice of Podman's, not a Kubernetes pod.
    pytest.param(
        f"0::/machine.slice/machine-libpod_pod_{CTR2}.slice/libpod-{CTR}.scope/container\n",
        CgroupOwner("container", container_id=CTR, runtime="podman"),
        id="podman_pod_is_not_a_kubernetes_pod",
    ),
    # Rootless: under the user's systemd manager (user@<uid>.service), which says whose it is.
    pytest.param(
        f"0::/user.slice/user-1000.slice/user@1000.service/user.slice/libpod-{CTR}.scope\n",
        CgroupOwner("container", container_id=CTR, runtime="podman", uid=1000),
        id="podman_rootless",
    ),
    # Below user@<uid>.service the tree is delegated to the user, who can make any directory
    # there: a pod, a Slurm job or another user named in it is her claim, not the owner.
    pytest.param(
        f"0::/user.slice/user-1000.slice/user@1000.service/kubepods.slice/kubepods-pod{POD_}.slice/x.scope\n",
        CgroupOwner("user", uid=1000),
        id="pod_slice_made_in_a_users_own_tree",
    ),
    pytest.param(
        "0::/user.slice/user-1000.slice/user@1000.service/kubepods/burstable/pod" + POD + "/x\n",
        CgroupOwner("user", uid=1000),
        id="pod_dir_made_in_a_users_own_tree",
    ),
    pytest.param(
        "0::/user.slice/user-1000.slice/user@1000.service/slurmstepd.scope/job_4242/step_0/user/task_0\n",
        CgroupOwner("user", uid=1000),
        id="slurm_job_made_in_a_users_own_tree",
    ),
    pytest.param(
        "0::/user.slice/user-1000.slice/user@1000.service/app.slice/user-0.slice/user@0.service/x.scope\n",
        CgroupOwner("user", uid=1000),
        id="other_user_made_in_a_users_own_tree",
    ),
    pytest.param(
        "0::/user.slice/user-1000.slice/user@1000.service/app.slice/user@0.service\n",
        CgroupOwner("user", uid=1000),
        id="other_manager_made_in_a_users_own_tree",
    ),
    # conmon watches a container from a scope of its own: outside a pod that names no container,
    # only the user whose tree it is.
    pytest.param(
        f"0::/user.slice/user-1000.slice/user@1000.service/user.slice/libpod-conmon-{CTR}.scope\n",
        CgroupOwner("user", uid=1000),
        id="podman_rootless_conmon",
    ),
    pytest.param(f"0::/machine.slice/libpod-conmon-{CTR}.scope\n", None, id="podman_rootful_conmon"),
    # CRI-O with conmon_cgroup = "system.slice" (openshift/microshift#697, before the fix).
    pytest.param(f"0::/system.slice/crio-conmon-{CTR}.scope\n", None, id="crio_conmon_in_system_slice"),
    # Podman's cgroupfs manager: /libpod_parent/libpod-<id>.
    pytest.param(
        v1(f"""
            5:memory:/libpod_parent/libpod-{CTR}
            4:pids:/libpod_parent/libpod-{CTR}
            1:name=systemd:/libpod_parent/libpod-{CTR}
        """),
        CgroupOwner("container", container_id=CTR, runtime="podman"),
        id="podman_cgroupfs_v1",
    ),
    # --- containerd without Kubernetes. A CRI sandbox given a plain systemd parent
    # (containerd/cri#290) and nerdctl's "system.slice:nerdctl:<id>".
    pytest.param(
        f"0::/system.slice/system-getty.slice/cri-containerd-{CTR}.scope\n",
        CgroupOwner("container", container_id=CTR, runtime="containerd"),
        id="containerd_cri_scope_outside_kubepods",
    ),
    pytest.param(
        f"0::/system.slice/nerdctl-{CTR}.scope\n",
        CgroupOwner("container", container_id=CTR, runtime="containerd"),
        id="nerdctl",
    ),
    # --- systemd (systemd.slice(5), systemd.unit(5)): services under system.slice, template
    # instances under system-<template>.slice.
    pytest.param(
        "0::/system.slice/ollama.service\n",
        CgroupOwner("service", unit="ollama.service"),
        id="systemd_service",
    ),
    pytest.param(
        "0::/system.slice/system-triton.slice/triton@0.service\n",
        CgroupOwner("service", unit="triton@0.service"),
        id="systemd_template_instance",
    ),
    pytest.param(
        v1("""
            12:pids:/system.slice/system-getty.slice/getty@tty1.service
            11:memory:/system.slice/system-getty.slice/getty@tty1.service
            4:cpu,cpuacct:/
            1:name=systemd:/system.slice/system-getty.slice/getty@tty1.service
        """),
        CgroupOwner("service", unit="getty@tty1.service"),
        id="systemd_getty_v1",
    ),
    # A user's own service under their manager.
    pytest.param(
        "0::/user.slice/user-1000.slice/user@1000.service/app.slice/ollama.service\n",
        CgroupOwner("service", unit="ollama.service", uid=1000),
        id="systemd_user_service",
    ),
    # --- Users (systemd-logind): a login session on a hybrid host (Ubuntu 20.04) ...
    pytest.param(
        v1("""
            12:memory:/user.slice/user-1000.slice/session-3.scope
            11:pids:/user.slice/user-1000.slice/session-3.scope
            5:cpu,cpuacct:/user.slice
            1:name=systemd:/user.slice/user-1000.slice/session-3.scope
            0::/user.slice/user-1000.slice/session-3.scope
        """),
        CgroupOwner("user", uid=1000),
        id="user_session_hybrid",
    ),
    # root logs in too: uid 0 is a user like any other.
    pytest.param(
        "0::/user.slice/user-0.slice/session-1.scope\n",
        CgroupOwner("user", uid=0),
        id="root_session",
    ),
    # ... the user's manager itself (user@<uid>.service marks the user, it is no workload) ...
    pytest.param(
        "0::/user.slice/user-1001.slice/user@1001.service/init.scope\n",
        CgroupOwner("user", uid=1001),
        id="user_manager",
    ),
    # ... and a desktop app scope (from Slurm's cgroup_v2 troubleshooting notes).
    pytest.param(
        "0::/user.slice/user-1000.slice/user@1000.service/app.slice/app-gnome-tmaster-47247.scope\n",
        CgroupOwner("user", uid=1000),
        id="user_desktop_app",
    ),
    # --- Nobody's.
    pytest.param("0::/\n", None, id="root_cgroup"),
    pytest.param("0::/init.scope\n", None, id="init_scope"),
    pytest.param("", None, id="empty"),
    pytest.param("not a cgroup file\n\x00\x01", None, id="garbage"),
    # A kernel thread on v1: every hierarchy at its root.
    pytest.param(
        v1("""
            12:pids:/
            11:memory:/
            1:name=systemd:/
        """),
        None,
        id="kernel_thread_v1",
    ),
    # A daemon moved into the bare slice (kontena/pharos-cluster#440): no unit names it.
    pytest.param(
        v1("""
            11:cpuacct,cpu:/system.slice
            6:memory:/system.slice
            1:name=systemd:/system.slice
        """),
        None,
        id="bare_system_slice_v1",
    ),
    # A path merely shaped like a pod outside kubepods (cgroupfs needs the kubepods parent).
    pytest.param(f"0::/system.slice/pod{POD}\n", None, id="pod_dir_outside_kubepods"),
]


@pytest.mark.parametrize(("text", "owner"), SHAPES)
def test_shapes(text: str, owner: CgroupOwner | None) -> None:
    assert parse_cgroup(text) == owner


def test_a_pod_on_any_v1_line_beats_a_container_or_service_on_another() -> None:
    text = v1(f"""
        3:memory:/system.slice/docker-{CTR2}.scope
        2:pids:/kubepods/besteffort/pod{POD}/{CTR}
        1:name=systemd:/system.slice/kubelet.service
    """)
    assert parse_cgroup(text) == CgroupOwner("pod", pod_uid=POD, container_id=CTR)


def test_between_lines_of_one_kind_the_deeper_path_wins() -> None:
    text = v1(f"""
        2:memory:/docker/{NODE_CTR}
        1:name=systemd:/docker/{NODE_CTR}/docker/{CTR}
    """)
    assert parse_cgroup(text) == CgroupOwner("container", container_id=CTR, runtime="docker")


def test_the_pod_uid_is_lower_case_with_dashes() -> None:
    text = f"0::/kubepods.slice/kubepods-pod{POD_.upper()}.slice\n"
    assert parse_cgroup(text) == CgroupOwner("pod", pod_uid=POD)


def test_a_user_manager_with_an_impossible_uid_is_neither_user_nor_service() -> None:
    assert parse_cgroup("0::/user.slice/user@99999999999.service\n") is None


def test_windows_line_endings_and_no_final_newline() -> None:
    assert parse_cgroup("0::/system.slice/ollama.service\r") == CgroupOwner("service", unit="ollama.service")


# --- Properties ---------------------------------------------------------------------------------

HEX64 = st.text("0123456789abcdef", min_size=64, max_size=64)
UUID = st.uuids().map(str)
DIGITS = st.text("0123456789", min_size=1, max_size=12)
# Real path words, and the odd empty or dot segment, mixed with generated ids and junk.
KUBE_WORDS = ("kubepods", "kubepods.slice", "kubepods-burstable.slice", "burstable", "besteffort", "kubelet", "pod")
SLURM_WORDS = (
    "slurm",
    "slurm_node01",
    "slurmstepd.scope",
    "node01_slurmstepd.scope",
    "system",
    "user",
    "job_",
    "step_",
)
SYSTEMD_WORDS = ("system.slice", "user.slice", "machine.slice", "init.scope", "session-3.scope", "user-.slice", "uid_")
OTHER_WORDS = ("docker", "libpod_parent", "container", "..", ".", "")
SEGMENT = st.one_of(
    st.sampled_from((*KUBE_WORDS, *SLURM_WORDS, *SYSTEMD_WORDS, *OTHER_WORDS)),
    UUID.map(lambda u: f"kubepods-burstable-pod{u.replace('-', '_')}.slice"),
    UUID.map(lambda u: f"kubelet-kubepods-pod{u.replace('-', '_')}.slice"),
    UUID.map(lambda u: f"pod{u}"),
    UUID.map(lambda u: f"pod{u.upper()}"),
    st.builds(
        "{}-{}{}".format,
        st.sampled_from(["cri-containerd", "crio", "docker", "libpod", "nerdctl", "crio-conmon", "libpod-conmon"]),
        HEX64,
        st.sampled_from([".scope", ""]),
    ),
    HEX64,
    DIGITS.map("job_{}".format),
    # Slurm's roots with a job below them, so that Slurm owners turn up as often as the others.
    st.builds(
        "{}/{}job_{}/step_{}".format,
        st.sampled_from(["slurmstepd.scope", "node01_slurmstepd.scope", "slurm", "slurm_node01"]),
        st.sampled_from(["", "uid_1000/", "uid_0042/"]),
        DIGITS,
        st.sampled_from(["0", "batch", "extern"]),
    ),
    st.sampled_from(["0", "batch", "extern", "interactive"]).map("step_{}".format),
    DIGITS.map("uid_{}".format),
    DIGITS.map("user-{}.slice".format),
    DIGITS.map("user@{}.service".format),
    st.from_regex(r"[a-z][a-z0-9@_-]{0,12}\.service", fullmatch=True),
    st.text(max_size=20),
)
LINE = st.builds(
    "{}:{}:/{}".format,
    st.sampled_from(["0", "1", "4", "12", "x", ""]),
    st.sampled_from(["", "memory", "name=systemd", "cpu,cpuacct", ":"]),
    st.lists(SEGMENT, max_size=10).map("/".join),
)
CGROUP_TEXT = st.lists(LINE, max_size=6).map("\n".join)


@given(st.text())
def test_any_text_parses_without_raising(text: str) -> None:
    parse_cgroup(text)


@given(st.binary())
def test_binary_junk_parses_without_raising(data: bytes) -> None:
    parse_cgroup(data.decode("utf-8", errors="surrogateescape"))
    parse_cgroup(data.decode("latin-1"))


@given(CGROUP_TEXT)
def test_cgroup_shaped_text_never_yields_an_invented_owner(text: str) -> None:
    owner = parse_cgroup(text)
    if owner is None:
        return
    # The owner's kind always comes with the id that makes it that kind.
    assert {
        "pod": owner.pod_uid,
        "slurm": owner.slurm_job,
        "container": owner.container_id,
        "service": owner.unit,
        "user": owner.uid,
    }[owner.kind] is not None
    if owner.pod_uid is not None:
        assert f"pod{owner.pod_uid}" in text.lower().replace("_", "-")
    if owner.container_id is not None:
        assert owner.container_id in text
    if owner.runtime is not None:
        assert owner.runtime in {"containerd", "crio", "docker", "podman"}
        assert owner.container_id is not None
    if owner.slurm_job is not None:
        assert f"job_{owner.slurm_job}" in text
    if owner.slurm_step is not None:
        assert f"/step_{owner.slurm_step}" in text
    if owner.unit is not None:
        assert f"/{owner.unit}" in text
        assert owner.kind == "service"
        assert not re.fullmatch(r"user@[0-9]+\.service", owner.unit)
    if owner.uid is not None:
        assert re.search(rf"/(user-0*{owner.uid}\.slice|user@0*{owner.uid}\.service|uid_0*{owner.uid})(?=/|\n|$)", text)


@given(CGROUP_TEXT, st.lists(st.sampled_from(["0::/", "2:rdma:/", "1:name=systemd:/init.scope", "junk"])))
def test_lines_that_name_nobody_change_nothing(text: str, noise: list[str]) -> None:
    assert parse_cgroup("\n".join([*noise, text, *noise])) == parse_cgroup(text)
