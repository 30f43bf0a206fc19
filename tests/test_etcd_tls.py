"""The cluster directory over etcd with TLS and user/role authentication, against a real etcd.

One etcd for the module: TLS on its client port with certificates made here (a CA, a server
certificate for 127.0.0.1 and localhost, client certificates), ``--client-cert-auth``, and
authentication on: a ``root`` user, and a ``tutti`` user whose role may read and write only the
prefix ``tutti/`` (as docs/CLUSTER.md says to set it up). ``--auth-token-ttl 1`` lets tokens expire
within the tests, so that the client's re-authentication runs too. Every refused client fails at
once with an :class:`EtcdAuthError` naming the endpoint and the cause, never by its deadline.
"""

from __future__ import annotations

import os
import select
import shutil
import signal
import ssl
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from cluster_fixtures import (ETCD_BIN, free_port, require_etcd, require_mooncake, stop_process, wait_etcd_healthy,
                              wait_port)
from tutti_cluster.cluster.auth import cluster_secret, write_secret_file

pytestmark = pytest.mark.cluster

PASSWORD = "tutti-pw-7f3a9c"  # the tutti user's (a test value: never seen in an error or a log line)
ROOT_PASSWORD = "root-pw-51d0e2"
# A timeout far above any answer: a refused client must fail on its cause, not by this deadline.
SLOW_DEADLINE_S = 30.0


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=30)


def _key_and_csr(d: Path, name: str, cn: str) -> None:
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-keyout", str(d / f"{name}.key"),
             "-out", str(d / f"{name}.csr"), "-subj", f"/CN={cn}")


def _ca(d: Path, name: str) -> None:
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-keyout",
             str(d / f"{name}.key"), "-out", str(d / f"{name}.crt"), "-days", "2", "-subj", f"/CN={name}")


def _sign(d: Path, name: str, ca: str, ext: str) -> None:
    (d / f"{name}.ext").write_text(ext)
    _openssl("x509", "-req", "-in", str(d / f"{name}.csr"), "-CA", str(d / f"{ca}.crt"), "-CAkey", str(d / f"{ca}.key"),
             "-CAcreateserial", "-out", str(d / f"{name}.crt"), "-days", "2", "-extfile", str(d / f"{name}.ext"))


def make_certificates(d: Path) -> None:
    """ca.crt signs server.crt (127.0.0.1, localhost) and the client certificates node.crt (CN
    tutti-node, no etcd user of that name) and user.crt (CN tutti, the etcd user); other-ca.crt
    signs rogue.crt, a client certificate etcd does not trust."""
    _ca(d, "ca")
    _ca(d, "other-ca")
    _key_and_csr(d, "server", "etcd")
    _sign(d, "server", "ca", "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth,clientAuth\n")
    for name, cn, ca in (("node", "tutti-node", "ca"), ("user", "tutti", "ca"), ("rogue", "tutti", "other-ca")):
        _key_and_csr(d, name, cn)
        _sign(d, name, ca, "extendedKeyUsage=clientAuth\n")


