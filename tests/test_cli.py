"""The command line explains itself and refuses bad flags clearly."""

import subprocess
import sys

import pytest

from kvstore.cli import parse_size

METRICS_ON = ("--metrics-port", "0")


def kvstore(*args):
    return subprocess.run(
        [sys.executable, "-m", "kvstore", *args], capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize(
    "cmd", [[], ["serve"], ["router"], ["demo"], ["stats"], ["events"], ["clear"]]
)
def test_help(cmd):
    out = kvstore(*cmd, "--help")
    assert out.returncode == 0, out.stderr
    assert "usage: kvstore" in out.stdout


def test_serve_help_explains_every_flag():
    text = kvstore("serve", "--help").stdout
    for flag in ("--host", "--port", "--pool-size", "--device", "--gpu-copy", "--log-level"):
        assert flag in text
    assert "127.0.0.1" in text


def test_a_gpu_copy_path_that_does_not_exist_is_refused():
    out = kvstore("serve", "--gpu-copy", "fast")
    assert out.returncode == 2
    assert "--gpu-copy" in out.stderr and "pieces" in out.stderr and "blocks" in out.stderr


@pytest.mark.parametrize("device", ["tpu:0", "cuda:x", "npu"])
def test_a_device_that_is_no_device_name_is_refused_naming_the_flag(device):
    out = kvstore("serve", "--device", device, "--no-transfer", "--port=0")
    assert out.returncode == 2, out.stderr
    assert f"--device {device!r}: expected auto, cpu, cuda or cuda:N" in out.stderr


@pytest.mark.parametrize("command", ["serve", "router"])
def test_a_port_another_server_holds_is_refused_not_shared(server, command):
    """gRPC binds with SO_REUSEPORT by default: without BIND_OPTIONS a second server
    would share the port and the kernel would split callers between the two."""
    extra = ["--no-transfer"] if command == "serve" else []
    out = kvstore(command, "--port", str(server.port), *extra)
    assert out.returncode == 1, out.stderr
    assert f"cannot bind 127.0.0.1:{server.port}: Address already in use" in out.stderr


def test_tls_files_grpc_cannot_use_are_named_not_blamed_on_the_port(tmp_path):
    from kvstore.demo import free_port

    files = []
    for name in ("ca", "cert", "key"):
        files.append(tmp_path / f"{name}.pem")
        files[-1].write_text("not PEM\n")
    tls = ["--tls-ca", str(files[0]), "--tls-cert", str(files[1]), "--tls-key", str(files[2])]
    out = kvstore("serve", "--port", str(free_port()), "--no-transfer", *tls)
    assert out.returncode == 1, out.stderr
    assert "the address binds, so check the TLS certificate, key and CA files" in out.stderr


@pytest.mark.parametrize("command", ["serve", "router"])
def test_a_tls_file_that_cannot_be_read_is_named_before_anything_listens(tmp_path, command):
    """Before: a traceback, after the UCX listener and metrics port had started."""
    from kvstore.demo import free_port

    given = {name: tmp_path / f"{name}.pem" for name in ("ca", "cert", "key")}
    for path in list(given.values())[1:]:
        path.write_text("not read\n")
    tls = [f"--tls-{name}={path}" for name, path in given.items()]  # the CA does not exist
    extra = ["--no-transfer"] if command == "serve" else []
    out = kvstore(command, "--port", str(free_port()), *extra, *tls)
    assert out.returncode == 2, out.stderr
    assert f"tls_ca {str(given['ca'])!r}" in out.stderr and "Traceback" not in out.stderr


def test_a_ucx_port_in_use_is_refused_naming_it():
    import socket

    from kvstore.demo import free_port

    with socket.socket() as held:
        held.bind(("0.0.0.0", 0))
        held.listen()
        ucx_port = held.getsockname()[1]
        out = kvstore("serve", "--port", str(free_port()), "--ucx-port", str(ucx_port))
    assert out.returncode == 1, out.stderr
    assert f"cannot listen for UCX peers on port {ucx_port}" in out.stderr


def test_bad_pool_size_is_refused():
    out = kvstore("serve", "--pool-size", "lots")
    assert out.returncode == 2
    assert "4GiB" in out.stderr


@pytest.mark.parametrize(
    "text,value",
    [
        ("1048576", 1 << 20),
        ("4GiB", 4 << 30),
        ("512MiB", 512 << 20),
        ("2G", 2 << 30),
        ("64KiB", 64 << 10),
    ],
)
def test_parse_size(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("extra", [[], ["--no-transfer", "--no-router"]])
def test_serve_is_healthy_then_exits_cleanly_on_sigterm(extra):
    import signal
    import time

    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from kvstore.demo import free_port

    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvstore",
            "serve",
            "--port",
            str(port),
            "--pool-size",
            "16MiB",
            *extra,
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        stub = health_pb2_grpc.HealthStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stderr.read()
            try:
                reply = stub.Check(
                    health_pb2.HealthCheckRequest(service="kvstore.v1.KVStore"), timeout=1
                )
                break
            except grpc.RpcError:
                assert time.monotonic() < deadline, "server never became healthy"
                time.sleep(0.2)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        assert "stopped" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.parametrize("cmd", [["serve"], ["router"]])
def test_etcd_flags_are_explained(cmd):
    text = kvstore(*cmd, "--help").stdout
    for flag in ("--etcd ", "--etcd-ttl", "--etcd-prefix", "--etcd-ca", "--etcd-cert"):
        assert flag in text


@pytest.mark.parametrize(
    "args,words",
    [
        (["serve", "--etcd", "127.0.0.1:2379", "--router", "127.0.0.1:50061"], "drop --router"),
        (["serve", "--etcd", "no-port-here"], "HOST:PORT"),
        (["serve", "--etcd", "127.0.0.1:2379", "--etcd-ttl", "1"], "--etcd-ttl"),
        (["router", "--etcd", "https://127.0.0.1:2379,127.0.0.1:2380"], "every endpoint"),
        (["router", "--etcd", "127.0.0.1:2379", "--etcd-ca", "ca.pem"], "give https://"),
        (["router", "--etcd", "https://127.0.0.1:2379", "--etcd-cert", "c.pem"], "--etcd-key"),
        (["router", "--etcd", "https://127.0.0.1:2379", "--etcd-ca", "/no/ca.pem"], "'/no/ca.pem'"),
        (["serve", "--etcd-key", "k.pem"], "are for --etcd"),
        (["router", "--etcd", "127.0.0.1:2379", "--etcd-prefix", "kvstore"], "--etcd-prefix"),
        (["router", "--etcd", "127.0.0.1:2379", "--store", "127.0.0.1:50051"], "drop --store"),
    ],
)
def test_bad_etcd_flags_are_refused(args, words):
    out = kvstore(*args, "--no-transfer" if args[0] == "serve" else "--port=0")
    assert out.returncode == 2, out.stderr
    assert words in out.stderr


def test_serve_on_etcd_registers_its_store_and_router_and_leaves_on_sigterm():
    import signal

    from kvstore.demo import free_port
    from kvstore.membership.etcd import EtcdConfig
    from kvstore.testing.etcd import EtcdServer
    from tests.membership.conftest import etcd_keys, require_etcd
    from tests.service.test_peer_fetch import wait_healthy

    etcd = EtcdServer(require_etcd())
    etcd.start()
    port = free_port()
    # A long TTL: keys gone right after exit can only have been revoked.
    config = EtcdConfig.parse(etcd.url, 60, "/kvstore-cli-test/")
    proc = subprocess.Popen(
        [
            *(sys.executable, "-m", "kvstore", "serve", "--port", str(port), "--node-id", "n1"),
            *("--pool-size", "16MiB", "--no-transfer", "--device", "cpu"),
            *("--etcd", etcd.url, "--etcd-ttl", "60", "--etcd-prefix", config.prefix),
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_healthy(f"127.0.0.1:{port}", proc)
        keys = etcd_keys(config)
        assert {"stores/n1", f"routers/127.0.0.1%3A{port}"} <= set(keys)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        assert etcd_keys(config) == {}
    finally:
        if proc.poll() is None:
            proc.kill()
        etcd.stop()


@pytest.mark.parametrize(
    "args,words",
    [
        (["serve", "--port", "70000"], "argument --port: '70000' is not a port (0..65535)"),
        (["serve", "--port", "-5"], "argument --port: '-5' is not a port"),
        (["serve", "--ucx-port", "99999"], "argument --ucx-port: '99999' is not a port"),
        (["serve", "--metrics-port", "x"], "argument --metrics-port: 'x' is not a port"),
        (["router", "--port", "65536"], "argument --port: '65536' is not a port"),
        (["stats", "--address", "127.0.0.1:99999"], "argument --address: '127.0.0.1:99999'"),
        (["serve", "--peer", "garbage"], "argument --peer: 'garbage' is not HOST:PORT"),
        (["serve", "--fetch-timeout", "nan"], "argument --fetch-timeout: 'nan' is not a number"),
        (["serve", "--fetch-timeout", "-1"], "argument --fetch-timeout: '-1' is not a number"),
        (["serve", "--etcd-ttl", "0"], "argument --etcd-ttl: '0' is not a whole number >= 1"),
        (["serve", "--pool-size", "99999999T"], "argument --pool-size: '99999999T' is more than"),
        (["serve", "--pool-size", "9" * 400], "is more than 1 PiB"),
        (["router", "--gpu-weight", "1.5"], "--gpu-weight is a fraction of a block's prefill"),
        (["router", "--prefill-ms-per-token", "inf"], "--prefill-ms-per-token must be a number"),
        (
            ["router", "--recompute-weight", "1e308"],
            "--recompute-weight must be a number in 0..1e+06",
        ),
        (["router", "--store-cn", "node-a"], "--store-cn and --store-node name certificate CNs"),
        (
            ["serve", "--store-cn", "node-a", "--no-transfer"],
            "--store-cn and --store-node name certificate CNs",
        ),
        (["router", "--store-node", "node-a"], "argument --store-node: expected CN=NODE_ID"),
        (["router", "--store-node", "a=n1"], "--store-cn and --store-node name certificate CNs"),
        (
            ["router", "--store-node", "a=n1", "--store-node", "b=n1"],
            "node id 'n1' is bound to two certificates",
        ),
        (
            ["serve", "--store-node", "a=n1", "--store-node", "b=n1", "--no-transfer"],
            "node id 'n1' is bound to two certificates",
        ),
        (["router", "--admin", "ops"], "--admin names certificate CNs"),
        (["router", "--tenant", "tenant-a"], "argument --tenant: expected CN=NAMESPACE"),
        (["serve", "--tenant", "a=no space"], "namespace 'no space': must match"),
        (["router", "--tenant", "a=ns1"], "--tenant names certificate CNs"),
        (["serve", "--tenant", "a=ns1", "--no-transfer"], "--tenant names certificate CNs"),
        (
            ["router", "--tenant", "a=ns1", "--tenant", "b=ns1"],
            "namespace 'ns1' is bound to two certificates",
        ),
        (["serve", "--admin", "ops", "--no-transfer"], "--admin names certificate CNs"),
        (["serve", "--admin", "ops", "--no-router"], "--admin names certificate CNs"),
        (["router", "--zmq-endpoint", "w0=bogus"], "'bogus' is no ZMQ endpoint"),
        (["router", "--zmq-endpoint", "w0=tcp://127.0.0.1"], "is no ZMQ endpoint"),
        (
            ["router", "--etcd", "127.0.0.1:2379", "--host", "0.0.0.0", "--insecure"],
            "--host 0.0.0.0 with --etcd",
        ),
        (
            ["serve", "--etcd", "127.0.0.1:2379", "--host", "::", "--insecure", "--no-transfer"],
            "--host :: with --etcd",
        ),
    ],
)
def test_out_of_range_flags_are_refused_naming_them(args, words):
    """Ports were taken modulo 65536 (--port 70000 bound 4464, --address
    127.0.0.1:99999 dialled 34463); sizes, timeouts and weights had no bounds."""
    out = kvstore(*args)
    assert out.returncode == 2, out.stderr
    assert words in out.stderr and "Traceback" not in out.stderr


def test_a_pool_that_cannot_be_allocated_is_refused_naming_it():
    out = kvstore("serve", "--pool-size", "1PiB", "--no-transfer", "--port", "0")
    assert out.returncode == 2, out.stderr
    assert "pool_size 1 PiB cannot be allocated on cpu" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize("host", ["::1", "[::1]"])
def test_an_ipv6_host_binds_and_is_announced_in_brackets(host):
    """gRPC read a bare ::1:PORT as another address, and the refusal blamed the TLS
    files; /metrics could not bind [::1] ("Unknown error -2")."""
    import signal

    proc = subprocess.Popen(
        [sys.executable, "-m", "kvstore", "router", "--host", host, "--port", "0", *METRICS_ON],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline()
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    assert line.startswith("kvstore router listening on [::1]:"), err


@pytest.mark.parametrize("size,text", [(1, "1 B"), (16 << 20, "16 MiB"), (3 << 29, "1.5 GiB")])
def test_sizes_are_written_in_the_unit_they_fill(size, text):
    from kvstore.wire.sizes import format_size

    assert format_size(size) == text


@pytest.mark.parametrize("cmd", ["serve", "router", "demo"])
def test_log_level_takes_any_case(cmd):
    from kvstore.cli import build_parser

    assert build_parser().parse_args([cmd, "--log-level", "WARNING"]).log_level.lower() == "warning"


def test_debug_logging_is_kvstores_own_not_every_librarys():
    """Before: --log-level debug set the root logger, and grpc and asyncio logged
    a debug line per call beside kvstore's."""
    import logging

    from kvstore.cli import setup_logging

    root = logging.getLogger()
    saved = root.level, root.handlers[:], logging.getLogger("kvstore").level
    root.handlers.clear()
    try:
        setup_logging("debug")
        assert logging.getLogger("kvstore.store").isEnabledFor(logging.DEBUG)
        assert not logging.getLogger("grpc._cython.cygrpc").isEnabledFor(logging.DEBUG)
        assert logging.getLogger("grpc._cython.cygrpc").isEnabledFor(logging.INFO)
    finally:
        root.setLevel(saved[0])
        root.handlers[:] = saved[1]
        logging.getLogger("kvstore").setLevel(saved[2])


def test_python_m_kvstore_demo_is_the_demo_command():
    """Before: ``python -m kvstore.demo`` imported the module and did nothing."""
    out = subprocess.run(
        [sys.executable, "-m", "kvstore.demo", "--help"], capture_output=True, text=True
    )
    assert out.returncode == 0 and "usage: kvstore demo" in out.stdout


def test_stats_prints_every_counter_zeros_too(server):
    """Before: protobuf's text form, which leaves out every zero field, so a fresh
    store's misses, evictions and leases were simply missing."""
    out = kvstore("stats", "--address", server.address)
    assert out.returncode == 0, out.stderr
    for line in ("hits: 0", "misses: 0", "evictions: 0", "leases: 0", "ucx_address: "):
        assert line in out.stdout, out.stdout
    assert "pool_bytes: 67108864 (64 MiB)" in out.stdout


def test_ctrl_c_while_the_pool_is_faulted_in_stops_the_store():
    """Before: a SIGINT while a large host pool was zeroed at start-up was lost
    (asyncio's own Ctrl-C handling cancelled a task that start-up swallowed): the
    store went on to serve. Now it stops as soon as start-up ends."""
    import signal

    from kvstore.demo import free_port

    args = ["serve", "--port", str(free_port()), "--device", "cpu", "--pool-size", "3GiB"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvstore", *args, "--no-transfer", "--no-router"],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        for line in proc.stderr:
            if "faulting in the 3 GiB host pool" in line:
                break
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=120) == 0
        rest = proc.stderr.read()
        assert "signal received; shutting down" in rest, rest
        assert "Traceback" not in rest, rest
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
