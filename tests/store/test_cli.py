from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from kvblend.store import DiskStore, RedisStore
from kvblend.commands.store import cmd_store
from kvblend.store.cli import add_store_commands
from kvblend.store.localredis import LocalRedis, LocalRedisCluster

from tests.store.helpers import keyed


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    """``kvblend store ARGV`` as the command line runs it (locations not given from the settings)."""
    parser = argparse.ArgumentParser(prog="kvblend")
    add_store_commands(parser.add_subparsers(dest="command", required=True), run=cmd_store)
    args = parser.parse_args(["store", *argv])
    code = args.func(args)
    out = capsys.readouterr()
    return code, out.out + out.err


@pytest.fixture
def filled(tmp_path: Path, redis_server: LocalRedis, redis_prefix: str) -> list[str]:
    disk = DiskStore(tmp_path, 1 << 30)
    remote = RedisStore(redis_server.url, 1 << 30, prefix=redis_prefix)
    for i in range(3):
        for tier in (disk, remote):
            tier.put(*keyed(i, tenant="alice"))
    bob_key, bob_chunk = keyed(7, tenant="bob")
    disk.put(bob_key, bob_chunk)
    remote.close()
    return ["--disk-dir", str(tmp_path), "--redis-url", redis_server.url, "--redis-prefix", redis_prefix]


def test_plan_prints_smollm2_numbers(capsys: pytest.CaptureFixture[str]) -> None:
    code, out = run(capsys, "plan", "--budget", "10GiB", "--chunk-tokens", "512")  # the default: fp16
    assert code == 0 and "KV per token: 23040 bytes" in out and "x fp16)" in out and "910 chunks" in out
    code, out = run(capsys, "plan", "--budget", "10GiB", "--chunk-tokens", "512", "--dtype", "fp32")
    assert code == 0 and "KV per token: 46080 bytes" in out and "455 chunks" in out
    code, out = run(capsys, "plan", "--budget", "10GiB", "--chunk-tokens", "512", "--dtype", "int8")
    assert code == 0 and "KV per token: 12240 bytes" in out and "fp32 scales" in out and "1713 chunks" in out


def test_stats_and_ls_are_tenant_scoped(capsys: pytest.CaptureFixture[str], filled: list[str]) -> None:
    code, out = run(capsys, "stats", *filled, "--tenant", "alice")
    assert code == 0 and "disk     entries        3" in out and "redis    entries        3" in out
    code, out = run(capsys, "ls", *filled, "--tenant", "bob")
    bob_digest = keyed(7, tenant="bob")[0].digest
    assert code == 0 and out.count("\n") == 1 and bob_digest in out
    assert keyed(0, tenant="alice")[0].digest not in out


def test_evict_and_clear_touch_only_the_tenant(capsys: pytest.CaptureFixture[str], filled: list[str],
                                               tmp_path: Path) -> None:
    alice = [keyed(i, tenant="alice")[0] for i in range(3)]
    code, out = run(capsys, "evict", *filled, "--tenant", "alice", "--key", alice[0].digest)
    assert code == 0 and "evicted 1 entries" in out
    code, out = run(capsys, "evict", *filled, "--tenant", "alice", "--to-bytes", "0")
    assert code == 0 and "evicted 4 entries" in out  # two left in each of two tiers
    code, out = run(capsys, "clear", *filled, "--tenant", "bob")
    assert "cleared 1 entries of tenant bob" in out
    assert DiskStore(tmp_path, 1 << 30).stats().entries == 0


