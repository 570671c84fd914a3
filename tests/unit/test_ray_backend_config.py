"""The Ray backends' settings (vLLM's flag names): refused with the install command when Ray is missing, refused by
name when unknown, and Ray imported only by a process that places something on a cluster."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from banyan import LLM
from banyan.config import ParallelConfig
from banyan.config_args import config_from_kwargs
from banyan.distributed import ray_cluster
from banyan.errors import InvalidParameterError
from banyan.registry import UnknownChoiceError

ROOT = Path(__file__).resolve().parents[2]


def run_fresh(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT,
                         check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip()


@pytest.mark.parametrize("setting", ["data_parallel_backend", "distributed_executor_backend"])
def test_a_ray_backend_without_ray_names_the_install_command(setting):
    code = ("import sys; sys.modules['ray'] = None  # as if Ray were not installed\n"
            "from banyan.config_args import config_from_kwargs\nfrom banyan.errors import InvalidParameterError\n"
            f"try:\n    config_from_kwargs({{'{setting}': 'ray'}})\n"
            "except InvalidParameterError as e:\n    print(e)")  # fmt: skip
    refused = run_fresh(code)
    assert refused == f"{setting}: 'ray' needs the Ray package, which is not installed: pip install 'banyan[ray]'"


def test_the_cli_flags_are_vllms_and_local_processes_stay_the_default():
    config = config_from_kwargs({"data_parallel_size": 2})
    assert (config.parallel.data_parallel_backend, config.parallel.distributed_executor_backend) == ("mp", "mp")
    assert not config.parallel.on_ray
    code = "from banyan.cli import main\ntry:\n    main(['serve', '--help'])\nexcept SystemExit:\n    pass"
    help_text = run_fresh(code)
    for flag in ("--data-parallel-backend", "--distributed-executor-backend", "--ray-address"):
        assert flag in help_text


def test_the_offline_api_refuses_ray_replicas_it_would_not_run():
    with pytest.raises(InvalidParameterError, match="data_parallel_backend: replicas are served by `banyan serve`"):
        LLM("unused", data_parallel_backend="ray")


def test_an_unknown_backend_is_refused_by_name():
    with pytest.raises(UnknownChoiceError, match="distributed_executor_backend: unknown 'slurm'; choose from mp, ray"):
        ParallelConfig(distributed_executor_backend="slurm")


def test_the_server_and_the_engine_client_do_not_import_ray():
    code = ("import sys, banyan.server, banyan.ipc.client, banyan.ipc.dp_client, banyan.runner.worker\n"
            "print('ray' in sys.modules)")
    assert run_fresh(code) == "False"


def test_a_ray_client_address_is_refused_with_the_reason_before_ray_is_joined(monkeypatch):
    """ray:// (Ray Client) runs the driver off the cluster; the cores banyan places connect back to the server's node."""
    with pytest.raises(InvalidParameterError, match=r"ray_address: ray:// \(Ray Client\) addresses are not supported"):
        config_from_kwargs({"data_parallel_backend": "ray", "ray_address": "ray://head:10001"})
    monkeypatch.setenv("RAY_ADDRESS", "ray://head:10001")  # from the environment: refused where it is read
    with pytest.raises(InvalidParameterError, match="RAY_ADDRESS: .* give the cluster's GCS address host:port"):
        ray_cluster.connect(None)
    assert run_fresh("import banyan.distributed.ray_cluster as r, sys, os\nos.environ['RAY_ADDRESS'] = 'ray://h:1'\n"
                     "try:\n    r.connect(None)\nexcept Exception as e:\n    print(type(e).__name__, 'ray' in sys.modules)"
                     ) == "InvalidParameterError False"  # refused before Ray is imported, let alone joined
