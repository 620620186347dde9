from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from resilient_train.cluster import ClusterInfo, ClusterSpecError, cluster_spec_json, tf_config_json

FULL = {
    "workerpool0": ["wp0-0:2222"],
    "workerpool1": ["wp1-0:2222", "wp1-1:2222", "wp1-2:2222"],
    "workerpool2": ["wp2-0:2222"],
    "workerpool3": ["wp3-0:2222", "wp3-1:2222"],
}


def spec(cluster: object, task_type: object = "workerpool0", index: object = 0) -> str:
    return json.dumps({"cluster": cluster, "task": {"type": task_type, "index": index}})


def test_standalone_defaults() -> None:
    info = ClusterInfo.from_env({})
    assert (info.rank, info.world_size, info.replica_name, info.source) == (
        0,
        1,
        "workerpool0-0",
        "standalone",
    )
    assert (info.master_addr, info.master_port) == ("127.0.0.1", 29500)
    assert info.is_primary and not info.on_platform and info.job_id is None


def test_job_id_and_restart_count() -> None:
    info = ClusterInfo.from_env({"CLOUD_ML_JOB_ID": "123", "RESILIENT_TRAIN_RESTART_COUNT": "2"})
    assert info.on_platform and info.job_id == "123" and info.restart_count == 2
    both = {"TORCHELASTIC_RESTART_COUNT": "4", "RESILIENT_TRAIN_RESTART_COUNT": "2"}
    assert ClusterInfo.from_env(both).restart_count == 4


def test_torchrun_variables() -> None:
    env = {
        "RANK": "5",
        "WORLD_SIZE": "8",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "4",
        "GROUP_RANK": "1",
        "MASTER_ADDR": "head",
        "MASTER_PORT": "1234",
    }
    info = ClusterInfo.from_env(env)
    assert (info.rank, info.world_size, info.local_rank, info.local_world_size) == (5, 8, 1, 4)
    assert (info.group_rank, info.replica_name, info.pool, info.pool_index) == (
        1,
        "workerpool1-0",
        "workerpool1",
        0,
    )
    assert (info.master_addr, info.master_port, info.source) == ("head", 1234, "torchrun")
    assert not info.is_primary


def test_torchrun_group_rank_defaults_to_rank() -> None:
    assert ClusterInfo.from_env({"RANK": "0", "WORLD_SIZE": "2"}).replica_name == "workerpool0-0"
    info = ClusterInfo.from_env({"RANK": "3", "WORLD_SIZE": "4"})
    assert (info.group_rank, info.replica_name) == (3, "workerpool1-2")


def test_torchrun_takes_name_and_master_from_cluster_spec() -> None:
    env = {"RANK": "0", "WORLD_SIZE": "2", "CLUSTER_SPEC": spec(FULL, "workerpool1", 2)}
    info = ClusterInfo.from_env(env)
    assert (info.rank, info.replica_name, info.source) == (0, "workerpool1-2", "torchrun")
    assert (info.master_addr, info.master_port) == ("wp0-0", 2222)


def test_rank_that_contradicts_the_cluster_spec_is_named(
        caplog: pytest.LogCaptureFixture) -> None:
    # A RANK=0 baked into an image makes every replica rank 0; the errors that follow (a
    # port in use, a rank that never came) point elsewhere, so this says it first.
    with caplog.at_level(logging.WARNING, logger="resilient_train.cluster"):
        ClusterInfo.from_env({"RANK": "0", "WORLD_SIZE": "2",
                              "CLUSTER_SPEC": spec(FULL, "workerpool1", 0)})
    assert "says this replica is workerpool1-0 (rank 1), but RANK=0: RANK wins" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="resilient_train.cluster"):
        ClusterInfo.from_env({"RANK": "1", "WORLD_SIZE": "2",
                              "CLUSTER_SPEC": spec(FULL, "workerpool1", 0)})
    assert caplog.text == ""


def test_lone_world_size_defers_to_cluster_spec() -> None:
    # The launcher's environment for a parameter server or evaluator: WORLD_SIZE, no RANK.
    env = {
        "WORLD_SIZE": "4",
        "MASTER_ADDR": "127.0.0.1",
        "CLUSTER_SPEC": spec(FULL, "workerpool2", 0),
    }
    info = ClusterInfo.from_env(env)
    assert (info.rank, info.replica_name, info.source) == (-1, "workerpool2-0", "cluster_spec")