def test_bad_invocations_fail_cleanly(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVBLEND_HOME", str(tmp_path / "home"))  # no store there: nothing to default to
    code, out = run(capsys, "stats")  # a fresh install: the settings' folder is not there yet
    assert code == 1 and f"nothing stored yet: the settings' disk folder {tmp_path / 'home' / 'kv'}" in out
    assert not (tmp_path / "home").exists()  # a command that reads creates nothing
    monkeypatch.setenv("KVBLEND_STORE__TIERS", '["memory"]')
    assert run(capsys, "stats")[0] == 2  # no location at all
    assert run(capsys, "stats", "--disk-dir", str(tmp_path / "missing"))[0] == 2
    assert not (tmp_path / "missing").exists()
    assert run(capsys, "evict", "--disk-dir", str(tmp_path))[0] == 2  # nothing to evict given
    assert run(capsys, "evict", "--disk-dir", str(tmp_path), "--key", "nothex")[0] == 2
    with pytest.raises(SystemExit):
        run(capsys, "ls", "--disk-dir", str(tmp_path), "--tenant", "../x")


def test_unreachable_redis_is_reported_not_raised(capsys: pytest.CaptureFixture[str]) -> None:
    from kvblend.store.localredis import free_port

    url = f"redis://127.0.0.1:{free_port()}/0"
    for command in (["stats"], ["ls"], ["clear"], ["evict", "--to-bytes", "0"]):
        code, out = run(capsys, *command, "--redis-url", url)  # "cleared 0 entries", rc 0, before
        assert code == 1 and "cannot reach the redis tier" in out and "cleared" not in out, command


def test_without_flags_the_commands_open_the_servers_store(capsys: pytest.CaptureFixture[str], filled: list[str],
                                                          tmp_path: Path, redis_server: LocalRedis,
                                                          redis_prefix: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``store.*`` settings were ignored: against a server with its own prefix, ``clear``
    cleared nothing and said so with rc 0."""
    monkeypatch.setenv("KVBLEND_STORE__DISK_DIR", str(tmp_path))
    monkeypatch.setenv("KVBLEND_STORE__REDIS_URL", redis_server.url)
    monkeypatch.setenv("KVBLEND_STORE__REDIS_PREFIX", redis_prefix)
    code, out = run(capsys, "stats", "--tenant", "alice")
    assert code == 0 and "disk     entries        3" in out and "redis    entries        3" in out
    code, out = run(capsys, "clear", "--tenant", "alice")
    assert code == 0 and "cleared 3 entries of tenant alice" in out  # each key once, from both tiers
    code, out = run(capsys, "stats", "--tenant", "alice")
    assert "disk     entries        0" in out and "redis    entries        0" in out


def test_store_commands_work_against_a_cluster(capsys: pytest.CaptureFixture[str], redis_cluster: LocalRedisCluster,
                                               redis_prefix: str) -> None:
    store = RedisStore(redis_cluster.url, 1 << 30, prefix=redis_prefix, cluster=True)
    alice = [keyed(i, tenant="alice") for i in range(6)]
    for key, chunk in alice:
        store.put(key, chunk)
    store.put(*keyed(9, tenant="bob"))
    for key, _ in alice[:2]:  # the two most recently used
        store.get(key)
    unit = store.stats("alice").bytes // 6
    store.close()
    flags = ["--redis-url", redis_cluster.url, "--redis-cluster", "--redis-prefix", redis_prefix]
    code, out = run(capsys, "stats", *flags, "--tenant", "alice")
    assert code == 0 and "redis    entries        6" in out
    code, out = run(capsys, "ls", *flags, "--tenant", "bob")
    assert code == 0 and out.count("\n") == 1 and keyed(9, tenant="bob")[0].digest in out
    code, out = run(capsys, "evict", *flags, "--tenant", "alice", "--to-bytes", str(2 * unit + unit // 2))
    assert code == 0 and "evicted 4 entries" in out
    code, out = run(capsys, "ls", *flags, "--tenant", "alice")
    assert sorted(line.split()[1] for line in out.splitlines()) == sorted(k.digest for k, _ in alice[:2])
    code, out = run(capsys, "clear", *flags, "--tenant", "bob")
    assert "cleared 1 entries of tenant bob" in out
    code, out = run(capsys, "stats", "--redis-url", redis_cluster.url, "--redis-prefix", redis_prefix)
    assert code == 2 and "cluster" in out  # several node URLs without --redis-cluster


def test_an_unreachable_redis_is_named_without_its_password(capsys: pytest.CaptureFixture[str],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    from kvblend.store.localredis import free_port

    monkeypatch.setenv("KVBLEND_STORE__REDIS_URL", f"redis://:s3cret-pw@127.0.0.1:{free_port()}/0")
    code, out = run(capsys, "stats")
    assert code == 1 and "cannot reach" in out and "s3cret" not in out and ":***@" in out


def test_the_commands_add_nothing_to_the_folder_they_read(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("a folder given by mistake")
    for command in ("stats", "ls", "clear"):
        assert run(capsys, command, "--disk-dir", str(tmp_path))[0] == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]  # no .tmp, nothing deleted
