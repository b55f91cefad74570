"""kvstore on an etcd that speaks only TLS, wants client certificates, and has
its auth on: each process is the etcd user its certificate's CN names, with
read and write on one key prefix (README, Several nodes on etcd)."""

from __future__ import annotations

import subprocess
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvstore.wire.errors import Code, KVError
from tests.conftest import wait_for
from tests.membership.conftest import (
    TTL_S,
    Cluster,
    RouterThread,
    etcd_keys,
    etcd_read,
    require_etcd,
)
from tests.membership.test_membership import generations, store_thread

ALLOWED = "/kvstore-tls/"  # the prefix etcd user "kvstore" may read and write


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    """An etcd with client TLS and auth on; users root and kvstore (no passwords:
    they log in by certificate), kvstore granted readwrite on ALLOWED only."""
    from kvstore.testing.etcd import EtcdServer
    from kvstore.testing.pki import Pki

    binary = require_etcd()
    pki = Pki(tmp_path_factory.mktemp("etcd-pki"))
    root = pki.issue("root")
    server = EtcdServer(binary, tls=pki.server)
    server.start()
    etcdctl = str(Path(binary).parent / "etcdctl")

    def admin(*args: str) -> None:
        tls = (f"--cacert={pki.ca}", f"--cert={root.cert}", f"--key={root.key}")
        done = subprocess.run(
            [etcdctl, f"--endpoints={server.url}", *tls, *args],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert done.returncode == 0, f"etcdctl {' '.join(args)}: {done.stderr}"

    try:
        for step in (
            ("user", "add", "root", "--no-password"),
            ("user", "grant-role", "root", "root"),
            ("role", "add", "kvstore"),
            ("role", "grant-permission", "kvstore", "--prefix=true", "readwrite", ALLOWED),
            ("user", "add", "kvstore", "--no-password"),
            ("user", "grant-role", "kvstore", "kvstore"),
            ("auth", "enable"),
        ):
            admin(*step)
        yield SimpleNamespace(url=server.url, pki=pki, kvstore=pki.issue("kvstore"))
    finally:
        server.stop()


def config_of(secured, tls_files, prefix: str = ""):
    """An EtcdConfig on ``secured`` as the holder of ``tls_files`` (None: no
    client certificate, only the CA), under a fresh prefix in ALLOWED."""
    from kvstore.membership.etcd import EtcdConfig, EtcdTls

    ca = str(secured.pki.ca)
    tls = EtcdTls(ca) if tls_files is None else EtcdTls(ca, tls_files.cert, tls_files.key)
    prefix = prefix or f"{ALLOWED}{uuid.uuid4().hex[:8]}/"
    return EtcdConfig.parse(secured.url, TTL_S, prefix, tls)


def test_a_replica_and_a_store_meet_over_tls_as_the_etcd_user_of_their_certificate(secured):
    config = config_of(secured, secured.kvstore)
    router = RouterThread(config)
    store = store_thread(config, "s1")
    try:
        joined = etcd_keys(config, "stores/")["stores/s1"].create_revision
        assert wait_for(lambda: generations([router], "s1") == [joined], timeout=10)
    finally:
        store.stop()
        router.stop()
    assert wait_for(lambda: "stores/s1" not in etcd_keys(config, "stores/"), timeout=5)


def test_kvstore_serve_takes_its_etcd_tls_from_its_flags(secured, tmp_path):
    config = config_of(secured, secured.kvstore)
    cluster = Cluster(tmp_path, config)
    try:
        _, store = cluster.store("s2")
        assert wait_for(lambda: "stores/s2" in etcd_keys(config, "stores/"), timeout=60), (
            store.tail()
        )
    finally:
        cluster.close()


def test_rotated_tls_files_are_taken_when_etcd_refuses_the_old_ones(tmp_path):
    """One endpoint, its CA and client certificate replaced (etcd restarted on the
    new CA): the running client reads the files again. Before, only a client with
    several endpoints was made anew, so this one stayed UNAVAILABLE until restart
    (found by review)."""
    import asyncio
    import shutil

    from kvstore.membership.etcd import Etcd, EtcdConfig, EtcdTls
    from kvstore.testing.etcd import EtcdServer
    from kvstore.testing.pki import Pki

    old, new = Pki(tmp_path / "old", "ca-old"), Pki(tmp_path / "new", "ca-new")
    files = [str(tmp_path / name) for name in ("ca.pem", "cert.pem", "key.pem")]

    def install(pki) -> None:
        issued = pki.issue("kvstore")
        for src, dst in zip((issued.ca, issued.cert, issued.key), files, strict=True):
            shutil.copy(src, dst)

    install(old)
    server = EtcdServer(require_etcd(), tls=old.server)
    server.start()
    config = EtcdConfig.parse(server.url, TTL_S, "/rotated/", EtcdTls(*files))

    async def rotate_then_list() -> list[str]:
        etcd = Etcd(config)
        try:
            await etcd.list_prefix(config.prefix)
            server.kill()
            server.tls = new.server
            install(new)
            server.start()
            outcomes = []
            for _ in range(6):
                try:
                    await etcd.list_prefix(config.prefix)
                    outcomes.append("ok")
                except KVError as exc:
                    outcomes.append(exc.code.name)
                await asyncio.sleep(0.2)
            return outcomes
        finally:
            await etcd.close()

    try:
        outcomes = asyncio.run(rotate_then_list())
    finally:
        server.stop()
    assert outcomes[-1] == "ok", outcomes


def test_a_call_etcd_refuses_leaves_the_other_calls_and_watches_on_the_channel(secured):
    """One endpoint over TLS: a call that fails for its own reasons (here a
    transaction etcd refuses) must not close the client every user of it shares.
    Found by review of the rotation fix, which made a new client on any failure:
    a live watch ended, and every Directory would list again."""
    import asyncio

    from kvstore.membership.etcd import Etcd, put

    config = config_of(secured, secured.kvstore)

    async def watch_across_a_refusal() -> tuple[list[str], list[str]]:
        etcd = Etcd(config)
        seen, ended = [], []
        _, revision = await etcd.list_prefix(config.prefix)

        async def follow():
            try:
                async for change in etcd.watch_prefix(config.prefix, revision + 1):
                    seen.append(change.entry.key.removeprefix(config.prefix))
            except KVError as exc:
                ended.append(exc.message)

        task = asyncio.create_task(follow())
        try:
            await asyncio.sleep(0.3)
            await etcd.txn([], [put(config.prefix + "a", b"1")])
            with pytest.raises(KVError):  # one key twice in a transaction: etcd refuses
                await etcd.txn([], [put(config.prefix + "x", b"1"), put(config.prefix + "x", b"2")])
            await etcd.txn([], [put(config.prefix + "b", b"1")])
            for _ in range(50):
                if len(seen) == 2 or ended:
                    break
                await asyncio.sleep(0.05)
        finally:
            task.cancel()
            await etcd.close()
        return seen, ended

    assert asyncio.run(watch_across_a_refusal()) == (["a", "b"], [])


@pytest.mark.parametrize(
    "who,prefix,words",
    [
        ("kvstore", "/elsewhere/", "permission denied"),  # a user, outside its prefix
        ("stranger", "", "permission denied"),  # a valid certificate, no such etcd user
        (None, "", "handshake"),  # no client certificate at all
    ],
)
def test_what_etcd_refuses_is_unavailable_with_etcds_reason(secured, who, prefix, words):
    files = None if who is None else secured.pki.issue(who)
    config = config_of(secured, files, prefix)

    async def write(etcd):
        await etcd.recreate(config.prefix + "k", b"v", 0)

    with pytest.raises(KVError) as refused:
        etcd_read(config, write)
    assert refused.value.code is Code.UNAVAILABLE
    assert words in refused.value.message.lower()
    assert config.endpoints[0] in refused.value.message


@pytest.mark.parametrize(
    "urls,files,words",
    [
        ("https://127.0.0.1:1,http://127.0.0.1:2", {}, "every endpoint"),
        ("ftp://127.0.0.1:1", {}, "http:// or https://"),
        ("http://127.0.0.1:1", {"ca": "ca.pem"}, "give https://"),
        ("https://127.0.0.1:1", {"cert": "c.pem"}, "--etcd-key"),
        ("https://127.0.0.1:1", {"ca": "/no/such/ca.pem"}, "--etcd-ca '/no/such/ca.pem'"),
    ],
)
def test_etcd_tls_settings_are_checked_at_start(urls, files, words):
    from kvstore.membership.etcd import EtcdConfig, EtcdTls

    with pytest.raises(ValueError, match=words.replace("?", r"\?").replace(".", r"\.")):
        EtcdConfig.parse(urls, TTL_S, ALLOWED, EtcdTls(**files) if files else None)