def test_torchrun_ignores_malformed_cluster_spec(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="resilient_train.cluster"):
        info = ClusterInfo.from_env({"RANK": "1", "WORLD_SIZE": "2", "CLUSTER_SPEC": "{"})
    assert info.replica_name == "workerpool1-0"
    assert "CLUSTER_SPEC" in caplog.text


@pytest.mark.parametrize(
    ("env", "fragment"),
    [
        ({"RANK": "0"}, "WORLD_SIZE"),
        ({"WORLD_SIZE": "2"}, "RANK"),
        ({"RANK": "2", "WORLD_SIZE": "2"}, "below WORLD_SIZE=2"),
        ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK: expected an integer >= 0; found 'x'"),
        ({"RANK": "1_0", "WORLD_SIZE": "20"}, "RANK"),
        ({"RANK": "0", "WORLD_SIZE": "0"}, "WORLD_SIZE: expected an integer >= 1"),
        ({"MASTER_PORT": "http"}, "MASTER_PORT"),
        ({"LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"}, "LOCAL_RANK"),
        ({"TORCHELASTIC_RESTART_COUNT": "-1"}, "TORCHELASTIC_RESTART_COUNT"),
    ],
)
def test_bad_integer_variables_name_the_variable(env: dict[str, str], fragment: str) -> None:
    with pytest.raises(ClusterSpecError, match=fragment) as err:
        ClusterInfo.from_env(env)
    assert "found" in str(err.value)


def test_cluster_spec_ranks_every_pool() -> None:
    expected = {
        ("workerpool0", 0): 0,
        ("workerpool1", 0): 1,
        ("workerpool1", 2): 3,
        ("workerpool2", 0): -1,
        ("workerpool3", 1): -1,
    }
    for (pool, index), rank in expected.items():
        info = ClusterInfo.from_env({"CLUSTER_SPEC": spec(FULL, pool, index)})
        assert (info.rank, info.world_size) == (rank, 4)
        assert (info.replica_name, info.pool_index, info.source) == (
            f"{pool}-{index}",
            index,
            "cluster_spec",
        )
        assert (info.master_addr, info.master_port) == ("wp0-0", 2222)