class SecureEtcd:
    """One etcd member: TLS client port with client certificates required, authentication on."""

    def __init__(self, d: Path) -> None:
        self.dir = d
        self.port = free_port()
        self.peer_port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        d, client, peer = self.dir, f"https://127.0.0.1:{self.port}", f"http://127.0.0.1:{self.peer_port}"
        cmd = [ETCD_BIN, "--name", "tls-test", "--data-dir", str(d / "etcd-data"),
               "--listen-client-urls", client, "--advertise-client-urls", client,
               "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
               "--initial-cluster", f"tls-test={peer}",
               "--cert-file", str(d / "server.crt"), "--key-file", str(d / "server.key"),
               "--trusted-ca-file", str(d / "ca.crt"), "--client-cert-auth",
               "--auth-token-ttl", "1", "--max-txn-ops", "1024", "--log-level", "warn"]
        with open(d / "etcd.log", "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        wait_port(self.port, proc=self.proc)
        self._wait_healthy()

    def _wait_healthy(self, timeout: float = 20.0) -> None:
        import http.client

        ctx = ssl.create_default_context(cafile=str(self.dir / "ca.crt"))
        ctx.load_cert_chain(str(self.dir / "node.crt"), str(self.dir / "node.key"))
        wait_etcd_healthy(lambda: http.client.HTTPSConnection("127.0.0.1", self.port, timeout=2, context=ctx),
                          timeout)

    def enable_auth(self) -> None:
        """What docs/CLUSTER.md tells an operator to run (with etcdctl), through etcd's Auth API."""
        import grpc
        from etcd3 import etcdrpc
        from etcd3.etcdrpc import auth_pb2

        from tutti_cluster.cluster.etcd import prefix_end

        d = self.dir
        creds = grpc.ssl_channel_credentials((d / "ca.crt").read_bytes(), (d / "node.key").read_bytes(),
                                             (d / "node.crt").read_bytes())
        with grpc.secure_channel(self.endpoint, creds) as ch:
            a = etcdrpc.AuthStub(ch)
            a.RoleAdd(etcdrpc.AuthRoleAddRequest(name="root"), timeout=10)
            a.UserAdd(etcdrpc.AuthUserAddRequest(name="root", password=ROOT_PASSWORD), timeout=10)
            a.UserGrantRole(etcdrpc.AuthUserGrantRoleRequest(user="root", role="root"), timeout=10)
            a.RoleAdd(etcdrpc.AuthRoleAddRequest(name="tutti"), timeout=10)
            perm = auth_pb2.Permission(permType=auth_pb2.Permission.READWRITE, key=b"tutti/",
                                       range_end=prefix_end(b"tutti/"))
            a.RoleGrantPermission(etcdrpc.AuthRoleGrantPermissionRequest(name="tutti", perm=perm), timeout=10)
            a.UserAdd(etcdrpc.AuthUserAddRequest(name="tutti", password=PASSWORD), timeout=10)
            a.UserGrantRole(etcdrpc.AuthUserGrantRoleRequest(user="tutti", role="tutti"), timeout=10)
            # The admin plane and the engines only read: a role that may read the prefix and nothing else.
            a.RoleAdd(etcdrpc.AuthRoleAddRequest(name="tutti-read"), timeout=10)
            perm = auth_pb2.Permission(permType=auth_pb2.Permission.READ, key=b"tutti/",
                                       range_end=prefix_end(b"tutti/"))
            a.RoleGrantPermission(etcdrpc.AuthRoleGrantPermissionRequest(name="tutti-read", perm=perm), timeout=10)
            a.UserAdd(etcdrpc.AuthUserAddRequest(name="tutti-admin", password=PASSWORD), timeout=10)
            a.UserGrantRole(etcdrpc.AuthUserGrantRoleRequest(user="tutti-admin", role="tutti-read"), timeout=10)
            a.AuthEnable(etcdrpc.AuthEnableRequest(), timeout=10)

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc, signal.SIGTERM, 10)
            self.proc = None


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The certificates (:func:`make_certificates`), the password files and the cluster credential."""
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is not installed (it makes the test certificates)")
    d = tmp_path_factory.mktemp("etcd-tls")
    make_certificates(d)
    for name, text in (("password", PASSWORD), ("wrong-password", "not-" + PASSWORD), ("empty", ""),
                       ("shared-password", PASSWORD)):
        (d / name).write_text(text + "\n")
        (d / name).chmod(0o600)  # a password file is owner-only
    (d / "shared-password").chmod(0o640)
    (d / "adir").mkdir()
    os.mkfifo(d / "fifo")
    write_secret_file(d / "cluster.key")  # the cluster credential every node here holds (signed records)
    return d


@pytest.fixture(scope="module")
def secure_etcd(certs: Path) -> Iterator[SecureEtcd]:
    require_etcd()
    srv = SecureEtcd(certs)
    srv.start()
    try:
        srv.enable_auth()
        yield srv
    finally:
        srv.stop()


def settings(etcd: SecureEtcd, **changes: Any) -> dict[str, Any]:
    """The config of a node that etcd accepts (CA, client certificate, user and password), changed."""
    d = etcd.dir
    base: dict[str, Any] = dict(etcd=[f"https://{etcd.endpoint}"], etcd_ca_file=d / "ca.crt",
                                etcd_cert_file=d / "node.crt", etcd_key_file=d / "node.key", etcd_user="tutti",
                                etcd_password_file=d / "password", cluster_secret_file=d / "cluster.key")
    base.update(changes)
    return {k: v for k, v in base.items() if v is not None}


def directory(etcd: SecureEtcd, node_id: str, **changes: Any):  # type: ignore[no-untyped-def]
    from tutti_cluster.cluster.directory import EtcdDirectory
    from tutti_cluster.cluster.etcd import EtcdSecurity
    from tutti_cluster.config import TuttiConfig

    cfg = TuttiConfig(**settings(etcd, **changes))
    return EtcdDirectory(",".join(cfg.etcd), node_id, lease_ttl_s=5, timeout_s=SLOW_DEADLINE_S,
                         security=EtcdSecurity.from_config(cfg), secret=cluster_secret(cfg))


def test_a_node_with_the_ca_its_certificate_and_its_user_registers_and_looks_up(secure_etcd: SecureEtcd):
    """The accepted credentials work end to end, also after the token expired (re-authentication);
    the user's role keeps it inside tutti/."""
    from tutti_cluster.cluster.directory import NodeRecord
    from tutti_cluster.cluster.etcd import EtcdAuthError

    a, b = directory(secure_etcd, "tls-A"), directory(secure_etcd, "tls-B")
    try:
        a.start(NodeRecord("tls-A", "127.0.0.1:1", "127.0.0.1:2"))
        assert a.register([11, 12, 13]) is True
        assert b.lookup([11, 12, 13, 14], prefix=False) == [["tls-A"], ["tls-A"], ["tls-A"], []]
        rec = b.node("tls-A")
        assert rec is not None and rec.stage == "127.0.0.1:2"
        taken = b.client.authentications
        time.sleep(2.5)  # past --auth-token-ttl 1 (etcd drops tokens once a second): the next call's
        assert b.lookup([11]) == [["tls-A"]]  # token is refused, taken again, and the call retried
        assert b.client.authentications == taken + 1 and b.stats.lookup_errors == 0
        with pytest.raises(EtcdAuthError, match="PERMISSION_DENIED"):
            b.client.put(b"not-tutti/x", b"1")
        a.stop()
        assert b.lookup([11]) == []  # revoked with the lease
    finally:
        a.stop(revoke=False)
        b.stop(revoke=False)


