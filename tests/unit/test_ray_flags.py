"""pscluster's --ray flags, checked before anything starts (no Ray needed)."""

from __future__ import annotations

import pytest

from psworker.cluster import _parse


def _error(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        _parse(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err


def test_ray_makes_the_workers_elastic_and_restarts_what_dies():
    args, worker_args = _parse(["--ray", "10.0.0.1:6379", "--task", "linreg", "--steps", "50"])
    assert args.ray == "10.0.0.1:6379" and args.elastic and args.restart
    assert args.host is None and worker_args == ["--steps", "50"]
    assert _parse(["--ray", "--task", "linreg"])[0].ray == ""  # a bare --ray: ray.init() finds or starts one


@pytest.mark.parametrize("argv, message", [
    (["--set-workers", "3"], "are for --ray"),
    (["--worker-resources", '{"gpu_node": 1}'], "are for --ray"),
    (["--ray", "--host", "0.0.0.0"], "leave out --host"),
    (["--ray", "--set-workers", "-1"], "--set-workers must be >= 0"),
    (["--ray", "--worker-cpus", "0"], "must be > 0"),
    (["--ray", "--shard-resources", "ps_shard"], "not JSON"),
    (["--ray", "--shard-resources", '{"ps_shard": 0}'], "positive amounts"),
    (["--ray", "--shard-resources", '["ps_shard"]'], "positive amounts"),
    (["--ray", "--worker-index", "0"], "have no static split"),
])
def test_bad_ray_flags_are_refused_naming_the_problem(capsys, argv, message):
    assert message in _error(capsys, [*argv, "--task", "linreg"])


def test_resources_are_parsed_as_amounts():
    args, _ = _parse(["--ray", "--shard-resources", '{"ps_shard": 1}', "--worker-resources", '{"gpu_node": 0.5}',
                      "--task", "linreg"])
    assert args.shard_resources == {"ps_shard": 1.0} and args.worker_resources == {"gpu_node": 0.5}