def test_master_variables_override_derived_address() -> None:
    env = {"CLUSTER_SPEC": spec(FULL), "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "9999"}
    info = ClusterInfo.from_env(env)
    assert (info.master_addr, info.master_port) == ("10.0.0.1", 9999)


def test_cluster_spec_wins_over_tf_config() -> None:
    env = {
        "CLUSTER_SPEC": spec(FULL, "workerpool1", 0),
        "TF_CONFIG": spec({"chief": ["c:1"], "worker": ["w:1"]}, "chief", 0),
    }
    assert ClusterInfo.from_env(env).replica_name == "workerpool1-0"


@pytest.mark.parametrize(
    ("cluster", "task_type", "index", "rank", "replica"),
    [
        ({"chief": ["c:1"], "worker": ["w0:1", "w1:1"]}, "chief", 0, 0, "workerpool0-0"),
        ({"master": ["c:1"], "worker": ["w0:1", "w1:1"]}, "worker", 1, 2, "workerpool1-1"),
        ({"chief": ["c:1"], "ps": ["p:1"]}, "ps", 0, -1, "workerpool2-0"),
        ({"chief": ["c:1"], "worker": ["w0:1"]}, "evaluator", 0, -1, "workerpool3-0"),
        ({"worker": ["w0:1", "w1:1"]}, "worker", 0, 0, "workerpool1-0"),  # worker-only: w0 leads
    ],
)
def test_tf_config(cluster: dict, task_type: str, index: int, rank: int, replica: str) -> None:
    info = ClusterInfo.from_env({"TF_CONFIG": spec(cluster, task_type, index)})
    assert (info.rank, info.replica_name, info.source) == (rank, replica, "tf_config")
    assert info.master_port == 1


@pytest.mark.parametrize(
    ("raw", "fragment"),
    [
        ("not json", "CLUSTER_SPEC: expected a JSON object"),
        ("[]", "expected a JSON object"),
        (json.dumps({"task": {"type": "workerpool0", "index": 0}}), "CLUSTER_SPEC cluster:"),
        (json.dumps({"cluster": {"workerpool0": ["a:1"]}}), "CLUSTER_SPEC task:"),
        (spec({"workerpool0": ["a:1"]}, "workerpool1"), "task.type: expected a pool listed"),
        (spec({"workerpool0": ["a:1"]}, "chief"), "task.type"),
        (
            spec({"workerpool0": ["a:1"], "workerpool1": ["b:1"]}, "workerpool1", 1),
            "task.index: expected an index below 1",
        ),
        (spec({"workerpool0": ["a:1"]}, "workerpool0", -1), "task.index"),
        (spec({"workerpool0": ["a:1"]}, "workerpool0", True), "task.index"),
        (spec({"workerpool0": ["a:1"]}, "workerpool0", "0"), "task.index"),
        (spec({"workerpool0": ["a"]}), r"cluster.workerpool0\[0\]: expected a 'host:port'"),
        (spec({"workerpool0": ["a:b"]}), "integer port"),
        (spec({"workerpool0": [":1"]}), "host:port"),
        (spec({"workerpool0": ["a:0"]}), "integer port"),
        (spec({"workerpool0": "a:1"}), "cluster.workerpool0: expected a list"),
        (spec({"workerpool0": [1]}), "host:port"),
        (spec({"workerpool0": ["a:1", "b:1"]}), "exactly one address"),
        (
            spec({"workerpool1": ["a:1"]}, "workerpool1"),
            "cluster.workerpool0: expected exactly one",
        ),
        (spec({"workerpool9": ["a:1"]}, "workerpool9"), "pool names among"),
    ],
)
def test_malformed_cluster_spec(raw: str, fragment: str) -> None:
    with pytest.raises(ClusterSpecError, match=fragment) as err:
        ClusterInfo.from_env({"CLUSTER_SPEC": raw})
    message = str(err.value)
    assert message.startswith("CLUSTER_SPEC") and "; found " in message


@pytest.mark.parametrize(
    ("cluster", "task_type", "fragment"),
    [
        ({"chief": ["a:1"], "master": ["b:1"]}, "chief", "only one of 'chief' and 'master'"),
        ({"ps": ["a:1"]}, "ps", "a chief/master or at least one worker"),
        ({"chief": ["a:1"]}, "workerpool0", "task.type"),
        ({"chief": ["a:1", "b:1"]}, "chief", "cluster.chief: expected exactly one"),
    ],
)
def test_malformed_tf_config(cluster: dict, task_type: str, fragment: str) -> None:
    with pytest.raises(ClusterSpecError, match=fragment):
        ClusterInfo.from_env({"TF_CONFIG": spec(cluster, task_type)})


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-3, 5)
    | st.floats(allow_nan=False)
    | st.text(max_size=8)
    | st.sampled_from(["a:1", "h:2222", "x", "chief", "worker", "workerpool0", "workerpool1"]),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=10,
)
good_addresses = st.lists(st.sampled_from(["a:1", "b:2222", "[::1]:5"]), max_size=3)
bad_addresses = st.lists(
    st.sampled_from(["c", "d:x", ":3", "e:0", 7]) | json_values, min_size=1, max_size=2
)
POOL_KEYS = {
    "CLUSTER_SPEC": ["workerpool0", "workerpool1", "workerpool2", "workerpool3"],
    "TF_CONFIG": ["chief", "worker", "ps", "evaluator", "master"],
}


@st.composite
def near_valid(draw: st.DrawFn, var: str) -> dict:
    """Mostly well-formed, so that both outcomes (ClusterInfo and ClusterSpecError) occur."""
    keys = POOL_KEYS[var]
    cluster = {
        keys[0]: ["h:1"],
        **draw(st.dictionaries(st.sampled_from(keys), good_addresses, max_size=3)),
    }
    if draw(st.integers(0, 3)) == 0:  # break one thing
        cluster[draw(st.sampled_from([*keys, "other"]))] = draw(bad_addresses | json_values)
    task_type = draw(st.sampled_from(keys)) if draw(st.integers(0, 3)) else draw(json_values)
    index = draw(st.integers(-1, 2)) if draw(st.integers(0, 3)) else draw(json_values)
    return {"cluster": cluster, "task": {"type": task_type, "index": index}}