@pytest.mark.parametrize("case, changes, cause", [
    ("no CA: the system's CAs do not know etcd's", {"etcd_ca_file": None}, "TLS handshake failed"),
    ("no client certificate", {"etcd_cert_file": None, "etcd_key_file": None}, "TLS handshake failed"),
    ("a client certificate of another CA", {"cert": "rogue"}, "TLS handshake failed"),
    ("a wrong password", {"etcd_password_file": "wrong-password"}, "authentication of user 'tutti' refused"),
    ("a certificate whose name is no etcd user, no password", {"etcd_user": None, "etcd_password_file": None},
     "PERMISSION_DENIED"),
])
def test_a_refused_client_fails_at_once_with_the_endpoint_and_the_cause(secure_etcd: SecureEtcd, case: str,
                                                                         changes: dict[str, Any], cause: str):
    from tutti_cluster.cluster.directory import NodeRecord
    from tutti_cluster.cluster.etcd import EtcdAuthError

    d = secure_etcd.dir
    changes = dict(changes)
    if changes.pop("cert", None) == "rogue":
        changes.update(etcd_cert_file=d / "rogue.crt", etcd_key_file=d / "rogue.key")
    if isinstance(changes.get("etcd_password_file"), str):
        changes["etcd_password_file"] = d / changes["etcd_password_file"]
    node = directory(secure_etcd, "tls-X", **changes)
    try:
        with pytest.raises(EtcdAuthError) as info:
            node.client.get_prefix(b"tutti/n/")
        msg = str(info.value)
        assert f"etcd {secure_etcd.endpoint}: " in msg and cause in msg, (case, msg)
        assert info.value.code != "DEADLINE_EXCEEDED", (case, msg)  # its cause, not the deadline
        assert PASSWORD not in msg and "not-" + PASSWORD not in msg
        # A node does not start against an etcd that refuses it; a lookup is a miss (counted), no error.
        with pytest.raises(EtcdAuthError):
            node.start(NodeRecord("tls-X", "127.0.0.1:1", "127.0.0.1:2"))
        assert node.lookup([11]) == [] and node.stats.lookup_errors == 1
    finally:
        node.stop(revoke=False)


