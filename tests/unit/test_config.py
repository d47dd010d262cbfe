import pytest

from psserver.config import parse_args as server_args
from psworker.config import parse_args as worker_args

pytestmark = pytest.mark.timeout(60)


def test_flags_win_over_environment_which_wins_over_defaults():
    env = {"PSWORKER_STEPS": "7", "PSWORKER_LR": "0.5", "PSWORKER_AMSGRAD": "true"}
    config = worker_args(["--ps", "h:1", "--lr", "0.25"], env)
    assert (config.steps, config.lr, config.amsgrad, config.batch_size) == (7, 0.25, True, None)
    server = server_args(["--port", "7000"], {"PSSERVER_PORT": "1", "PSSERVER_THREADS": "20"})
    assert (server.port, server.threads, server.host) == (7000, 20, "127.0.0.1")


@pytest.mark.parametrize("argv, env, message", [
    (["--task", "linreg"], {}, "--ps HOST:PORT"),
    (["--ps", "h:1", "--worker-index", "2", "--num-workers", "2"], {}, "--worker-index must be in 0..1"),
    (["--ps", "h:1", "--mode", "ssp", "--backup-workers", "1"], {}, "backup workers apply to sync mode only"),
    (["--ps", "h:1"], {"PSWORKER_STEPS": "many"}, "PSWORKER_STEPS='many' is not a valid int"),
    (["--ps", "h:1", "--device", "tpu"], {}, "--device must be cpu, cuda"),
    (["--ps", "h:1", "--mode", "sync", "--overlap"], {}, "--overlap needs --mode async"),
    (["--ps", "h:1", "--num-workers", "2"], {}, "--num-workers needs --worker-index"),
    (["--ps", "h:1", "--worker-index", "0", "--data-task-size", "64"], {}, "--data-task-size must be >= 1, and is for dynamic"),
    (["--ps", "h:1", "--data-task-size", "0"], {}, "--data-task-size must be >= 1"),
    (["--ps", "h:1", "--min-workers", "-1"], {}, "--min-workers must be >= 0"),
    (["--local", "--min-workers", "2"], {}, "--min-workers must be >= 0, and is for workers of shards"),
    (["--ps", "h:1"], {"PSWORKER_PROGRESS": "bogus"}, "PSWORKER_PROGRESS='bogus' (--progress) must be one of auto, bar"),
])
def test_worker_config_errors_name_the_problem(argv, env, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        worker_args(argv, env)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--restore"], "need --checkpoint-dir"),
    (["--restore", "--checkpoint-dir", "/tmp/x"], "--restore needs --shard-index"),
    (["--checkpoint-dir", "/tmp/x", "--checkpoint-every", "soon"], "--checkpoint-every must look like"),
    (["--port", "70000"], "port must be in 0..65535"),
    (["--bulk-port", "-2"], "bulk_port must be in 0..65535, or -1"),
    (["--max-inflight-bytes", "-1"], "max_inflight_bytes must be >= 0"),
])
def test_server_config_errors_name_the_problem(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        server_args(argv, {})
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_without_a_worker_index_the_data_is_dynamic():
    dynamic = worker_args(["--ps", "h:1"], {})
    assert dynamic.dynamic and dynamic.name != "worker-0" and str(__import__("os").getpid()) in dynamic.name
    static = worker_args(["--ps", "h:1", "--worker-index", "1", "--num-workers", "3"], {})
    assert not static.dynamic and (static.index, static.count, static.name) == (1, 3, "worker-1")
    assert not worker_args(["--local"], {}).dynamic