def _outcome(env: dict[str, str]) -> None:
    try:
        info = ClusterInfo.from_env(env)
    except ClusterSpecError:
        return
    assert info.rank == -1 or 0 <= info.rank < info.world_size
    assert 0 < info.master_port < 65536


@settings(max_examples=200, deadline=None)
@given(data=st.data(), var=st.sampled_from(["CLUSTER_SPEC", "TF_CONFIG"]))
def test_any_json_is_cluster_info_or_cluster_spec_error(data: st.DataObject, var: str) -> None:
    value = data.draw(json_values | near_valid(var))
    _outcome({var: json.dumps(value)})


@settings(max_examples=100, deadline=None)
@given(
    st.dictionaries(
        st.sampled_from(
            [
                "RANK",
                "WORLD_SIZE",
                "LOCAL_RANK",
                "LOCAL_WORLD_SIZE",
                "GROUP_RANK",
                "MASTER_PORT",
                "TORCHELASTIC_RESTART_COUNT",
                "CLUSTER_SPEC",
            ]
        ),
        st.text(max_size=6) | st.integers(-2, 5).map(str),
    )
)
def test_any_integer_variables_are_cluster_info_or_cluster_spec_error(env: dict[str, str]) -> None:
    _outcome(env)


def test_builders_round_trip_every_replica() -> None:
    training_ranks = set()
    for pool, addrs in FULL.items():
        for index in range(len(addrs)):
            cs = json.loads(cluster_spec_json(FULL, pool, index, job={"id": 7}, trial="t1"))
            assert set(cs) == {"cluster", "environment", "task", "job"}
            assert cs["environment"] == "cloud" and cs["job"] == {"id": 7}
            assert cs["task"] == {"type": pool, "index": index, "trial": "t1"}
            tf = tf_config_json(FULL, pool, index)
            assert tf is not None and "evaluator" not in json.loads(tf)["cluster"]
            from_cs = ClusterInfo.from_env({"CLUSTER_SPEC": json.dumps(cs)})
            from_tf = ClusterInfo.from_env({"TF_CONFIG": tf})
            fields = ("rank", "world_size", "replica_name", "master_addr", "master_port")
            assert [getattr(from_cs, f) for f in fields] == [getattr(from_tf, f) for f in fields]
            assert from_cs.replica_name == f"{pool}-{index}"
            if from_cs.rank >= 0:
                training_ranks.add(from_cs.rank)
    assert training_ranks == set(range(4))  # one primary + three workers, no gaps


def test_builders_omit_empty_pools_and_single_replica_tf_config() -> None:
    cluster = {"workerpool0": ["a:1"], "workerpool1": []}
    assert json.loads(cluster_spec_json(cluster, "workerpool0", 0))["cluster"] == {
        "workerpool0": ["a:1"]
    }
    assert tf_config_json(cluster, "workerpool0", 0) is None
    tf = json.loads(
        tf_config_json(
            {"workerpool0": ["a:1"], "workerpool1": ["b:1"]}, "workerpool1", 0, cloud="c"
        )
        or ""
    )
    assert tf["cluster"] == {"chief": ["a:1"], "worker": ["b:1"]}
    assert tf["task"] == {"type": "worker", "index": 0, "trial": "", "cloud": "c"}


@pytest.mark.parametrize(
    ("cluster", "task_type", "index"),
    [
        ({"workerpool0": ["a:1"]}, "workerpool1", 0),
        ({"workerpool0": ["a:1"]}, "workerpool0", 1),
        ({"workerpool0": ["a"]}, "workerpool0", 0),
        ({"workerpool0": "a:1"}, "workerpool0", 0),
        ({"chief": ["a:1"]}, "chief", 0),
    ],
)
def test_builders_reject_what_from_env_would(cluster: dict, task_type: str, index: int) -> None:
    with pytest.raises(ClusterSpecError):
        cluster_spec_json(cluster, task_type, index)
    with pytest.raises(ClusterSpecError):
        tf_config_json(cluster, task_type, index)


def test_modules_do_not_import_torch() -> None:
    code = (
        "import sys, resilient_train.cluster, resilient_train.errors; "
        "sys.exit('torch' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
