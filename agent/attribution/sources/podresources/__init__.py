"""The kubelet's pod-resources v1 API (``api.proto``) and the Python modules protoc generates from it.

``api_pb2.py``, ``api_pb2.pyi`` and ``api_pb2_grpc.py`` are generated: never edit them by hand.
After changing ``api.proto``, regenerate all three from the repository root::

    python -m grpc_tools.protoc -I . --python_out=. --pyi_out=. --grpc_python_out=. \\
        agent/attribution/sources/podresources/api.proto

(``-I .`` with the proto's path from the root is what makes the generated gRPC module import
``from agent.attribution.sources.podresources import api_pb2``.) Only
``agent.attribution.sources.kubelet`` and the fake kubelet in ``fake_nvml.podresources`` use them.
"""