def test_a_plaintext_client_is_refused_and_told_about_tls(secure_etcd: SecureEtcd):
    from tutti_cluster.cluster.etcd import EtcdClient, EtcdError

    c = EtcdClient(secure_etcd.endpoint, timeout_s=SLOW_DEADLINE_S)
    try:
        with pytest.raises(EtcdError) as info:
            c.get_prefix(b"tutti/")
        assert info.value.code == "UNAVAILABLE" and "https://" in str(info.value), str(info.value)
    finally:
        c.close()


@pytest.mark.parametrize("changes, message", [
    ({"etcd_ca_file": "missing.crt"}, "etcd_ca_file {d}/missing.crt: cannot open: No such file or directory"),
    ({"etcd_password_file": "fifo"}, "etcd_password_file {d}/fifo: not a regular file"),
    ({"etcd_password_file": "adir"}, "etcd_password_file {d}/adir: not a regular file"),
    ({"etcd_password_file": "empty"}, "etcd_password_file {d}/empty: empty"),
    ({"etcd_password_file": "shared-password"}, "etcd_password_file {d}/shared-password: mode 0640 lets its group"),
    ({"etcd_ca_file": "password"}, "etcd_ca_file {d}/password: not PEM certificates"),
    ({"etcd_key_file": "other-ca.key"}, "etcd_key_file {d}/other-ca.key: not a PEM certificate and its private key"),
    ({"etcd_key_file": None}, "etcd_cert_file and etcd_key_file go together"),
    ({"etcd_password_file": None}, "etcd_user and etcd_password_file go together"),
    ({"etcd": ["http://127.0.0.1:2379"]}, "etcd endpoints say http:// but etcd_ca_file"),
    ({"etcd": ["https://127.0.0.1:2379", "http://127.0.0.1:2380"]}, "mix http:// and https://"),
])
def test_unusable_credential_files_are_config_errors(certs: Path, changes: dict[str, Any], message: str):
    """Each names the setting and the file; a FIFO is refused without blocking on it."""
    from tutti_cluster.cluster.etcd import EtcdSecurity
    from tutti_cluster.config import TuttiConfig
    from tutti_cluster.errors import ConfigError

    d = certs
    base: dict[str, Any] = dict(etcd=["127.0.0.1:2379"], etcd_ca_file=d / "ca.crt", etcd_cert_file=d / "node.crt",
                                etcd_key_file=d / "node.key", etcd_user="tutti", etcd_password_file=d / "password")
    for k, v in changes.items():
        base[k] = d / v if isinstance(v, str) else v
    cfg = TuttiConfig(**{k: v for k, v in base.items() if v is not None})
    with pytest.raises(ConfigError) as info:
        EtcdSecurity.from_config(cfg)
    assert message.format(d=d) in str(info.value)
    assert PASSWORD not in str(info.value)


def test_a_password_file_through_a_symlink_is_read_and_never_shown(tmp_path: Path):
    """A Kubernetes Secret volume mounts each key as a symbolic link: followed, and the password
    shows in no repr."""
    from tutti_cluster.cluster.etcd import EtcdSecurity
    from tutti_cluster.config import TuttiConfig

    (tmp_path / "..data").mkdir()
    (tmp_path / "..data" / "password").write_text(PASSWORD + "\r\n")
    (tmp_path / "..data" / "password").chmod(0o400)
    (tmp_path / "password").symlink_to(tmp_path / "..data" / "password")
    sec = EtcdSecurity.from_config(TuttiConfig(etcd=["etcd:2379"], etcd_user="tutti",
                                               etcd_password_file=tmp_path / "password"))
    assert sec.password == PASSWORD and sec.user == "tutti" and not sec.tls
    assert PASSWORD not in repr(sec)
    assert EtcdSecurity.from_config(TuttiConfig(etcd=["https://etcd:2379"])).tls  # https: TLS, the system's CAs


def test_the_admin_plane_reads_the_directory_over_tls_with_a_read_only_user(secure_etcd: SecureEtcd):
    """`tutti admin serve` takes the same settings: with a user that may only read tutti/ it lists
    the nodes (and can write nothing); a wrong password is a 503 that names etcd's answer."""
    from tutti_cluster.cluster.etcd import EtcdAuthError

    pytest.importorskip("httpx")
    from tutti_cluster.cluster.directory import NodeRecord
    from tutti_cluster.config import TuttiConfig
    from tutti_control.cluster import ClusterBackend
    from tutti_control.errors import ApiError

    a = directory(secure_etcd, "tls-admin-A")
    good = ClusterBackend(TuttiConfig(**settings(secure_etcd, etcd_user="tutti-admin")), "token")
    bad = ClusterBackend(TuttiConfig(**settings(secure_etcd, etcd_password_file=secure_etcd.dir / "wrong-password")),
                         "token")
    try:
        a.start(NodeRecord("tls-admin-A", "127.0.0.1:1", "127.0.0.1:2"))
        assert "tls-admin-A" in good.records()
        with pytest.raises(EtcdAuthError, match="PERMISSION_DENIED for user 'tutti-admin'"):
            good.directory.client.put(b"tutti/n/forged", b"{}")
        with pytest.raises(ApiError) as info:
            bad.records()
        assert info.value.status == 503 and "authentication of user 'tutti' refused" in info.value.message
    finally:
        a.stop()
        good.close()
        bad.close()


def _up(tmp: Path, *argv: str) -> subprocess.Popen[str]:
    code = "import sys; from tutti_cluster.cli import main; sys.exit(main(sys.argv[1:]))"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TUTTI_")}
    return subprocess.Popen(
        [sys.executable, "-c", code, "up", "--data-dir", str(tmp / "node"), "--paths", str(tmp / "ssd"),
         "--capacity-gb", "0.01", "--admin-port", "0", "--lease-ttl-s", "3", *argv],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def test_tutti_up_with_etcd_tls_and_a_user_publishes_the_node(secure_etcd: SecureEtcd, tmp_path: Path):
    """A real `tutti up` with the flags an operator gives. A missing password file, or a wrong
    password, stops it at once with one error line that names the file, or etcd and the cause, and
    never shows the password."""
    require_mooncake()
    d = secure_etcd.dir
    flags = ["--etcd", f"https://{secure_etcd.endpoint}", "--etcd-ca-file", str(d / "ca.crt"),
             "--etcd-cert-file", str(d / "node.crt"), "--etcd-key-file", str(d / "node.key"),
             "--etcd-user", "tutti", "--cluster-secret-file", str(d / "cluster.key")]
    missing = _up(tmp_path / "missing", *flags, "--etcd-password-file", str(d / "no-such-file"))
    _, err = missing.communicate(timeout=120)
    assert missing.returncode == 2 and f"tutti: error: etcd_password_file {d}/no-such-file: cannot open" in err, err
    bad = _up(tmp_path / "bad", *flags, "--etcd-password-file", str(d / "wrong-password"), "--node-id", "tls-up-bad")
    out, err = bad.communicate(timeout=120)
    assert bad.returncode == 2, err
    line = [x for x in err.splitlines() if x.startswith("tutti: error:")]
    assert line and f"etcd {secure_etcd.endpoint}: authentication of user 'tutti' refused" in line[0], err
    assert PASSWORD not in err + out
    up = _up(tmp_path / "good", *flags, "--etcd-password-file", str(d / "password"), "--node-id", "tls-up")
    reader = directory(secure_etcd, "tls-reader")
    try:
        assert up.stdout is not None
        assert select.select([up.stdout], [], [], 60)[0], "tutti up did not say it serves"
        assert "serving: cluster" in up.stdout.readline()
        assert reader.node("tls-up") is not None
    finally:
        up.send_signal(signal.SIGTERM)
        try:
            _, err = up.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            up.kill()
            _, err = up.communicate()
        reader.stop(revoke=False)
    assert up.returncode == 0, err
    assert PASSWORD not in err
